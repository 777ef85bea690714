package fuse

import (
	"context"
	"time"
)

// cancelCtx is the request's go-fuse cancel channel (closed when the kernel
// interrupts the request) seen as a [context.Context]. A channel fits in an
// interface without allocating, so every request gets a context for free.
type cancelCtx <-chan struct{}

var _ context.Context = cancelCtx(nil)

func (c cancelCtx) Deadline() (time.Time, bool) { return time.Time{}, false }
func (c cancelCtx) Done() <-chan struct{}       { return c }
func (c cancelCtx) Value(any) any               { return nil }

func (c cancelCtx) Err() error {
	select {
	case <-c:
		return context.Canceled
	default:
		return nil
	}
}
