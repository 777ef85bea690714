package sock

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// sockPair returns our end of a connected unix socket pair as a sock, and
// the peer as a plain net.Conn.
func sockPair(t *testing.T, spinMax time.Duration) (*sock, net.Conn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) net.Conn {
		f := os.NewFile(uintptr(fd), "pair")
		defer f.Close() // FileConn dups it
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	ours, peer := conn(fds[0]), conn(fds[1])
	cio, err := New(ours, spinMax)
	if err != nil {
		t.Fatal(err)
	}
	s, ok := cio.(*sock)
	if !ok {
		t.Fatalf("a unix socket got %T, not a sock", cio)
	}
	t.Cleanup(func() { s.Close(); peer.Close() })
	return s, peer
}

// Data that comes only after the reader has slept past sleepInPoll (so it
// waits in the netpoller) is read all the same; so is data written while
// it spins.
func TestSockReadWaits(t *testing.T) {
	s, peer := sockPair(t, 50*time.Microsecond)
	for _, delay := range []time.Duration{0, 10 * time.Microsecond, sleepInPoll / 2, 5 * sleepInPoll, 50 * sleepInPoll} {
		go func() {
			time.Sleep(delay)
			peer.Write([]byte("request"))
		}()
		buf := make([]byte, 16)
		n, err := s.Read(buf)
		if err != nil || string(buf[:n]) != "request" {
			t.Fatalf("after %v: read %q, %v", delay, buf[:n], err)
		}
	}
	// A long wait drops the spin window: the client paused.
	if s.spin != 0 {
		t.Fatalf("spin window %v after a long wait, want 0", s.spin)
	}
}

func TestSockAdapt(t *testing.T) {
	s := &sock{spinMax: 32 * time.Microsecond}
	steps := []struct {
		waited time.Duration
		want   time.Duration
	}{
		{10 * time.Microsecond, 4 * time.Microsecond}, // short waits grow it...
		{10 * time.Microsecond, 8 * time.Microsecond},
		{10 * time.Microsecond, 16 * time.Microsecond},
		{10 * time.Microsecond, 32 * time.Microsecond},
		{10 * time.Microsecond, 32 * time.Microsecond}, // ...up to spinMax
		{time.Millisecond, 0},                          // a pause resets it
	}
	for i, st := range steps {
		s.adapt(st.waited)
		if s.spin != st.want {
			t.Fatalf("step %d: spin %v, want %v", i, s.spin, st.want)
		}
	}
	off := &sock{}
	off.adapt(time.Microsecond)
	if off.spin != 0 {
		t.Fatalf("spinMax 0 spins %v", off.spin)
	}
}

// A reply larger than the socket buffer goes out whole while the client
// reads slowly (Write waits for room, first in poll, then the netpoller).
func TestSockWriteWaitsForRoom(t *testing.T) {
	s, peer := sockPair(t, 0)
	want := bytes.Repeat([]byte("0123456789abcdef"), 1<<18) // 4 MiB
	got := make(chan []byte)
	go func() {
		time.Sleep(10 * sleepInPoll)
		b, _ := io.ReadAll(io.LimitReader(peer, int64(len(want))))
		got <- b
	}()
	if n, err := s.Write(want); n != len(want) || err != nil {
		t.Fatalf("Write = %d, %v", n, err)
	}
	if b := <-got; !bytes.Equal(b, want) {
		t.Fatalf("the client got %d bytes, not what was written", len(b))
	}
}

// CloseRead wakes a reader blocked in the netpoller with EOF; a write to a
// vanished client is an error, not a signal; Close twice is harmless.
func TestSockCloseReadAndVanishedPeer(t *testing.T) {
	s, peer := sockPair(t, 0)
	done := make(chan error)
	go func() {
		_, err := s.Read(make([]byte, 8))
		done <- err
	}()
	time.Sleep(5 * sleepInPoll)
	s.CloseRead()
	select {
	case err := <-done:
		if err != io.EOF {
			t.Fatalf("read after CloseRead: %v, want EOF", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("CloseRead did not wake the reader")
	}
	peer.Close()
	if _, err := s.Write(make([]byte, 1<<20)); !errors.Is(err, unix.EPIPE) && !errors.Is(err, unix.ECONNRESET) {
		t.Fatalf("write to a vanished client: %v, want EPIPE", err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := s.CloseRead(); err != nil {
		t.Fatalf("CloseRead after Close: %v", err)
	}
}

// TestPendingIgnoresSignals: an empty socket is never "pending", however
// often signals interrupt the poll (the runtime preempts threads with
// SIGURG; a poll cut short by one used to count as pending, and a reader
// that trusted it slept in read(2) with nothing coming).
func TestPendingIgnoresSignals(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fds[1])
	s := &sock{fd: fds[0]}
	defer s.Close()
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { // a storm of signals at this process
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
				unix.Kill(os.Getpid(), unix.SIGURG)
			}
		}
	}()
	deadline := time.Now().Add(2 * time.Second)
	for n := 0; time.Now().Before(deadline); n++ {
		if s.Pending() {
			close(stop)
			<-done
			t.Fatalf("an empty socket was pending (after %d polls)", n)
		}
	}
	close(stop)
	<-done
}
