package coroutines

import (
	"runtime"
	"time"
)

// YieldAfter is how long a serving loop runs before Yielder yields.
const YieldAfter = time.Millisecond

// Yielder makes a serving loop (a FUSE queue, an NBD connection's reader)
// yield the processor about once a millisecond: such a loop blocks only in
// syscalls, so sysmon takes it for a goroutine hogging its P and after 10
// ms hands the P to another thread mid-syscall, preempting the client.
type Yielder struct {
	n    uint32
	last time.Time
	// For tests, set together: the clock and the yield (time.Now,
	// runtime.Gosched).
	now   func() time.Time
	yield func()
}

// Tick is called once per request; now and then it yields. It reads the
// clock every 16th call only: 16 of the largest requests take well under
// 10 ms.
func (y *Yielder) Tick() {
	if y.n++; y.n%16 != 0 {
		return
	}
	clock, yield := time.Now, runtime.Gosched
	if y.now != nil {
		clock, yield = y.now, y.yield
	}
	if now := clock(); now.Sub(y.last) >= YieldAfter {
		y.last = now
		yield()
	}
}
