package coroutines

import (
	"context"
	"sync"
)

// Budget bounds a quantity that many goroutines take and give back, such as
// the bytes of request buffers a server holds at once. Acquire waits while
// the budget is spent, first come first served, so a reader that acquires
// before it reads the next request applies back-pressure instead of
// failing requests.
type Budget struct {
	mu      sync.Mutex
	max     int64
	free    int64
	waiters []*budgetWaiter
}

type budgetWaiter struct {
	n     int64
	ready chan struct{}
}

// NewBudget makes a budget of n units.
func NewBudget(n int64) *Budget { return &Budget{max: n, free: n} }

// Clamp is what Acquire really takes for a request of n: at most the whole
// budget, so that one request larger than the budget still runs (alone).
func (b *Budget) Clamp(n int64) int64 { return min(n, b.max) }

// Acquire takes Clamp(n) units, waiting until they are free or ctx ends.
func (b *Budget) Acquire(ctx context.Context, n int64) error {
	if b.TryAcquire(n) {
		return nil
	}
	n = b.Clamp(n)
	b.mu.Lock()
	w := &budgetWaiter{n: n, ready: make(chan struct{})}
	b.waiters = append(b.waiters, w)
	b.grantLocked() // units freed since TryAcquire looked
	b.mu.Unlock()
	select {
	case <-w.ready:
		return nil
	case <-ctx.Done():
		b.mu.Lock()
		select {
		case <-w.ready:
			// Granted meanwhile: give it back.
			b.mu.Unlock()
			b.Release(n)
		default:
			for i, x := range b.waiters {
				if x == w {
					b.waiters = append(b.waiters[:i], b.waiters[i+1:]...)
					break
				}
			}
			b.grantLocked() // those behind it may fit now
			b.mu.Unlock()
		}
		return ctx.Err()
	}
}

// TryAcquire takes Clamp(n) units if they are free now, and never waits.
func (b *Budget) TryAcquire(n int64) bool {
	n = b.Clamp(n)
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.waiters) == 0 && b.free >= n {
		b.free -= n
		return true
	}
	return false
}

// Release gives back n units taken by Acquire (pass the same n).
func (b *Budget) Release(n int64) {
	n = b.Clamp(n)
	b.mu.Lock()
	b.free += n
	b.grantLocked()
	b.mu.Unlock()
}

// grantLocked wakes waiters in order while they fit.
func (b *Budget) grantLocked() {
	for len(b.waiters) > 0 && b.free >= b.waiters[0].n {
		w := b.waiters[0]
		b.waiters = b.waiters[1:]
		b.free -= w.n
		close(w.ready)
	}
}

// InUse is how many units are taken now.
func (b *Budget) InUse() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.max - b.free
}
