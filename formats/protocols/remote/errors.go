package remote

// The errors a read returns: the reconnect timeout's, and IOError, EIO to
// errno mappers whatever the cause, logged once when the object changed.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"golang.org/x/sys/unix"
)

var errBadReply = errors.New("server's reply makes no sense")

var errClosed = errors.New("remote file closed")

func (f *File) closedError() error { return fmt.Errorf("%s: %w", f.name, errClosed) }

// timeoutError: the reconnect timeout passed with no good answer. It does
// not wrap context.DeadlineExceeded: that is the caller's interruption
// (EINTR), this is the server's failure (EIO).
type timeoutError struct {
	after time.Duration
	last  error
}

func (e *timeoutError) Error() string {
	return fmt.Sprintf("no good answer within the reconnect timeout (%v); last: %v", e.after, e.last)
}

// IOError is what a failed read returns: EIO to errno mappers, and
// ErrChanged when that is the cause, but none of the cause's own errnos
// or context errors (a reset is not the reader's ECONNRESET, a request's
// timeout is not the reader's interruption).
type IOError struct {
	msg     string
	changed bool
}

func (e *IOError) Error() string { return e.msg }

func (e *IOError) Unwrap() []error {
	if e.changed {
		return []error{unix.EIO, ErrChanged}
	}
	return []error{unix.EIO}
}

func (f *File) ioError(err error, off, n int64) error {
	if errors.Is(err, errClosed) || errors.Is(err, context.Canceled) && f.ctx.Err() != nil {
		return f.closedError()
	}
	changed := errors.Is(err, ErrChanged)
	if changed && !f.changed.Swap(true) {
		f.log.Error("remote object changed while exported: reads fail with EIO from now on", "object", f.name,
			"etag", f.obj.ETag, "size", f.obj.Size)
	}
	return &IOError{msg: fmt.Sprintf("%s: read %d bytes at %d: %v", f.name, n, off, err), changed: changed}
}
