package coroutines

import "context"

// Path is how a request reaches the I/O layer, carried on its context: a
// serve loop knows things about a request that decide how the layers
// below should issue its I/O (block the thread, try the page cache first,
// spin on a peer's reply), and the context is the one thing every layer in
// between passes on unchanged. It is the only mark a request carries.
type Path uint8

const (
	// Fresh: the request runs in a goroutine of its own and nothing was
	// tried for it yet. A context without a mark is Fresh.
	Fresh Path = iota
	// AfterMiss: as Fresh, after its no-wait try (aio's TryReadAt,
	// through the format's) missed the page cache: the I/O layer goes to
	// the device at once instead of trying again, so a miss costs one
	// failed attempt, not two.
	AfterMiss
	// Lone: the caller has nothing else to serve until the request completes
	// (a serve loop with nothing else in flight or waiting; a remote file's
	// reader making its own GET). I/O layers may then block the calling thread
	// in a plain system call, or spin briefly on a peer's reply, so that the
	// completion wakes that very thread instead of going through a shared
	// ring (docs/design.md, Lone requests); requests with company batch there.
	Lone
)

type pathKey struct{}

// WithPath marks ctx as carrying a request that came by path p. It
// allocates: make one context per path and reuse it (Handoff does).
func WithPath(ctx context.Context, p Path) context.Context {
	return context.WithValue(ctx, pathKey{}, p)
}

// PathOf is the path ctx was marked with (Fresh when it has none).
func PathOf(ctx context.Context) Path {
	p, _ := ctx.Value(pathKey{}).(Path)
	return p
}
