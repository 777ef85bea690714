// Package sock serves a connected socket with plain system calls on the
// calling thread, as QEMU's event loop does, instead of through Go's
// netpoller: the NBD server reads its clients' requests this way, and the
// NBD client its server's replies.
package sock

import (
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Stream is a connection's byte stream.
type Stream interface {
	io.ReadWriter
	CloseRead() error // wakes a blocked Read, which then sees EOF
	Close() error
	// Pending says whether bytes wait to be read (or the stream cannot
	// tell).
	Pending() bool
	// WriteBuffers sends all of bufs, gathered: one system call where
	// the socket takes it all.
	WriteBuffers(bufs [][]byte) error
}

// sock is a Stream on the socket's own descriptor. Why: with the
// netpoller, every request that finds the socket empty parks the reader
// goroutine and has another thread wake it, and each arriving request also
// wakes whichever runtime thread sleeps in epoll_wait; on 2 cores those
// threads preempted the client. So the descriptor is taken out of the
// netpoller (a dup of it is kept, the net.Conn closed) and a read that
// finds no data:
//
//  1. spins on the socket for a while (adaptive, as QEMU's aio_poll), so
//     that a busy client's next request is picked up without the client
//     paying for our wake-up;
//  2. sleeps in poll(2) on its own thread for up to sleepInPoll;
//  3. past that the client is idle: it waits in the netpoller through a
//     temporary dup, so idle connections hold no thread.
type sock struct {
	fd      int
	spinMax time.Duration
	spin    time.Duration // the current spin window (the reader's own)

	mu     sync.Mutex // orders Close against CloseRead
	closed bool
}

// sleepInPoll is how long a wait sleeps in poll(2) before it hands the
// descriptor to the netpoller.
const sleepInPoll = time.Millisecond

// New takes c's descriptor for a sock, or wraps c when it has none
// (net.Pipe in tests). spinMax bounds the busy-poll window; 0 disables it.
// c is closed either way once the stream is (or, for a sock, at once).
func New(c net.Conn, spinMax time.Duration) (Stream, error) {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return netConnIO{c}, nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil, err
	}
	fd := -1
	cerr := rc.Control(func(s uintptr) { fd, err = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0) })
	if cerr != nil {
		return nil, cerr
	}
	if err != nil {
		return nil, os.NewSyscallError("dup", err)
	}
	c.Close() // deregisters the original from epoll; the dup keeps the socket
	return &sock{fd: fd, spinMax: spinMax}, nil
}

// NewBlocking is New for a stream that is read only while an answer is
// due (a client waiting for its replies): its descriptor blocks, so a read
// that finds nothing sleeps in that one read(2) instead of a read, a
// poll(2) and a read again.
func NewBlocking(c net.Conn) (Stream, error) {
	st, err := New(c, 0)
	if err != nil {
		return nil, err
	}
	if s, ok := st.(*sock); ok {
		if err := unix.SetNonblock(s.fd, false); err != nil {
			s.Close()
			return nil, os.NewSyscallError("fcntl", err)
		}
	}
	return st, nil
}

func (s *sock) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	n, err := readNoEINTR(s.fd, p)
	if err == unix.EAGAIN {
		n, err = s.readWaiting(p)
	}
	switch {
	case err != nil:
		return 0, os.NewSyscallError("read", err)
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}

// readWaiting reads once data comes, spinning first (see sock).
func (s *sock) readWaiting(p []byte) (int, error) {
	start := time.Now()
	for s.spin > 0 && time.Since(start) < s.spin {
		if n, err := readNoEINTR(s.fd, p); err != unix.EAGAIN {
			return n, err // caught while spinning: keep the window
		}
	}
	for {
		if err := s.wait(unix.POLLIN); err != nil {
			return 0, err
		}
		n, err := readNoEINTR(s.fd, p)
		if err == unix.EAGAIN {
			continue
		}
		s.adapt(time.Since(start))
		return n, err
	}
}

// adapt sizes the spin window from a wait the spinning missed: a wait
// that a window up to spinMax would have caught grows it (doubling, from
// 4 µs), a longer one means the client paused, and spinning then only
// burns a core.
func (s *sock) adapt(waited time.Duration) {
	switch {
	case s.spinMax <= 0:
	case waited > s.spinMax:
		s.spin = 0
	case s.spin < s.spinMax:
		s.spin = min(max(2*s.spin, 4*time.Microsecond), s.spinMax)
	}
}

// wait blocks until the socket is ready for events: in poll(2) for up to
// sleepInPoll, then in the netpoller.
func (s *sock) wait(events int16) error {
	fds := [1]unix.PollFd{{Fd: int32(s.fd), Events: events}}
	k, err := unix.Poll(fds[:], int(sleepInPoll/time.Millisecond))
	if k > 0 || (err != nil && err != unix.EINTR) {
		return err
	}
	if err == unix.EINTR {
		return nil // the caller retries
	}
	return s.waitInNetpoller(events)
}

