package remote

// Retries up to the reconnect timeout, and the errors a read ends in.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"golang.org/x/sys/unix"
)

// minAttempt is the least time a fetch gets, retries included, when the
// reconnect timeout is shorter (0 means "no retries", not "no time").
const minAttempt = time.Second

func (f *File) timeout() time.Duration { return max(f.o.ReconnectTimeout, minAttempt) }

// deadline is when a fetch asked for at asked fails: the reconnect timeout
// after it was asked or after the last request that succeeded, whichever
// is later. So behind a server that hangs a queued fetch fails when the
// one in flight does; behind a busy but working one it waits its turn.
func (f *File) deadline(asked time.Time) time.Time {
	last := time.Unix(0, f.lastOK.Load())
	if last.After(asked) {
		asked = last
	}
	return asked.Add(f.timeout())
}

// retry runs op until it succeeds, fails for good, or the deadline (the
// reconnect timeout after the fetch was asked for) has passed; each try's
// context ends at that deadline too, so that a server that hangs or
// trickles cannot hold a read past it.
func (f *File) retry(ctx context.Context, deadline time.Time, op func(context.Context) error) error {
	actx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	backoff := 10 * time.Millisecond
	for {
		err := op(actx)
		switch {
		case err == nil:
			return nil
		case ctx.Err() != nil:
			return ctx.Err() // the caller (or Close) gave up, not the server
		case errors.Is(err, ErrChanged):
			return err
		case actx.Err() != nil:
			return &timeoutError{after: f.timeout(), last: err}
		case !errors.Is(err, ErrTemporary):
			return err
		}
		if time.Now().Add(backoff).After(deadline) {
			return &timeoutError{after: f.timeout(), last: err}
		}
		t := time.NewTimer(backoff)
		select {
		case <-t.C:
		case <-actx.Done():
			t.Stop()
		}
		backoff = min(2*backoff, time.Second)
	}
}

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
