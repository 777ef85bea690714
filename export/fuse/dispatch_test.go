package fuse

import (
	"context"
	"maps"
	"testing"
	"time"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/formats/drivers/null"
)

// stuckImage is a null device whose reads wait until their context ends,
// as a read from a hung device would.
type stuckImage struct {
	*null.Image
}

func (stuckImage) TryReadAt([]byte, int64) bool { return false }

func (stuckImage) ReadAt(ctx context.Context, _ []byte, _ int64) (int, error) {
	<-ctx.Done()
	return 0, ctx.Err()
}

// kernelSide is the kernel's end of a fake /dev/fuse: a SOCK_SEQPACKET
// socket pair keeps message boundaries as /dev/fuse does.
type kernelSide struct {
	t  *testing.T
	fd int
}

func send[T any](k kernelSide, v *T) {
	if err := write(k.fd, v); err != nil {
		k.t.Fatal(err)
	}
}

// write sends request v (its header's length set here) on fd; safe from
// any goroutine, unlike send.
func write[T any](fd int, v *T) error {
	b := unsafe.Slice((*byte)(unsafe.Pointer(v)), unsafe.Sizeof(*v))
	(*fuse.InHeader)(unsafe.Pointer(v)).Length = uint32(len(b))
	_, err := unix.Write(fd, b)
	return err
}

// reply waits up to ms milliseconds for the next reply and returns its
// header.
func (k kernelSide) reply(ms int) (fuse.OutHeader, bool) {
	h, _, ok := k.replyBody(ms)
	return h, ok
}

// replyBody is reply with the payload after the header.
func (k kernelSide) replyBody(ms int) (fuse.OutHeader, []byte, bool) {
	// A poll cut short by a signal (the runtime preempts threads with
	// SIGURG) is asked again for the time left: it is no "no reply".
	pfd := []unix.PollFd{{Fd: int32(k.fd), Events: unix.POLLIN}}
	deadline := time.Now().Add(time.Duration(ms) * time.Millisecond)
	for {
		left := max(int(time.Until(deadline).Milliseconds()), 0)
		n, err := unix.Poll(pfd, left)
		if err == unix.EINTR && left > 0 {
			continue
		}
		if n != 1 || err != nil {
			return fuse.OutHeader{}, nil, false
		}
		break
	}
	buf := make([]byte, 1<<20)
	n, err := unix.Read(k.fd, buf)
	if err != nil || n < outHeaderSize {
		k.t.Fatalf("reading a reply: %d bytes, %v", n, err)
	}
	h := *(*fuse.OutHeader)(unsafe.Pointer(&buf[0]))
	if int(h.Length) != n {
		k.t.Fatalf("reply of %d bytes says it has %d", n, h.Length)
	}
	return h, buf[outHeaderSize:n], true
}

// serveFake runs s's loop on one end of a fake /dev/fuse and returns the
// other; the loop stops when the test ends.
func serveFake(t *testing.T, s *server, fd int) {
	s.loops.Add(1)
	loopDone := make(chan struct{})
	go s.loop(fd, false, func() { close(loopDone) })
	t.Cleanup(func() { <-loopDone; s.hand.Wait(); unix.Close(fd) })
}

// TestInterruptCancelsItsRequest: an INTERRUPT for a read that waits on its
// device cancels that read's context once the grace period has passed
// since the INTERRUPT, not before, and the read is answered EINTR; the
// other read waiting beside it is not touched until its own INTERRUPT.
func TestInterruptCancelsItsRequest(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	img, _ := null.New("stuck", 1<<20, true)
	s := newServer(New(stuckImage{img}, Options{}), fds[0])
	const grace = 300 * time.Millisecond
	s.pending.grace = grace
	k := kernelSide{t, fds[1]}
	// Two reads queued before the loop starts: neither is lone (the
	// second waits behind the first), so both go to goroutines, where an
	// INTERRUPT can reach them.
	send(k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opRead, Unique: 10, NodeId: 1}, Size: 4096})
	send(k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opRead, Unique: 11, NodeId: 1}, Size: 4096})
	s.loops.Add(1)
	loopDone := make(chan struct{})
	go s.loop(fds[0], false, func() { close(loopDone) })
	t.Cleanup(func() {
		unix.Close(fds[1]) // the loop reads end-of-file and stops
		<-loopDone
		// Reads a failed test left waiting end now.
		s.pending.mu.Lock()
		left := maps.Clone(s.pending.m)
		s.pending.mu.Unlock()
		for unique, r := range left {
			s.pending.cancel(unique, r)
		}
		s.hand.Wait()
		unix.Close(fds[0])
	})

	began := time.Now()
	send(k, &fuse.InterruptIn{InHeader: fuse.InHeader{Opcode: opInterrupt, Unique: 12}, Unique: 11})
	h, ok := k.reply(5000)
	if waited := time.Since(began); ok && waited < grace/2 {
		t.Fatalf("the interrupted read was answered after %v, inside the %v grace period", waited, grace)
	}
	if !ok {
		t.Fatal("no reply after an INTERRUPT: the interrupted read still waits")
	}
	if h.Unique != 11 || h.Status != -int32(unix.EINTR) {
		t.Fatalf("reply to unique %d status %d, want unique 11 status -EINTR", h.Unique, h.Status)
	}
	if _, ok := k.reply(300); ok {
		t.Fatal("a reply came for the read nobody interrupted")
	}
	send(k, &fuse.InterruptIn{InHeader: fuse.InHeader{Opcode: opInterrupt, Unique: 13}, Unique: 10})
	if h, ok := k.reply(5000); !ok || h.Unique != 10 || h.Status != -int32(unix.EINTR) {
		t.Fatalf("second INTERRUPT: reply %+v (%v), want unique 10 -EINTR", h, ok)
	}
}

// TestReadDuringADrainLeavesTheLoop: a READ that comes while a drain
// holds the export (a resize waiting for the requests in flight) waits
// in a goroutine, not in the loop: a GETATTR behind it is answered
// meanwhile, and the READ, with its bytes, once the drain ends.
func TestReadDuringADrainLeavesTheLoop(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	img, _ := null.New("null", 1<<20, true)
	s := newServer(New(img, Options{}), fds[0])
	k := kernelSide{t, fds[1]}
	release, err := s.exp.inflight.Drain(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	serveFake(t, s, fds[0])
	defer unix.Close(fds[1]) // first: the loop reads end-of-file and stops
	released := false
	defer func() {
		if !released {
			release()
		}
	}()
	send(k, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opRead, Unique: 1, NodeId: 1}, Size: 4096})
	send(k, &fuse.GetAttrIn{InHeader: fuse.InHeader{Opcode: opGetattr, Unique: 2, NodeId: 1}})
	if h, ok := k.reply(2000); !ok || h.Unique != 2 || h.Status != 0 {
		t.Fatalf("GETATTR behind a READ during a drain: reply %+v (%v), want unique 2 first", h, ok)
	}
	release()
	released = true
	if h, body, ok := k.replyBody(2000); !ok || h.Unique != 1 || h.Status != 0 || len(body) != 4096 {
		t.Fatalf("the READ once the drain ended: reply %+v with %d bytes (%v)", h, len(body), ok)
	}
}
