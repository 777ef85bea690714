package fuse

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"time"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/coroutines"
	"github.com/blockexport/blockexport/formats"
)

// queue is one /dev/fuse fd and the buffers its loop owns. A request is
// read into the loop's buffer at reqPad (a WRITE's payload page-aligned)
// and answered from it while the loop waits; one handed to a goroutine
// takes a buffer along (server.handOff): a pooled copy when small, else
// the loop's very buffer (the loop takes a fresh one), never copied.
type queue struct {
	fd     int
	to     replyTo // where the request in hand replies
	helper bool    // the bulk-write helper (see bulkHelper)
	bp     *[]byte // the request buffer, from s.bufs
	out    []byte  // what inline reads fill
	// outHold keeps out mapped (newMapped) while a loop may use it.
	outHold *[]byte
	// end is called when the queue's loop ends (serve waits for every
	// queue); over is set once a stand-in loop took the queue over (see
	// runStalling), and this one ends without calling end.
	end  func()
	over bool
	// awaitNext: the request just served was a lone one that waited on
	// its peer (runStalling); the loop spins a little for the next one
	// before it sleeps (spinForRequest).
	awaitNext bool
	// lent holds the slices of a read replied from the image's pages
	// (Export.lendPages), reused.
	lent [][]byte
	// pace guesses whether the queue's reader waits on each reply before
	// it asks again (queue depth 1): see depthGuess.
	pace depthGuess
}

// awaitNextSpin is how long a loop spins for the next request before it
// sleeps in read(2), after a lone request of an image that may stall or
// while paced: a reader at queue depth 1 asks again a few µs after its
// reply, and a sleeping loop costs it a wake-up (docs/design.md, Remote
// objects: spinning for a lone reply; Pacing at queue depth 1).
const awaitNextSpin = 20 * time.Microsecond

// spinForRequest spins up to awaitNextSpin for a request on q's fd: how
// many looks found none before one came (0: one was already queued), or
// -1 when none came.
func (s *server) spinForRequest(q *queue) int {
	if s.pollFor > 0 {
		return -1 // the loop's read polls already (--poll-us)
	}
	until := time.Now().Add(awaitNextSpin)
	for looks := 0; ; looks++ {
		if q.queued() {
			return looks
		}
		if !time.Now().Before(until) {
			return -1
		}
	}
}

// queued says whether a request is waiting on the queue's fd.
func (q *queue) queued() bool {
	pfd := [1]unix.PollFd{{Fd: int32(q.fd), Events: unix.POLLIN}}
	n, err := unix.Poll(pfd[:], 0)
	return err != nil || n != 0
}

// loop serves one queue until the connection is gone; end, if set, is
// called when the queue's loop (maybe a stand-in's) has ended. The bulk
// helper (helper) parks between bursts of large writes and never sleeps in
// read(2), so that it sees the connection end without an ENODEV. Not
// locked to its thread: a locked thread blocking in read(2) costs runtime
// hand-offs (futex wake-ups) on every request.
func (s *server) loop(fd int, helper bool, end func()) {
	out := newMapped(maxWrite) // see mapped_linux.go
	s.run(&queue{fd: fd, to: replyTo{fd: fd}, helper: helper, bp: s.bufs.Get(), out: *out, outHold: out, end: end})
}

// run is the loop of queue q (s.loops counts it).
func (s *server) run(q *queue) {
	defer s.loops.Done()
	defer func() {
		s.bufs.Put(q.bp)
		if !q.over {
			// The queue is done for good: its goroutine ends locked to
			// its thread, which then ends too. A loop sleeping in
			// read(2) holds a thread of its own, and Go keeps idle
			// threads forever: a daemon that had 200 exports kept 200
			// threads after their removal. Not when a stand-in took
			// over (q.over): it reuses the thread this one leaves.
			runtime.LockOSThread()
			if q.end != nil {
				q.end()
			}
		}
	}()
	fd, helper := q.fd, q.helper
	comp := s.comp
	if helper {
		comp = nil
	}
	if comp != nil {
		// Before the loop stops answering: requests still waiting
		// read their replies themselves again.
		defer comp.ReleaseCompletions()
	}
	served := 0
	var spinUntil time.Time
	var yield coroutines.Yielder // see there
	for {
		buf := (*q.bp)[reqPad:] // q.bp may change: see handOff
		n, err := unix.Read(fd, buf)
		switch {
		case err == nil:
			spinUntil = time.Time{}
		case errors.Is(err, unix.EAGAIN):
			// Busy-poll mode (--poll-us): keep asking for a while after the
			// last request, then sleep in poll(2) until the next one.
			now := time.Now()
			if spinUntil.IsZero() {
				spinUntil = now.Add(s.pollFor)
			}
			if now.Before(spinUntil) {
				continue
			}
			if comp != nil {
				s.waitRequestOrCompletion(fd, comp)
			} else if !s.waitRequest(fd, helper) {
				return
			}
			spinUntil = time.Time{}
			continue
		case errors.Is(err, unix.EINTR), errors.Is(err, unix.ENOENT):
			continue // interrupted, or a request the kernel already dropped
		case errors.Is(err, unix.ENODEV), errors.Is(err, unix.ECONNABORTED):
			return // unmounted, or aborted (the kernel says ECONNABORTED once fusectl's abort ran: ours, at a stop with the file still open, or someone's)
		default:
			s.exp.log.Error("reading /dev/fuse failed; stopping this queue", "err", err)
			return
		}
		if n < inHeaderSize {
			s.exp.log.Error("short FUSE request; stopping this queue", "len", n)
			return
		}
		h := (*fuse.InHeader)(unsafe.Pointer(&buf[0]))
		if int(h.Length) != n {
			// QEMU halts the export here: the stream is out of sync.
			s.exp.log.Error("FUSE request length mismatch; stopping this queue", "header", h.Length, "read", n)
			return
		}
		if h.Opcode == opWrite && n >= bulkWrite && s.exp.opts.Writable {
			s.sawBulkWrite()
		}
		s.serveRequest(q, buf[:n])
		if q.over {
			return // a stand-in serves the queue from here on
		}
		// Before the loop may sleep in read(2): a lone request of an
		// image that may stall spins for the next one once; any other,
		// while the reader seems to wait on each reply (depthGuess).
		switch {
		case q.awaitNext:
			q.awaitNext = false
			s.spinForRequest(q)
		case s.paced(q):
			q.pace.spun(s.spinForRequest(q))
		}
		if served++; comp != nil && served%completionsEvery == 0 {
			comp.ServeCompletions() // while requests keep coming
		}
		yield.Tick()
		if helper && !s.bulkPark() {
			return
		}
	}
}

