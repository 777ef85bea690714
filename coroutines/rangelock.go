package coroutines

import (
	"context"
	"sync"
)

// RangeLock serializes holders of overlapping byte ranges [off, off+n) and
// never holds back holders of disjoint ones. Held ranges are a short list
// (requests in flight are bounded by the queue depth: a linear scan beats
// a tree). Every write of raw, qcow2, an NBD source and an O_DIRECT
// read-modify-write takes one, so an uncontended Lock allocates nothing:
// released entries go to a free list, and a waiter's channel is made only
// when someone has to wait.
type RangeLock struct {
	mu   sync.Mutex
	held []*heldRange
	free []*heldRange
}

type heldRange struct {
	l        *RangeLock
	off, end int64
	// released, made by the first waiter, is closed when the holder
	// unlocks; waiters then retry. A waiter keeps the channel, not the
	// entry, so the entry can be reused at once.
	released chan struct{}
	unlock   func() // h.release, bound once for the entry's life
}

// Lock waits until no held range overlaps [off, off+n) and takes it. The
// returned function releases it and must be called exactly once. If ctx
// ends first, Lock returns ctx's error.
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
			var h *heldRange
			if k := len(l.free); k > 0 {
				h, l.free[k-1] = l.free[k-1], nil
				l.free = l.free[:k-1]
			} else {
				h = &heldRange{l: l}
				h.unlock = h.release
			}
			h.off, h.end = off, end
			l.held = append(l.held, h)
			l.mu.Unlock()
			return h.unlock, nil
		}
		if conflict.released == nil {
			conflict.released = make(chan struct{})
		}
		wait := conflict.released
		l.mu.Unlock()
		select {
		case <-wait:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// release is the unlock function of h's holder.
func (h *heldRange) release() {
	l := h.l
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
	if h.released != nil {
		close(h.released)
		h.released = nil
	}
	l.free = append(l.free, h)
	l.mu.Unlock()
}
