package coroutines

import (
	"context"
	"runtime"
	"sync"
	"sync/atomic"
)

// Handoff is a serve loop's one decision per request that may wait for
// I/O, shared by the FUSE queues and the NBD connections: try it without
// waiting (reads only while Reads says tries pay); else, when Lone says
// the loop has nothing else to serve, run it right there with
// Context(Lone); else give it a buffer of its own, Start, and finish it in
// a goroutine with Context(AfterMiss) or Context(Fresh), then Done.
type Handoff struct {
	running sync.WaitGroup
	n       atomic.Int32
	ctx     [3]context.Context // by Path
	// Reads decides when step 1 is worth trying for a read.
	Reads MissTracker
}

// NewHandoff makes the helper for one loop; requests' contexts derive from
// base (a connection's, cancelled when its client is gone).
func NewHandoff(base context.Context) *Handoff {
	h := &Handoff{}
	h.ctx[Fresh] = base
	h.ctx[AfterMiss] = WithPath(base, AfterMiss)
	h.ctx[Lone] = WithPath(base, Lone)
	return h
}

// Context is the context for a request that comes by path p.
func (h *Handoff) Context(p Path) context.Context { return h.ctx[p] }

// Lone says whether the loop may run a request that waits itself: no
// request is in flight in a goroutine and queued (the loop's look at its
// own input: a poll of /dev/fuse, the socket's buffers) says none waits,
// so blocking the loop delays nobody.
func (h *Handoff) Lone(queued func() bool) bool {
	return h.n.Load() == 0 && !queued()
}

// Busy says whether a request is in flight in a goroutine.
func (h *Handoff) Busy() bool { return h.n.Load() != 0 }

// Start counts a request that a goroutine is about to finish; the
// goroutine calls Done when it has. The caller has given the request a
// buffer of its own. (Start and Done rather than a Go(fn): that would cost
// each request a second closure beside the goroutine's own.)
func (h *Handoff) Start() {
	h.running.Add(1)
	h.n.Add(1)
}

// Done ends what Start began.
func (h *Handoff) Done() {
	h.n.Add(-1)
	h.running.Done()
}

// Yield lets a goroutine just started run on this thread at once, while
// its P is ours: it submits its I/O and parks. Left queued behind a loop
// that goes back to sleep in read(2), it waited for another thread to
// steal it (docs/design.md, Hand-off). Not after large writes, which
// would then copy their payload before the loop reads on.
func (h *Handoff) Yield() { runtime.Gosched() }

// Wait returns when every request Start counted is Done.
func (h *Handoff) Wait() { h.running.Wait() }

// MissTracker decides whether a serve loop tries a read without blocking.
// On a page-cache miss the try is not free: it starts the readahead and
// submits the disk read on the loop's thread, where goroutines would
// submit side by side (docs/design.md, Inline reads). So it counts tries in
// windows of missWindow, and when fewer than half of a window hit, the
// loop tries only every probeEvery-th read. One atomic add per try.
type MissTracker struct {
	skipping atomic.Bool
	window   atomic.Uint64 // this window's tries<<32 | hits
	seen     atomic.Uint32 // reads while skipping, for the probes
}

const (
	missWindow = 64
	probeEvery = 8
)

// ShouldTry says whether to try this read without blocking.
func (m *MissTracker) ShouldTry() bool {
	return !m.skipping.Load() || m.seen.Add(1)%probeEvery == 0
}

// Note records a try's outcome.
func (m *MissTracker) Note(hit bool) {
	d := uint64(1) << 32
	if hit {
		d++
	}
	if w := m.window.Add(d); w>>32 == missWindow {
		// The try that fills the window judges it and starts the next
		// (tries other queues add meanwhile count there).
		m.window.Add(-w)
		m.skipping.Store(2*(w&0xffffffff) < missWindow)
	}
}