// completionsEvery is how many requests in a row a queue serves before it
// reads the completions that came meanwhile (it always reads them when
// /dev/fuse has nothing).
const completionsEvery = 8

// waitRequestOrCompletion sleeps until fd has a request or a completion has
// come, and reads the completions (docs/design.md, One loop for an NBD
// source). First it lets the requests completions made runnable write their
// replies: with one P nothing else would run them meanwhile.
func (s *server) waitRequestOrCompletion(fd int, comp formats.Completions) {
	runtime.Gosched()
	s.cfds = comp.CompletionFds(s.cfds[:0])
	s.pfds = append(s.pfds[:0], unix.PollFd{Fd: int32(fd), Events: unix.POLLIN})
	for _, c := range s.cfds {
		s.pfds = append(s.pfds, unix.PollFd{Fd: int32(c), Events: unix.POLLIN})
	}
	if _, err := unix.Poll(s.pfds, -1); err != nil {
		return // EINTR: the caller reads again
	}
	for _, p := range s.pfds[1:] {
		if p.Revents != 0 {
			comp.ServeCompletions()
			return
		}
	}
}

// waitRequest sleeps until fd has a request; false: the connection has
// ended (the helper checks that every 50 ms). With parkIdle a queue sleeps
// in poll(2) that long, then parks in the netpoller (parkUntilRequest).
func (s *server) waitRequest(fd int, helper bool) bool {
	timeout := -1
	if helper {
		timeout = 50
	} else if s.parkIdle > 0 {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		if k, _ := unix.Poll(pfd, int(s.parkIdle.Milliseconds())); k != 0 {
			return true // a request, the connection's end, or EINTR: the loop reads
		}
		s.parkUntilRequest(fd)
		return true
	}
	for {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		if k, _ := unix.Poll(pfd, timeout); k != 0 || !helper {
			return true
		}
		select {
		case <-s.bulk.stop:
			return false
		default:
		}
	}
}

// parkWhenIdle makes the queues non-blocking and hands them to the
// netpoller, for loops that park once idle for that long
// (MountOptions.ParkIdle). An os.File owns each fd from here on: serve
// closes it through the File.
func (s *server) parkWhenIdle(idle time.Duration) error {
	for _, fd := range s.fds {
		if err := unix.SetNonblock(fd, true); err != nil {
			return fmt.Errorf("fuse: non-blocking queue: %w", err)
		}
		f := os.NewFile(uintptr(fd), "/dev/fuse")
		s.files = append(s.files, f)
		c, err := f.SyscallConn()
		if err != nil {
			return fmt.Errorf("fuse: queue in the netpoller: %w", err)
		}
		s.parked = append(s.parked, c)
	}
	s.parkIdle = idle
	return nil
}

// parkUntilRequest waits in Go's netpoller, holding no thread, until fd
// has a request or the connection has ended (the kernel reports an error
// on it then) or its File is closed; the loop then reads and sees which.
func (s *server) parkUntilRequest(fd int) {
	for i, q := range s.fds {
		if q != fd {
			continue
		}
		s.parks.Add(1)
		waited := false
		// Read calls the function until it says done, waiting for
		// readability after each false: the first call only asks to
		// wait.
		s.parked[i].Read(func(uintptr) bool {
			if !waited {
				waited = true
				return false
			}
			return true
		})
		return
	}
}
