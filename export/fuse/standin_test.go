package fuse

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/null"
)

// awaitNextRequest spins up to awaitNextSpin for a request on q's fd, as
// the loop does after a lone request, and says whether one came.
func (s *server) awaitNextRequest(q *queue) bool { return s.spinForRequest(q) >= 0 }

// stallImage is a null device of an image that may stall (a network
// peer's): each read at offset 0 waits for release (a token sent on it,
// or its close), whatever its context says, as a hung peer's GET does
// until its timeout; reads elsewhere take delay.
type stallImage struct {
	*null.Image
	release chan struct{}
	delay   func() time.Duration
}

func (stallImage) TryReadAt([]byte, int64) bool { return false }

func (i stallImage) Features() formats.Features {
	f := i.Image.Features()
	f.MayStall = true
	return f
}

func (i stallImage) ReadAt(_ context.Context, p []byte, off int64) (int, error) {
	if off == 0 {
		<-i.release
	} else if i.delay != nil {
		time.Sleep(i.delay())
	}
	clear(p)
	return len(p), nil
}

// stallServer is one queue of a server for an image that may stall, on
// a fake /dev/fuse: k is the kernel's side (kfd its fd), ended is closed
// when the queue's end is first called, ends counts those calls.
type stallServer struct {
	k     kernelSide
	kfd   int
	s     *server
	ended chan struct{}
	ends  atomic.Int32
	// closeKernel closes the kernel's side (once).
	closeKernel func()
}

// serveStall starts a stallServer for img, setup run on its server
// before the loop starts; the test's cleanup stops it (stop).
func serveStall(t *testing.T, img formats.Image, setup ...func(*server)) *stallServer {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	s := newServer(New(img, Options{}), fds[0])
	if !s.stalls {
		t.Fatal("the server does not know the image may stall")
	}
	for _, f := range setup {
		f(s) // before the loop starts
	}
	st := &stallServer{k: kernelSide{t, fds[1]}, kfd: fds[1], s: s, ended: make(chan struct{})}
	s.loops.Add(1)
	go s.loop(fds[0], false, func() {
		if st.ends.Add(1) == 1 {
			close(st.ended)
		}
	})
	closed := false
	st.closeKernel = func() {
		if !closed {
			closed = true
			unix.Close(fds[1]) // the loop reads end-of-file and stops
		}
	}
	t.Cleanup(func() {
		st.stop(t)
		unix.Close(fds[0])
	})
	return st
}

// allStopped says whether every loop and request has ended within 5 s.
func (st *stallServer) allStopped() bool {
	done := make(chan struct{})
	go func() { st.s.loops.Wait(); st.s.hand.Wait(); close(done) }()
	select {
	case <-done:
		return true
	case <-time.After(5 * time.Second):
		return false
	}
}

// stop closes the kernel's side and checks that the queue's end was
// called, once, and that every loop and request has ended.
func (st *stallServer) stop(t *testing.T) {
	st.closeKernel()
	select {
	case <-st.ended:
	case <-time.After(5 * time.Second):
		t.Fatal("the queue's end was never called")
	}
	if !st.allStopped() {
		t.Fatal("a loop or a request still runs after the queue ended")
	}
	if n := st.ends.Load(); n != 1 {
		t.Fatalf("the queue's end was called %d times, want once", n)
	}
}

// A lone read of an image that may stall runs on the loop's goroutine;
// when its peer hangs, a stand-in takes the queue over after
// standInAfter and answers the requests that come meanwhile, and the
// hung read is still answered once its peer is. Without the stand-in the
// second read waits for the first (its reply comes only after release).
func TestStandInServesWhileALoneReadStalls(t *testing.T) {
	img, _ := null.New("stall", 1<<20, true)
	release := make(chan struct{})
	st := serveStall(t, stallImage{Image: img, release: release})
	k := st.k
	released := false
	defer func() {
		if !released {
			close(release)
		}
	}()

	send(k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opRead, Unique: 10, NodeId: 1}, Offset: 0, Size: 4096})
	time.Sleep(20 * time.Millisecond) // the first read is lone, and stuck
	send(k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opRead, Unique: 11, NodeId: 1}, Offset: 8192, Size: 4096})
	h, ok := k.reply(2000)
	if !ok || h.Unique != 11 || h.Status != 0 {
		t.Fatalf("while a lone read stalls, the next read got reply %+v (%v), want unique 11 answered", h, ok)
	}
	send(k, &fuse.GetAttrIn{InHeader: fuse.InHeader{Opcode: opGetattr, Unique: 12, NodeId: 1}})
	if h, ok := k.reply(2000); !ok || h.Unique != 12 || h.Status != 0 {
		t.Fatalf("GETATTR beside the stalled read: reply %+v (%v)", h, ok)
	}

	close(release)
	released = true
	h, body, ok := k.replyBody(2000)
	if !ok || h.Unique != 10 || h.Status != 0 || len(body) != 4096 {
		t.Fatalf("the stalled read, released: reply %+v with %d bytes (%v), want unique 10 with 4096", h, len(body), ok)
	}
	// The stand-in serves on, lone reads included.
	for u := uint64(13); u < 16; u++ {
		send(k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opRead, Unique: u, NodeId: 1}, Offset: 4096 * u, Size: 4096})
		if h, ok := k.reply(2000); !ok || h.Unique != u || h.Status != 0 {
			t.Fatalf("read %d after the stall: reply %+v (%v)", u, h, ok)
		}
	}
	st.stop(t)
}

