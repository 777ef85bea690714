package coroutines

import (
	"context"
	"sync"
)

// InFlight counts requests in flight and lets one caller at a time drain
// them. It is a [sync.RWMutex] underneath (a request a reader, a drain the
// writer): one atomic add per Begin and End, no lock when nobody drains.
type InFlight struct {
	mu sync.RWMutex
}

// Begin marks a request in flight. It blocks while a drain holds the export.
func (f *InFlight) Begin() { f.mu.RLock() }

// TryBegin is Begin for a caller that must not wait: false, with nothing
// marked, while a drain holds the export or waits for it.
func (f *InFlight) TryBegin() bool { return f.mu.TryRLock() }

// End marks the request begun by Begin (or TryBegin) as finished.
func (f *InFlight) End() { f.mu.RUnlock() }

// Drain waits until no request is in flight and keeps new ones out until
// release is called. If ctx ends first, Drain returns its error and holds
// nothing.
func (f *InFlight) Drain(ctx context.Context) (release func(), err error) {
	got := make(chan struct{})
	go func() {
		f.mu.Lock()
		close(got)
	}()
	select {
	case <-got:
		return f.mu.Unlock, nil
	case <-ctx.Done():
		// The goroutine still gets the lock eventually; hand it back at once.
		go func() {
			<-got
			f.mu.Unlock()
		}()
		return nil, ctx.Err()
	}
}
