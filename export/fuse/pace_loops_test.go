package fuse

// The loop's pacing under attack (depthGuess, paced, the spin after
// each request in run): several loops on one input queue, the connection
// ending at every point of a spin, idle CPU once the requests stop, the
// stand-in loop of an image that may stall with pacing on, INTERRUPTs and
// FORGETs (no reply) between requests.

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/formats/drivers/null"
)

func busyWait(d time.Duration) {
	for start := time.Now(); time.Since(start) < d; {
	}
}

func processCPU(t *testing.T) time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// Two paced loops read one fake /dev/fuse (as cloned queues share the
// connection's input queue: a request one loop's spin saw may be read by
// the other). A reader at depth 1 with think times across the spin, and
// beyond it, mixing reads, GETATTRs, FORGETs and INTERRUPTs for requests
// that are not running (neither answered): every answerable request is
// answered exactly once; closing the kernel's side ends both loops.
func TestPacedTwoLoopsOneQueue(t *testing.T) {
	f := newPacedFake(t)
	_, end1 := f.loop(true)
	_, end2 := f.loop(false)
	k := f.k
	thinks := []time.Duration{0, 0, 3 * time.Microsecond, 10 * time.Microsecond, 18 * time.Microsecond, 25 * time.Microsecond, 60 * time.Microsecond}
	for u := uint64(1); u <= 3000; u++ {
		if u%500 == 0 {
			time.Sleep(2 * time.Millisecond) // both asleep in read(2)
		} else {
			busyWait(thinks[u%uint64(len(thinks))])
		}
		switch u % 5 {
		case 0:
			send(k, &fuse.GetAttrIn{InHeader: fuse.InHeader{Opcode: opGetattr, Unique: u, NodeId: 1}})
		case 1:
			// No reply to either: the next reply must be the read's.
			send(k, &fuse.ForgetIn{InHeader: fuse.InHeader{Opcode: opForget, Unique: u + 1e6, NodeId: 1}, Nlookup: 1})
			send(k, &fuse.InterruptIn{InHeader: fuse.InHeader{Opcode: opInterrupt, Unique: u + 2e6}, Unique: u - 1})
			fallthrough
		default:
			send(k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opRead, Unique: u, NodeId: 1}, Offset: 4096 * (u % 200), Size: 4096})
		}
		h, ok := k.reply(5000)
		if !ok || h.Unique != u || h.Status != 0 {
			t.Fatalf("request %d: reply %+v (%v)", u, h, ok)
		}
	}
	if h, ok := k.reply(50); ok {
		t.Fatalf("an extra reply %+v", h)
	}
	f.end(t, end1, end2)
}

// The kernel's side closes at every point of a spin (the loop spinning
// from the start): right after a reply, a few µs into the spin, at its
// end and after it. The loop ends every time.
func TestPacedConnectionEndsMidSpin(t *testing.T) {
	for i := 0; i < 60; i++ {
		f := newPacedFake(t)
		_, ended := f.loop(true)
		for u := uint64(1); u <= 3; u++ {
			send(f.k, &fuse.GetAttrIn{InHeader: fuse.InHeader{Opcode: opGetattr, Unique: u, NodeId: 1}})
			if h, ok := f.k.reply(2000); !ok || h.Unique != u {
				t.Fatalf("round %d: reply %+v (%v)", i, h, ok)
			}
		}
		busyWait(time.Duration(i%12) * 3 * time.Microsecond)
		if i%2 == 0 {
			unix.Shutdown(f.k.fd, unix.SHUT_RDWR)
		}
		f.end(t, ended)
	}
}

// Once the requests stop, a loop that was spinning sleeps in read(2): the
// process uses next to no CPU over a second of idle (a loop that kept
// spinning would use all of it; a quarter leaves room for the runtime's
// and the race detector's own work on a loaded machine).
func TestPacedIdleLoopSpinsNot(t *testing.T) {
	f := newPacedFake(t)
	q, ended := f.loop(false)
	k := f.k
	// Depth 1 with no think time: the samples find the queue empty, so
	// the loop starts spinning (logged below, after it ended).
	for u := uint64(1); u <= 500; u++ {
		send(k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opRead, Unique: u, NodeId: 1}, Offset: 4096 * (u % 200), Size: 4096})
		if h, ok := k.reply(2000); !ok || h.Unique != u {
			t.Fatalf("read %d: reply %+v (%v)", u, h, ok)
		}
	}
	time.Sleep(10 * time.Millisecond)
	before, wall := processCPU(t), time.Now()
	time.Sleep(time.Second)
	used, took := processCPU(t)-before, time.Since(wall)
	f.end(t, ended)
	if used > took/4 {
		t.Fatalf("idle for %v, the process used %v of CPU: something spins", took, used)
	}
	t.Logf("idle %v, CPU %v, spinning at the end %v", took, used, q.pace.spinning)
}

