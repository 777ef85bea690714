package fuse

// The loop's spin after a lone request of an image that may stall
// (awaitNext, awaitNextRequest) under attack: the connection ending during
// the spin, requests arriving at every point of it, other opcodes after a
// lone read, and lone reads that a stand-in takes over mixed with ones
// that end in time.

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/blockexport/blockexport/formats/drivers/null"
)

// The kernel's side closes at points in and after the loop's spin that
// follows a lone read: the loop ends, its end is called once, nothing
// keeps running.
func TestConnectionEndsDuringTheSpinAfterALoneRead(t *testing.T) {
	for i := 0; i < 40; i++ {
		img, _ := null.New("stall", 1<<20, true)
		st := serveStall(t, stallImage{Image: img, release: make(chan struct{}), delay: func() time.Duration { return 0 }})
		send(st.k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opRead, Unique: 1, NodeId: 1}, Offset: 4096, Size: 4096})
		if h, ok := st.k.reply(2000); !ok || h.Unique != 1 || h.Status != 0 {
			t.Fatalf("round %d: reply %+v (%v)", i, h, ok)
		}
		if d := time.Duration(i%8) * 4 * time.Microsecond; d > 0 {
			time.Sleep(d)
		}
		st.stop(t)
	}
}

// The next request arrives at every point of the spin and past it (one
// in ten 2 ms later, the loop asleep in read(2)), as a reader at queue
// depth 1 sends it; lone reads alternating with GETATTR (answered
// inline, no runStalling) and reads that a stand-in takes over: each
// answered once, in order, with its bytes.
func TestRequestsAcrossTheSpinAfterALoneRead(t *testing.T) {
	img, _ := null.New("stall", 64<<20, true)
	var n atomic.Int64
	delay := func() time.Duration {
		if n.Add(1)%9 == 0 {
			return 2 * standInAfter // a stand-in takes the queue over
		}
		return 0
	}
	st := serveStall(t, stallImage{Image: img, release: make(chan struct{}), delay: delay})
	k := st.k
	done := make(chan struct{})
	defer close(done)
	go func() {
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			st.closeKernel()
			panic("hung")
		}
	}()
	for u := uint64(1); u <= 300; u++ {
		if u%10 == 0 {
			time.Sleep(2 * time.Millisecond)
		} else if gap := time.Duration(u%12) * 4 * time.Microsecond; gap > 0 {
			for start := time.Now(); time.Since(start) < gap; {
			}
		}
		if u%4 == 0 {
			send(k, &fuse.GetAttrIn{InHeader: fuse.InHeader{Opcode: opGetattr, Unique: u, NodeId: 1}})
			if h, ok := k.reply(2000); !ok || h.Unique != u || h.Status != 0 {
				t.Fatalf("GETATTR %d: reply %+v (%v)", u, h, ok)
			}
			continue
		}
		send(k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opRead, Unique: u, NodeId: 1}, Offset: 4096 * (u%1000 + 1), Size: 4096})
		h, body, ok := k.replyBody(2000)
		if !ok || h.Unique != u || h.Status != 0 || len(body) != 4096 {
			t.Fatalf("read %d: reply %+v with %d bytes (%v)", u, h, len(body), ok)
		}
	}
	if _, ok := k.reply(20); ok {
		t.Fatal("a request was answered twice")
	}
	st.stop(t)
}
