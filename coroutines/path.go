package coroutines

import "context"

// How a request reached the I/O layer, carried on its context: a serve loop
// knows things about a request that decide how aio should issue its I/O
// (block the thread, or try the page cache first), and the context is the
// one thing every layer in between passes on unchanged.

type (
	loneKey   struct{}
	missedKey struct{}
)

// Lone marks ctx as carrying a lone request: its caller has nothing else to
// serve until the request completes (a serve loop with no other request in
// flight and none waiting to be read). I/O layers may then block the
// calling thread in a plain system call, whose completion wakes that very
// thread, instead of submitting to a shared ring and parking: measured at
// queue depth one, a 4 KiB O_DIRECT read through the ring made three
// threads wake in turn (the submitter for the completion's task work, the
// completion goroutine, the waiter) and took twice as long. Requests with
// company keep using the ring, where their submissions batch.
//
// Make one such context and reuse it: Lone allocates.
func Lone(ctx context.Context) context.Context { return context.WithValue(ctx, loneKey{}, true) }

// IsLone says whether ctx was marked by Lone.
func IsLone(ctx context.Context) bool { return ctx.Value(loneKey{}) != nil }

// Missed marks ctx as carrying a request whose no-wait attempt (aio's
// TryReadAt, through the format's) has just missed the page cache: the I/O
// layer goes to the device at once instead of trying again. A miss thus
// costs one failed attempt, not two.
//
// Make one such context and reuse it: Missed allocates.
func Missed(ctx context.Context) context.Context { return context.WithValue(ctx, missedKey{}, true) }

// HasMissed says whether ctx was marked by Missed.
func HasMissed(ctx context.Context) bool { return ctx.Value(missedKey{}) != nil }