// A reader that thinks longer than the spin between requests (each spin
// times out, so the loop stops spinning after paceIdleToStop of them and
// samples again): every request answered, in order. Its CPU is logged
// against what a spin after every request would cost.
func TestPacedThinkingReader(t *testing.T) {
	f := newPacedFake(t)
	_, ended := f.loop(true)
	const n = 720
	before := processCPU(t)
	for u := uint64(1); u <= n; u++ {
		time.Sleep(200 * time.Microsecond)
		send(f.k, &fuse.GetAttrIn{InHeader: fuse.InHeader{Opcode: opGetattr, Unique: u, NodeId: 1}})
		if h, ok := f.k.reply(2000); !ok || h.Unique != u {
			t.Fatalf("request %d: reply %+v (%v)", u, h, ok)
		}
	}
	used := processCPU(t) - before
	f.end(t, ended)
	t.Logf("%d requests 200 µs apart: CPU %v (a spin after each would add %v)", n, used, n*awaitNextSpin)
}

// An image that may stall, pacing on: runs of inline GETATTRs at depth 1
// (which start the loop's spins) between lone reads, some of which a
// stand-in takes over (a fresh queue, its own guess), some that end in
// time (awaitNext), and a stalled one that an INTERRUPT answers EINTR
// while the stand-in serves paced GETATTRs beside it. Each request is
// answered exactly once and the queue ends once. Under -race this is
// pacing's state against the stand-in's hand-over.
func TestPacedStandIn(t *testing.T) {
	img, _ := null.New("stall", 64<<20, true)
	var n atomic.Int64
	delay := func() time.Duration {
		return standInAfter/2 + time.Duration(n.Add(1)%11)*standInAfter/10
	}
	release := make(chan struct{}, 1)
	st := serveStall(t, stallImage{Image: img, release: release, delay: delay}, func(s *server) { s.pace = true })
	st.s.pending.grace = 50 * time.Millisecond
	k := st.k
	u := uint64(0)
	expect := func(what string, status int32) {
		t.Helper()
		h, ok := k.reply(3000)
		if !ok || h.Unique != u || h.Status != status {
			t.Fatalf("%s %d: reply %+v (%v), want status %d", what, u, h, ok, status)
		}
	}
	for round := 0; round < 40; round++ {
		for i := 0; i < 70; i++ {
			u++
			send(k, &fuse.GetAttrIn{InHeader: fuse.InHeader{Opcode: opGetattr, Unique: u, NodeId: 1}})
			expect("GETATTR", 0)
		}
		u++
		send(k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opRead, Unique: u, NodeId: 1}, Offset: 4096 * uint64(round+1), Size: 4096})
		expect("read", 0)
	}
	// A stalled lone read, interrupted, with paced GETATTRs beside it.
	// The last read's loop, if a stand-in took its queue over, counts
	// the read done only after its reply: until then the next read is
	// not lone and goes to a goroutine (whose context an INTERRUPT
	// cancels, which this image ignores), so wait for that first.
	for deadline := time.Now().Add(2 * time.Second); st.s.hand.Busy(); {
		if time.Now().After(deadline) {
			t.Fatal("a read still in flight 2 s after its reply")
		}
		time.Sleep(time.Millisecond)
	}
	u++
	stalled := u
	send(k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opRead, Unique: stalled, NodeId: 1}, Offset: 0, Size: 4096})
	time.Sleep(10 * time.Millisecond)
	for i := 0; i < 100; i++ {
		u++
		send(k, &fuse.GetAttrIn{InHeader: fuse.InHeader{Opcode: opGetattr, Unique: u, NodeId: 1}})
		expect("GETATTR beside the stall", 0)
	}
	send(k, &fuse.InterruptIn{InHeader: fuse.InHeader{Opcode: opInterrupt, Unique: 1 << 40}, Unique: stalled})
	if h, ok := k.reply(3000); !ok || h.Unique != stalled || h.Status != -int32(unix.EINTR) {
		release <- struct{}{}
		t.Fatalf("interrupted stalled read: reply %+v (%v)", h, ok)
	}
	release <- struct{}{}
	for i := 0; i < 100; i++ {
		u++
		send(k, &fuse.GetAttrIn{InHeader: fuse.InHeader{Opcode: opGetattr, Unique: u, NodeId: 1}})
		expect("GETATTR after the stall", 0)
	}
	if h, ok := k.reply(100); ok {
		t.Fatalf("an extra reply %+v (the stalled read answered twice?)", h)
	}
	st.stop(t)
}
