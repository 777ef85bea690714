package coroutines

import (
	"context"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestDrainWaitsForInFlightAndHoldsNewOnesBack(t *testing.T) {
	var f InFlight
	f.Begin()
	drained := make(chan func())
	go func() {
		release, err := f.Drain(context.Background())
		if err != nil {
			t.Error(err)
		}
		drained <- release
	}()
	select {
	case <-drained:
		t.Fatal("Drain returned with a request in flight")
	case <-time.After(50 * time.Millisecond):
	}
	f.End()
	release := <-drained
	began := make(chan struct{})
	go func() {
		f.Begin()
		close(began)
		f.End()
	}()
	select {
	case <-began:
		t.Fatal("a request began while drained")
	case <-time.After(50 * time.Millisecond):
	}
	release()
	select {
	case <-began:
	case <-time.After(5 * time.Second):
		t.Fatal("requests did not proceed after the drain was released")
	}
}

func TestDrainHonoursContext(t *testing.T) {
	var f InFlight
	f.Begin()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := f.Drain(ctx); err == nil {
		t.Fatal("Drain succeeded with a request in flight")
	}
	f.End()
	release, err := f.Drain(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	release()
}

// TestRangeLockProperty: random ranges locked by many goroutines; a shared
// map of owners per byte shows no two overlapping holders, ever.
func TestRangeLockProperty(t *testing.T) {
	var l RangeLock
	const space = 256
	var owner [space]atomic.Int32
	var wg sync.WaitGroup
	var overlaps atomic.Int32
	for g := 1; g <= 16; g++ {
		wg.Add(1)
		go func(id int32) {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(id), 7))
			for i := 0; i < 300; i++ {
				off := r.Int64N(space - 1)
				n := 1 + r.Int64N(min(32, space-off))
				unlock, err := l.Lock(context.Background(), off, n)
				if err != nil {
					t.Error(err)
					return
				}
				for b := off; b < off+n; b++ {
					if !owner[b].CompareAndSwap(0, id) {
						overlaps.Add(1)
					}
				}
				time.Sleep(time.Duration(r.IntN(20)) * time.Microsecond)
				for b := off; b < off+n; b++ {
					owner[b].CompareAndSwap(id, 0)
				}
				unlock()
			}
		}(int32(g))
	}
	wg.Wait()
	if n := overlaps.Load(); n != 0 {
		t.Fatalf("%d bytes had two holders at once", n)
	}
}

func TestRangeLockDisjointRangesDoNotWait(t *testing.T) {
	var l RangeLock
	unlock, _ := l.Lock(context.Background(), 0, 4096)
	defer unlock()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	u2, err := l.Lock(ctx, 4096, 4096)
	if err != nil {
		t.Fatalf("disjoint range waited: %v", err)
	}
	u2()
	ctx2, cancel2 := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel2()
	if _, err := l.Lock(ctx2, 4095, 2); err == nil {
		t.Fatal("overlapping range was granted")
	}
}

// TestRangeLockAllocationFree: every write of every format takes a range
// lock; once warm, an uncontended Lock and its unlock allocate nothing.
func TestRangeLockAllocationFree(t *testing.T) {
	var l RangeLock
	ctx := context.Background()
	a := testing.AllocsPerRun(1000, func() {
		u1, _ := l.Lock(ctx, 0, 4096)
		u2, _ := l.Lock(ctx, 8192, 4096)
		u1()
		u2()
	})
	if a != 0 {
		t.Fatalf("Lock+unlock allocated %.1f objects per run", a)
	}
}

