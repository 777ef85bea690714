package fuse

import (
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/blockexport/blockexport/formats/drivers/null"
)

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
func TestRvwStandInOfAStandIn(t *testing.T) {
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
