// Package remote serves an object that lives in HTTP(S) or S3-compatible
// storage as a read-only byte range that any format can be opened on, as
// on a local file.
//
// The package is in two layers. A Backend speaks one protocol: it pins the
// object's size and identity once (Stat) and fetches byte ranges of exactly
// that version (ReadRange). Above it, the shared layer (the File in this
// package) keeps the connection pool busy, reads ahead of a sequential
// reader, caches blocks within a bound, lets concurrent readers of one
// block share one request, and retries temporary failures with backoff up
// to the reconnect timeout. Backends live in their own packages
// (remote/http for http:// and https://, remote/s3 for s3://) so that a
// protocol's client library never leaks into the other.
package remote

import (
	"context"
	"errors"
	"time"
)

// Object is what a Backend pins at open: every later ReadRange is asked to
// be of this version, and an object replaced since then is an error
// (ErrChanged), never a mix of two versions.
type Object struct {
	Size int64
	// ETag is the entity tag as the server sent it (with its quotes);
	// empty when the server sends none.
	ETag string
	// LastModified is the server's Last-Modified; zero when it sends none.
	// A backend uses it (If-Unmodified-Since) only where there is no ETag.
	LastModified time.Time
}

// Backend is one protocol's access to one object. Its methods are safe for
// concurrent use; the shared layer calls ReadRange from many goroutines at
// once, up to the connection count it was given.
type Backend interface {
	// Stat fetches the object's size and identity. Called once, at open.
	Stat(ctx context.Context) (Object, error)
	// ReadRange fills all of p with the object's bytes at off, of the
	// version obj names (off+len(p) <= obj.Size; the caller checks). A
	// backend checks what the server says before it trusts it: the status,
	// the range the server says it sent, the body's length. It returns
	// ErrChanged when the object is no longer obj, an error wrapping
	// ErrTemporary for a failure worth retrying (a reset, a timeout, a 5xx,
	// a 429), and any other error for one that is not (403, 404, a reply
	// that lies). It never returns a partly filled p as success.
	ReadRange(ctx context.Context, obj Object, p []byte, off int64) error
	// String names the object for logs and errors: never credentials, a
	// signed query or a password in a URL.
	String() string
	// Close releases the backend's connections.
	Close() error
}

// VectorBackend is a Backend that fills several buffers, in order, from
// one range request: the shared layer then reads a GET straight into its
// cache's blocks, with no copy through a buffer of the GET's size.
// ReadRangev is ReadRange of the concatenation of bufs, with the same
// checks and errors.
type VectorBackend interface {
	Backend
	ReadRangev(ctx context.Context, obj Object, bufs [][]byte, off int64) error
}

var (
	// ErrChanged: the object was replaced or modified after it was opened.
	ErrChanged = errors.New("remote object changed since it was opened")
	// ErrTemporary marks a failure that a retry may cure.
	ErrTemporary = errors.New("temporary failure")
)

// Temporary wraps err so that errors.Is(err, ErrTemporary) holds, keeping
// err's own message and chain.
func Temporary(err error) error {
	if err == nil || errors.Is(err, ErrTemporary) {
		return err
	}
	return temporaryError{err}
}

type temporaryError struct{ err error }

func (e temporaryError) Error() string { return e.err.Error() }
func (e temporaryError) Unwrap() []error {
	return []error{e.err, ErrTemporary}
}