// Lone reads that end around standInAfter, some before the stand-in is
// started and some after: each is answered exactly once, in order (one
// at a time), and when the connection ends exactly one loop calls the
// queue's end and every loop has stopped. Run under -race, this is the
// hand-over's race of the request's end against the stand-in's timer.
func TestStandInHandOverRace(t *testing.T) {
	img, _ := null.New("stall", 64<<20, true)
	var n atomic.Int64
	delay := func() time.Duration {
		// 0.5 to 1.5 times standInAfter, spread over the reads.
		return standInAfter/2 + time.Duration(n.Add(1)%11)*standInAfter/10
	}
	st := serveStall(t, stallImage{Image: img, release: make(chan struct{}), delay: delay})
	k := st.k
	for u := uint64(1); u <= 200; u++ {
		send(k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opRead, Unique: u, NodeId: 1}, Offset: 4096 * u, Size: 4096})
		h, ok := k.reply(2000)
		if !ok || h.Unique != u || h.Status != 0 {
			t.Fatalf("read %d: reply %+v (%v)", u, h, ok)
		}
	}
	if _, ok := k.reply(50); ok {
		t.Fatal("a read was answered twice")
	}
	st.stop(t)
}

// A lone read of an image that may stall cannot have its I/O cancelled
// (it runs with the loop's context), so an INTERRUPT that finds it still
// running after the grace period answers it EINTR on its behalf: the
// caller, killed, waits in the kernel for that answer. The read's own
// reply, once its peer answers, is dropped (the kernel may have given
// the unique to another request by then), and the queue serves on.
func TestInterruptAnswersAStalledLoneRead(t *testing.T) {
	const grace = 200 * time.Millisecond
	st, release, began := interruptStalledRead(t, grace)
	k := st.k
	released := false
	defer func() {
		if !released {
			close(release)
		}
	}()
	h, ok := k.reply(3000)
	if !ok || h.Unique != 10 || h.Status != -int32(unix.EINTR) {
		t.Fatalf("after an INTERRUPT, the stalled read got reply %+v (%v), want unique 10 -EINTR", h, ok)
	}
	if waited := time.Since(began); waited < grace/2 {
		t.Fatalf("answered EINTR after %v, inside the %v grace period", waited, grace)
	}
	close(release)
	released = true
	// The read's own answer is dropped; the queue answers what comes.
	send(k, &fuse.GetAttrIn{InHeader: fuse.InHeader{Opcode: opGetattr, Unique: 12, NodeId: 1}})
	if h, ok := k.reply(2000); !ok || h.Unique != 12 {
		t.Fatalf("after the released read, reply %+v (%v), want the GETATTR's (unique 12): the read was answered twice", h, ok)
	}
	if h, ok := k.reply(200); ok {
		t.Fatalf("a further reply %+v", h)
	}
	st.stop(t)
}

// An INTERRUPT for a stalled lone read that ends within the grace period
// changes nothing: the read's own reply is the one answer.
func TestInterruptWithinGraceLeavesAStalledLoneRead(t *testing.T) {
	st, release, _ := interruptStalledRead(t, 2*time.Second)
	k := st.k
	time.Sleep(50 * time.Millisecond)
	close(release)
	h, body, ok := k.replyBody(2000)
	if !ok || h.Unique != 10 || h.Status != 0 || len(body) != 4096 {
		t.Fatalf("the read released within the grace period: reply %+v with %d bytes (%v)", h, len(body), ok)
	}
	if h, ok := k.reply(2500); ok {
		t.Fatalf("a second reply %+v after the grace period", h)
	}
	st.stop(t)
}

// interruptStalledRead serves a stall image with the given INTERRUPT
// grace period, sends a lone read (unique 10) that stalls until release
// is closed, lets a stand-in take the queue over, and sends an INTERRUPT
// for the read; began is when it was sent.
func interruptStalledRead(t *testing.T, grace time.Duration) (st *stallServer, release chan struct{}, began time.Time) {
	t.Helper()
	img, _ := null.New("stall", 1<<20, true)
	release = make(chan struct{})
	st = serveStall(t, stallImage{Image: img, release: release})
	st.s.pending.grace = grace
	send(st.k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opRead, Unique: 10, NodeId: 1}, Offset: 0, Size: 4096})
	time.Sleep(20 * time.Millisecond) // lone, stuck, and a stand-in serves
	began = time.Now()
	send(st.k, &fuse.InterruptIn{InHeader: fuse.InHeader{Opcode: opInterrupt, Unique: 11}, Unique: 10})
	return st, release, began
}

