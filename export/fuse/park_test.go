package fuse

import (
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/formats/drivers/null"
)

// TestIdleQueueParksAndARequestWakesIt: with ParkIdle, a queue that had
// no request for that long waits in the netpoller (no thread held in
// read(2) or poll(2)); the next request wakes it and is answered, after
// which it parks again; the connection's end still ends the loop.
func TestIdleQueueParksAndARequestWakesIt(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	img, _ := null.New("idle", 1<<20, false)
	s := newServer(New(img, Options{}), fds[0])
	const idle = 5 * time.Millisecond
	if err := s.parkWhenIdle(idle); err != nil {
		t.Fatal(err)
	}
	k := kernelSide{t, fds[1]}
	s.loops.Add(1)
	loopDone := make(chan struct{})
	go s.loop(fds[0], false, func() { close(loopDone) })
	closed := false
	t.Cleanup(func() {
		if !closed {
			unix.Close(fds[1])
			<-loopDone
		}
		s.files[0].Close() // closes fds[0]
	})
	parkedBy := func(parks int64) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); s.parks.Load() < parks; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("the idle queue parked %d times, want %d", s.parks.Load(), parks)
			}
		}
		time.Sleep(idle) // into the wait
		buf := make([]byte, 1<<20)
		stacks := string(buf[:runtime.Stack(buf, true)])
		for _, g := range strings.Split(stacks, "\n\n") {
			if strings.Contains(g, "(*server).run(") {
				if !strings.Contains(g, "parkUntilRequest") || !strings.Contains(g, "runtime_pollWait") {
					t.Fatalf("the idle loop is not waiting in the netpoller:\n%s", g)
				}
				return
			}
		}
		t.Fatal("no loop running")
	}
	for u := uint64(1); u <= 3; u++ {
		send(k, &fuse.GetAttrIn{InHeader: fuse.InHeader{Opcode: opGetattr, Unique: u, NodeId: 1}})
		if h, ok := k.reply(2000); !ok || h.Unique != u || h.Status != 0 {
			t.Fatalf("GETATTR %d: reply %+v (%v)", u, h, ok)
		}
		parkedBy(int64(u))
	}
	unix.Close(fds[1]) // the parked loop wakes, reads end-of-file and stops
	closed = true
	select {
	case <-loopDone:
	case <-time.After(5 * time.Second):
		t.Fatal("the parked loop did not end with the connection")
	}
}