// TestRangeLockWaiterWakesAfterReuse: the entry a waiter waited on is
// reused by a new holder at once; the waiter must still wake, and then
// wait on the new holder, not take its range.
func TestRangeLockWaiterWakesAfterReuse(t *testing.T) {
	var l RangeLock
	ctx := context.Background()
	u1, _ := l.Lock(ctx, 0, 100)
	got := make(chan func())
	go func() {
		u, err := l.Lock(ctx, 50, 10)
		if err != nil {
			t.Error(err)
		}
		got <- u
	}()
	time.Sleep(10 * time.Millisecond) // the waiter is asleep on u1's range
	u1()
	u3, err := l.Lock(ctx, 200, 10) // may reuse u1's entry
	if err != nil {
		t.Fatal(err)
	}
	select {
	case u := <-got:
		u()
	case <-time.After(5 * time.Second):
		t.Fatal("the waiter never woke")
	}
	u3()
	if len(l.held) != 0 {
		t.Fatalf("%d ranges still held", len(l.held))
	}
}

func TestYielderYieldsOncePerInterval(t *testing.T) {
	clock := time.Unix(1000, 0)
	yields := 0
	y := Yielder{now: func() time.Time { return clock }, yield: func() { yields++ }}
	// 16 ticks per 0.1 ms (the clock is read every 16th), for 1 ms: the
	// first reading yields (nothing was yielded before), then one a ms.
	for i := 0; i < 10*16*10; i++ {
		if i%16 == 0 {
			clock = clock.Add(YieldAfter / 10)
		}
		y.Tick()
	}
	if yields != 10 {
		t.Fatalf("%d yields over 10 ms, want 10", yields)
	}
}

func TestBudget(t *testing.T) {
	b := NewBudget(100)
	ctx := context.Background()
	if err := b.Acquire(ctx, 60); err != nil {
		t.Fatal(err)
	}
	// 50 does not fit: it waits until 60 come back.
	got := make(chan error, 1)
	go func() { got <- b.Acquire(ctx, 50) }()
	select {
	case <-got:
		t.Fatal("acquired past the budget")
	case <-time.After(50 * time.Millisecond):
	}
	// First come, first served: a small request behind it waits too
	// (started once the first is queued: on a loaded machine the first
	// goroutine may not have run yet).
	awaitWaiters(t, b, 1)
	small := make(chan error, 1)
	go func() { small <- b.Acquire(ctx, 10) }()
	awaitWaiters(t, b, 2)
	select {
	case <-small:
		t.Fatal("a later request overtook a waiting one")
	case <-time.After(50 * time.Millisecond):
	}
	b.Release(60)
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	if err := <-small; err != nil {
		t.Fatal(err)
	}
	if n := b.InUse(); n != 60 {
		t.Fatalf("in use %d, want 60", n)
	}
	// A request larger than the whole budget runs alone.
	b.Release(50)
	b.Release(10)
	if err := b.Acquire(ctx, 1000); err != nil || b.InUse() != 100 {
		t.Fatalf("oversized acquire: %v, in use %d", err, b.InUse())
	}
	// A cancelled wait takes nothing and lets the ones behind it go.
	cctx, cancel := context.WithCancel(ctx)
	cancelled := make(chan error, 1)
	go func() { cancelled <- b.Acquire(cctx, 80) }()
	awaitWaiters(t, b, 1)
	cancel()
	if err := <-cancelled; err == nil {
		t.Fatal("a cancelled wait acquired")
	}
	b.Release(1000)
	if n := b.InUse(); n != 0 {
		t.Fatalf("in use %d after everything came back", n)
	}
}

// awaitWaiters waits until n requests wait on b.
func awaitWaiters(t *testing.T, b *Budget, n int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		b.mu.Lock()
		k := len(b.waiters)
		b.mu.Unlock()
		if k >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d requests wait on the budget, not %d", k, n)
		}
	}
}

func TestBudgetTryAcquire(t *testing.T) {
	b := NewBudget(10)
	if !b.TryAcquire(8) || b.TryAcquire(3) || !b.TryAcquire(2) {
		t.Fatal("TryAcquire took what was not free, or refused what was")
	}
	b.Release(10)
	if b.InUse() != 0 {
		t.Fatal("not all came back")
	}
}
