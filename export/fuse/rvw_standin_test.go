package fuse

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/null"
)

// tokenStallImage may stall: each read at offset 0 waits for one token on
// release (so that several reads can stall one after another); others
// return at once.
type tokenStallImage struct {
	*null.Image
	release chan struct{}
}

func (tokenStallImage) TryReadAt([]byte, int64) bool { return false }

func (i tokenStallImage) Features() formats.Features {
	f := i.Image.Features()
	f.MayStall = true
	return f
}

func (i tokenStallImage) ReadAt(_ context.Context, p []byte, off int64) (int, error) {
	if off == 0 {
		<-i.release
	}
	clear(p)
	return len(p), nil
}

// rvwServe runs one queue of a server for img on a fake /dev/fuse; it
// returns the kernel's side, a channel closed when the queue's end is
// first called, the count of end calls, and a function that waits for
// every loop and request to end (false after 5 s).
func rvwServe(t *testing.T, img formats.Image) (kernelSide, int, <-chan struct{}, *atomic.Int32, func() bool) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	s := newServer(New(img, Options{}), fds[0])
	if !s.stalls {
		t.Fatal("the server does not know the image may stall")
	}
	ends := new(atomic.Int32)
	ended := make(chan struct{})
	s.loops.Add(1)
	go s.loop(fds[0], false, func() {
		if ends.Add(1) == 1 {
			close(ended)
		}
	})
	all := func() bool {
		done := make(chan struct{})
		go func() { s.loops.Wait(); s.hand.Wait(); close(done) }()
		select {
		case <-done:
			return true
		case <-time.After(5 * time.Second):
			return false
		}
	}
	t.Cleanup(func() { unix.Close(fds[0]) })
	return kernelSide{t, fds[1]}, fds[1], ended, ends, all
}

// The connection ends (unmount, SIGTERM's abort) while a lone read of an
// image that may stall hangs on the loop's goroutine: the stand-in sees
// the end and calls the queue's end at once, without waiting for the
// hung read (serve then closes the bulk helper's stop and waits for the
// loops); the loop that handed over ends once its read does, without a
// second end, and the read's late reply to a gone connection harms
// nothing.
func TestRvwConnectionEndsWhileALoneReadStalls(t *testing.T) {
	img, _ := null.New("stall", 1<<20, true)
	release := make(chan struct{}, 4)
	k, kfd, ended, ends, all := rvwServe(t, tokenStallImage{Image: img, release: release})
	send(k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opRead, Unique: 10, NodeId: 1}, Offset: 0, Size: 4096})
	time.Sleep(20 * time.Millisecond) // lone, stuck, and the stand-in reads
	unix.Close(kfd)
	select {
	case <-ended:
	case <-time.After(2 * time.Second):
		release <- struct{}{}
		t.Fatal("the queue's end waited for the stalled read (or was never called)")
	}
	release <- struct{}{}
	if !all() {
		t.Fatal("a loop or a request still runs after the stalled read ended")
	}
	if n := ends.Load(); n != 1 {
		t.Fatalf("the queue's end was called %d times, want once", n)
	}
}

// Stalls one after another: each lone stalled read gets a stand-in (the
// second a stand-in of the stand-in), the requests beside each are
// answered, an INTERRUPT for a stalled read is swallowed (no reply of
// its own, the read answered once, with its data), and at the end exactly
// one loop calls the queue's end and every loop stops.
func TestRvwStandInOfAStandIn(t *testing.T) {
	img, _ := null.New("stall", 1<<20, true)
	release := make(chan struct{}, 4)
	k, kfd, ended, ends, all := rvwServe(t, tokenStallImage{Image: img, release: release})
	closed := false
	defer func() {
		if !closed {
			unix.Close(kfd)
		}
	}()
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
	unix.Close(kfd)
	closed = true
	select {
	case <-ended:
	case <-time.After(5 * time.Second):
		t.Fatal("the queue's end was never called")
	}
	if !all() {
		t.Fatal("a loop or a request still runs after the queue ended")
	}
	if n := ends.Load(); n != 1 {
		t.Fatalf("the queue's end was called %d times, want once", n)
	}
}
