package remote

// Retries and deadlines: a fetch retries temporary failures with backoff
// until the reconnect timeout, counted from when it was asked for or from
// the last request that succeeded, whichever is later.

import (
	"context"
	"errors"
	"time"
)

// minAttempt is the least time a fetch gets, retries included, when the
// reconnect timeout is shorter (0 means "no retries", not "no time").
const minAttempt = time.Second

func (f *File) timeout() time.Duration { return max(f.o.ReconnectTimeout, minAttempt) }

// deadline is when a fetch asked for at asked fails: the reconnect
// timeout after it was asked for or after the last request that
// succeeded, whichever is later. Waiting for a connection counts: behind
// a server that hangs, a queued fetch fails when the one in flight does,
// not one timeout after another; behind a busy but working one it waits
// its turn.
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