// waitInNetpoller parks the goroutine until the socket is ready, through a
// dup registered with the netpoller for just this wait.
func (s *sock) waitInNetpoller(events int16) error {
	dfd, err := unix.FcntlInt(uintptr(s.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return os.NewSyscallError("dup", err)
	}
	f := os.NewFile(uintptr(dfd), "sock") // non-blocking: pollable
	defer f.Close()
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	ready := func(uintptr) bool {
		fds := [1]unix.PollFd{{Fd: int32(s.fd), Events: events}}
		k, _ := unix.Poll(fds[:], 0)
		return k > 0
	}
	if events == unix.POLLOUT {
		return rc.Write(ready)
	}
	return rc.Read(ready)
}

func readNoEINTR(fd int, p []byte) (int, error) {
	for {
		n, err := unix.Read(fd, p)
		if err != unix.EINTR {
			return n, err
		}
	}
}

// Fd is the socket's descriptor, for waiting on it in poll(2) elsewhere
// (a serve loop that reads an NBD client's replies: formats.Completions).
func (s *sock) Fd() int { return s.fd }

// Pending says whether the socket has bytes to read (or an end or error
// to report). A poll interrupted by a signal (the runtime preempts its
// threads so) is asked again: a caller that reads on "pending" slept in
// read(2) with nothing coming, and the NBD client's serve loop hung.
func (s *sock) Pending() bool {
	fds := [1]unix.PollFd{{Fd: int32(s.fd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(fds[:], 0)
		if err == unix.EINTR {
			continue
		}
		return err != nil || n > 0
	}
}

// HungUp says whether the peer has closed its end (or the socket is in
// error), bytes still unread or not: a client that sent its last request
// and left, which its reader may not have reached yet.
func (s *sock) HungUp() bool {
	fds := [1]unix.PollFd{{Fd: int32(s.fd), Events: unix.POLLRDHUP}}
	for {
		n, err := unix.Poll(fds[:], 0)
		if err == unix.EINTR {
			continue
		}
		return err == nil && n > 0 && fds[0].Revents&(unix.POLLRDHUP|unix.POLLHUP|unix.POLLERR) != 0
	}
}

// Write sends all of p. MSG_NOSIGNAL: a vanished peer is an EPIPE error,
// not a signal.
func (s *sock) Write(p []byte) (int, error) {
	n := 0
	for n < len(p) {
		k, err := unix.SendmsgN(s.fd, p[n:], nil, nil, unix.MSG_NOSIGNAL)
		switch err {
		case nil:
			n += k
		case unix.EINTR:
		case unix.EAGAIN:
			// The socket buffer is full: the client is slow to read.
			if err := s.wait(unix.POLLOUT); err != nil {
				return n, os.NewSyscallError("poll", err)
			}
		default:
			return n, os.NewSyscallError("sendmsg", err)
		}
	}
	return n, nil
}

func (s *sock) WriteBuffers(bufs [][]byte) error {
	total := 0
	for _, b := range bufs {
		total += len(b)
	}
	for total > 0 {
		k, err := unix.SendmsgBuffers(s.fd, bufs, nil, nil, unix.MSG_NOSIGNAL)
		switch err {
		case nil:
			total -= k
			for k > 0 { // drop what went out
				if k >= len(bufs[0]) {
					k -= len(bufs[0])
					bufs = bufs[1:]
					continue
				}
				bufs[0] = bufs[0][k:]
				k = 0
			}
			for len(bufs) > 0 && len(bufs[0]) == 0 {
				bufs = bufs[1:]
			}
		case unix.EINTR:
		case unix.EAGAIN:
			if err := s.wait(unix.POLLOUT); err != nil {
				return os.NewSyscallError("poll", err)
			}
		default:
			return os.NewSyscallError("sendmsg", err)
		}
	}
	return nil
}

func (s *sock) CloseRead() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	return unix.Shutdown(s.fd, unix.SHUT_RD)
}

func (s *sock) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	return unix.Close(s.fd)
}

// netConnIO is a connection without a descriptor.
type netConnIO struct{ net.Conn }

func (netConnIO) Pending() bool { return true }

func (c netConnIO) WriteBuffers(bufs [][]byte) error {
	nb := net.Buffers(bufs)
	_, err := nb.WriteTo(c.Conn)
	return err
}

func (c netConnIO) CloseRead() error {
	if cr, ok := c.Conn.(interface{ CloseRead() error }); ok {
		return cr.CloseRead()
	}
	return c.Conn.Close()
}
