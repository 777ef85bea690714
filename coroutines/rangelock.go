package coroutines

import (
	"context"
	"sync"
)

// RangeLock serializes holders of overlapping byte ranges [off, off+n) and
// never holds back holders of disjoint ones.
//
// Held ranges are kept in a short list: the number of requests in flight is
// bounded by the queue depth, and a linear scan of a few dozen entries beats
// a tree at that size.
type RangeLock struct {
	mu   sync.Mutex
	held []*heldRange
}

type heldRange struct {
	off, end int64
	// released is closed when the holder unlocks; waiters then retry.
	released chan struct{}
}

// Lock waits until no held range overlaps [off, off+n) and takes it. The
// returned function releases it. If ctx ends first, Lock returns ctx's error.
func (l *RangeLock) Lock(ctx context.Context, off, n int64) (unlock func(), err error) {
	end := off + n
	for {
		l.mu.Lock()
		var conflict *heldRange
		for _, h := range l.held {
			if h.off < end && off < h.end {
				conflict = h
				break
			}
		}
		if conflict == nil {
			h := &heldRange{off: off, end: end, released: make(chan struct{})}
			l.held = append(l.held, h)
			l.mu.Unlock()
			return func() { l.unlock(h) }, nil
		}
		l.mu.Unlock()
		select {
		case <-conflict.released:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

func (l *RangeLock) unlock(h *heldRange) {
	l.mu.Lock()
	for i, x := range l.held {
		if x == h {
			last := len(l.held) - 1
			l.held[i] = l.held[last]
			l.held[last] = nil
			l.held = l.held[:last]
			break
		}
	}
	l.mu.Unlock()
	close(h.released)
}