// After a lone read of an image that may stall, the loop spins up to
// awaitNextSpin for the next request before it sleeps in read(2): a
// request there already is seen at once, none is given up on after the
// spin, and --poll-us (whose read polls itself) skips it.
func TestAwaitNextRequest(t *testing.T) {
	img, _ := null.New("stall", 1<<20, true)
	st := serveStall(t, stallImage{Image: img, release: make(chan struct{})})
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	q := &queue{fd: fds[0]}
	start := time.Now()
	if st.s.awaitNextRequest(q) {
		t.Fatal("nothing sent, yet a request was seen")
	}
	if d := time.Since(start); d < awaitNextSpin {
		t.Fatalf("gave up after %v, before the %v spin", d, awaitNextSpin)
	}
	if _, err := unix.Write(fds[1], []byte("request")); err != nil {
		t.Fatal(err)
	}
	if !st.s.awaitNextRequest(q) {
		t.Fatal("a request waiting was not seen")
	}
	s := &server{pollFor: time.Millisecond}
	if s.awaitNextRequest(q) {
		t.Fatal("with --poll-us the loop's read polls; the spin should not run")
	}
}

// The connection ends (unmount, SIGTERM's abort) while a lone read of an
// image that may stall hangs on the loop's goroutine: the stand-in sees
// the end and calls the queue's end at once, without waiting for the
// hung read (serve then closes the bulk helper's stop and waits for the
// loops); the loop that handed over ends once its read does, without a
// second end, and the read's late reply to a gone connection harms
// nothing.
func TestConnectionEndsWhileALoneReadStalls(t *testing.T) {
	img, _ := null.New("stall", 1<<20, true)
	release := make(chan struct{}, 4)
	st := serveStall(t, stallImage{Image: img, release: release})
	k := st.k
	send(k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opRead, Unique: 10, NodeId: 1}, Offset: 0, Size: 4096})
	time.Sleep(20 * time.Millisecond) // lone, stuck, and the stand-in reads
	st.closeKernel()
	select {
	case <-st.ended:
	case <-time.After(2 * time.Second):
		release <- struct{}{}
		t.Fatal("the queue's end waited for the stalled read (or was never called)")
	}
	release <- struct{}{}
	if !st.allStopped() {
		t.Fatal("a loop or a request still runs after the stalled read ended")
	}
	if n := st.ends.Load(); n != 1 {
		t.Fatalf("the queue's end was called %d times, want once", n)
	}
}

// Stalls one after another: each lone stalled read gets a stand-in (the
// second a stand-in of the stand-in), the requests beside each are
// answered, an INTERRUPT for a stalled read is swallowed (no reply of
// its own, the read answered once, with its data), and at the end exactly
// one loop calls the queue's end and every loop stops.
func TestStandInOfAStandIn(t *testing.T) {
	img, _ := null.New("stall", 1<<20, true)
	release := make(chan struct{}, 4)
	st := serveStall(t, stallImage{Image: img, release: release})
	k := st.k
	for round := uint64(0); round < 3; round++ {
		u := 100 * (round + 1)
		send(k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opRead, Unique: u, NodeId: 1}, Offset: 0, Size: 4096})
		time.Sleep(20 * time.Millisecond)
		send(k, &fuse.InterruptIn{InHeader: fuse.InHeader{Opcode: opInterrupt, Unique: u + 1}, Unique: u})
		send(k, &fuse.GetAttrIn{InHeader: fuse.InHeader{Opcode: opGetattr, Unique: u + 2, NodeId: 1}})
		if h, ok := k.reply(2000); !ok || h.Unique != u+2 || h.Status != 0 {
			release <- struct{}{}
			t.Fatalf("round %d: GETATTR beside the stalled read: reply %+v (%v)", round, h, ok)
		}
		send(k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opRead, Unique: u + 3, NodeId: 1}, Offset: 8192, Size: 4096})
		if h, ok := k.reply(2000); !ok || h.Unique != u+3 || h.Status != 0 {
			release <- struct{}{}
			t.Fatalf("round %d: read beside the stalled read: reply %+v (%v)", round, h, ok)
		}
		release <- struct{}{}
		h, body, ok := k.replyBody(2000)
		if !ok || h.Unique != u || h.Status != 0 || len(body) != 4096 {
			t.Fatalf("round %d: the stalled read: reply %+v with %d bytes (%v)", round, h, len(body), ok)
		}
		if h, ok := k.reply(50); ok {
			t.Fatalf("round %d: an extra reply %+v", round, h)
		}
	}
	st.stop(t)
}
