package fuse

// FUSE over io_uring (Linux 6.14+; the kernel's
// Documentation/filesystems/fuse/fuse-io-uring.rst and fs/fuse/dev_uring.c):
// a second transport under the same dispatch. The server registers ring
// entries with the kernel, one queue per possible CPU; a request arrives
// as the completion of an entry's command, already copied into the
// entry's buffers, and its reply leaves in the same buffers with one
// COMMIT_AND_FETCH command that also takes the entry's next request. Many
// commits go to the kernel in one io_uring_enter. INIT, FORGET and
// INTERRUPT stay on /dev/fuse, whose loop keeps running (and serves
// everything until every queue has registered).
//
// Each queue is one goroutine locked to its OS thread: the thread that
// submits a command is where the kernel copies the next request for it
// (task work), so it must be the thread that waits. It answers inline
// requests itself; a request handed to a goroutine (see dispatch) owns
// its entry until its reply, which it writes into the entry and passes
// back to the queue thread (a list and an eventfd) to commit.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/aio"
)

const (
	// capOverIOURing is FUSE_OVER_IO_URING, offered (and asked for) in
	// INIT's flags2.
	capOverIOURing = uint64(1) << 41

	uringCmdRegister       = 1
	uringCmdCommitAndFetch = 2

	// struct fuse_uring_req_header: the in/out header, the op's own
	// header, then struct fuse_uring_ent_in_out (flags, commit_id,
	// payload_sz).
	uringOpIn         = 128
	uringEntInOut     = 256
	uringHeaderSize   = 288
	uringPayloadSzOff = uringEntInOut + 16

	// uringArgsAt is where an entry's payload starts in its buffer; the
	// request's in-header and op header are copied in just before it, so
	// that the dispatch sees one contiguous request (and a WRITE's data,
	// page-aligned, is not copied).
	uringArgsAt = 4096

	wakeTag = ^uint64(0)
)

// ErrNoURing says FUSE over io_uring is not to be had; it wraps why.
var ErrNoURing = errors.New("FUSE over io_uring unavailable")

// URingMode is the --io-uring choice.
type URingMode string

const (
	URingAuto URingMode = "auto"
	URingOn   URingMode = "on"
	URingOff  URingMode = "off"
)

// ParseURingMode checks an --io-uring value.
func ParseURingMode(s string) (URingMode, error) {
	switch m := URingMode(s); m {
	case URingAuto, URingOn, URingOff:
		return m, nil
	}
	return "", fmt.Errorf("unknown --io-uring mode %q (want auto, on or off)", s)
}

// uringParam is the fuse module's switch for the transport.
const uringParam = "/sys/module/fuse/parameters/enable_uring"

// ringEntry is one registered entry: its buffer holds the request header
// area (iov[0]) at 0 and the payload (iov[1]) at uringArgsAt.
type ringEntry struct {
	q    *uringQueue
	idx  int
	buf  []byte
	iov  [2]unix.Iovec
	dead bool // the kernel ended it (teardown): it carries nothing more
}

func (e *ringEntry) payload() []byte { return e.buf[uringArgsAt:] }

// commit writes the reply into the entry and has the queue thread send
// it, with the fetch of the entry's next request.
func (e *ringEntry) commit(unique uint64, errno int32, a, b []byte, direct bool) {
	n := 0
	if errno == 0 {
		p := e.payload()
		n = copy(p, a)
		n += copy(p[n:], b) // a read into the payload in place copies onto itself
	}
	*(*fuse.OutHeader)(unsafe.Pointer(&e.buf[0])) = fuse.OutHeader{Length: uint32(outHeaderSize + n), Status: errno, Unique: unique}
	binary.NativeEndian.PutUint32(e.buf[uringPayloadSzOff:], uint32(n))
	if direct {
		e.q.queueCommit(e, unique)
		return
	}
	e.q.handBack(e, unique)
}

// uringQueue is one queue (one possible CPU) and the thread that serves
// it.
type uringQueue struct {
	s    *server
	qid  int
	fd   int // the connection's /dev/fuse
	pin  bool
	ring *aio.CmdRing
	ents []ringEntry
	efd  int
	wake [8]byte
	// cmdBuf is the command bytes being queued (queue thread only).
	cmdBuf [aio.CmdLen]byte

	q     queue // the dispatch's view of the request in hand
	batch []completion
	next  int // the batch's next completion to serve

	mu      sync.Mutex
	commits []pendingCommit // replies from other goroutines
	closing bool

	running bool          // its thread was started
	started chan error    // the registration's outcome
	done    chan struct{} // closed when the thread has stopped
}

type completion struct {
	userData uint64
	res      int32
}

type pendingCommit struct {
	e      *ringEntry
	unique uint64
}

// prepareURing makes every queue's ring and buffers, before INIT asks
// for the transport: once the kernel has agreed to it, requests wait until
// every queue has registered (or a registration fails), so nothing may
// fail in between for want of a resource.
func (s *server) prepareURing(depth int, pin bool) error {
	n, err := possibleCPUs()
	if err != nil {
		return fmt.Errorf("%w: %v", ErrNoURing, err)
	}
	for qid := range n {
		u, err := s.newURingQueue(qid, depth, pin)
		if err != nil {
			s.stopURing()
			return fmt.Errorf("%w: queue %d: %v", ErrNoURing, qid, err)
		}
		s.uqs = append(s.uqs, u)
	}
	return nil
}

// startURing registers the prepared queues' entries and starts their
// threads. It returns ErrNoURing (wrapped) when the kernel did not agree
// to the transport at INIT or refuses a registration (the kernel then
// goes back to /dev/fuse); no queue is left then.
func (s *server) startURing() error {
	if s.negotiated&capOverIOURing == 0 {
		s.stopURing()
		why := "the kernel did not offer it at INIT"
		if b, err := os.ReadFile(uringParam); err != nil {
			why += " (this kernel has no " + uringParam + ": Linux 6.14 or later with CONFIG_FUSE_IO_URING)"
		} else if strings.TrimSpace(string(b)) != "Y" {
			why += " (the fuse module's enable_uring is off: echo 1 > " + uringParam + ")"
		}
		return fmt.Errorf("%w: %s", ErrNoURing, why)
	}
	for _, u := range s.uqs {
		u.running = true
		go u.run()
		if err := <-u.started; err != nil {
			s.stopURing()
			return fmt.Errorf("%w: queue %d: %v", ErrNoURing, u.qid, err)
		}
	}
	return nil
}

// stopURing stops the queue threads that run and releases every queue.
func (s *server) stopURing() {
	for _, u := range s.uqs {
		if u.running {
			u.mu.Lock()
			u.closing = true
			u.mu.Unlock()
			u.kick()
		}
	}
	for _, u := range s.uqs {
		if u.running {
			<-u.done
		}
		u.ring.Close()
		unix.Close(u.efd)
	}
	s.uqs = nil
}

func (s *server) newURingQueue(qid, depth int, pin bool) (*uringQueue, error) {
	ring, err := aio.NewCmdRing(uint32(depth + 2))
	if err != nil {
		return nil, err
	}
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		ring.Close()
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	u := &uringQueue{s: s, qid: qid, fd: s.fds[0], pin: pin, ring: ring, efd: efd,
		ents: make([]ringEntry, depth), started: make(chan error, 1), done: make(chan struct{})}
	u.q = queue{fd: -1, ring: u}
	for i := range u.ents {
		e := &u.ents[i]
		e.q, e.idx = u, i
		e.buf = aio.AlignedBuf(uringArgsAt+maxWrite, 4096)
		e.iov[0] = unix.Iovec{Base: &e.buf[0]}
		e.iov[0].SetLen(uringHeaderSize)
		e.iov[1] = unix.Iovec{Base: &e.buf[uringArgsAt]}
		e.iov[1].SetLen(maxWrite)
	}
	return u, nil
}

// cmd fills the queue thread's struct fuse_uring_cmd_req (flags,
// commit_id, qid), which the ring copies into the SQE: no allocation
// per commit.
func (u *uringQueue) cmd(commitID uint64) *[aio.CmdLen]byte {
	binary.NativeEndian.PutUint64(u.cmdBuf[8:], commitID)
	binary.NativeEndian.PutUint16(u.cmdBuf[16:], uint16(u.qid))
	return &u.cmdBuf
}

// queueCommit queues the entry's reply and next fetch (queue thread only).
func (u *uringQueue) queueCommit(e *ringEntry, unique uint64) {
	for !u.ring.URingCmd(u.fd, uringCmdCommitAndFetch, 0, 0, u.cmd(unique), uint64(e.idx)) {
		u.ring.Enter(false) // the SQ is full: send what is there
	}
}

// handBack passes a reply written by another goroutine to the queue
// thread, waking it when it may be asleep.
func (u *uringQueue) handBack(e *ringEntry, unique uint64) {
	u.mu.Lock()
	first := len(u.commits) == 0
	u.commits = append(u.commits, pendingCommit{e, unique})
	u.mu.Unlock()
	if first {
		u.kick()
	}
}

func (u *uringQueue) kick() {
	one := [8]byte{1}
	unix.Write(u.efd, one[:])
}

// queued says whether another request is in hand or has arrived.
func (u *uringQueue) queued() bool { return u.next < len(u.batch) || u.ring.Pending() }

// run registers the entries and serves the queue until the kernel has
// ended every entry (the connection is gone) or stopURing.
func (u *uringQueue) run() {
	defer close(u.done)
	runtime.LockOSThread() // the ring's task is this thread (see above)
	defer runtime.UnlockOSThread()

	if u.pin {
		var set unix.CPUSet
		set.Set(u.qid)
		if err := unix.SchedSetaffinity(0, &set); err != nil {
			u.s.exp.log.Debug("cannot pin a FUSE io_uring queue to its CPU", "qid", u.qid, "err", err)
		}
	}
	for i := range u.ents {
		e := &u.ents[i]
		if !u.ring.URingCmd(u.fd, uringCmdRegister, uintptr(unsafe.Pointer(&e.iov[0])), 2, u.cmd(0), uint64(i)) {
			u.started <- errors.New("the ring is too small for its entries")
			return
		}
	}
	u.ring.Read(u.efd, u.wake[:], wakeTag)
	if err := u.ring.Enter(false); err != nil {
		u.started <- err
		return
	}
	// A refused registration completes at once; a request may too.
	u.take()
	for _, c := range u.batch {
		if c.userData != wakeTag && c.res < 0 {
			u.started <- fmt.Errorf("FUSE_IO_URING_CMD_REGISTER: %w", unix.Errno(-c.res))
			return
		}
	}
	u.started <- nil
	live := len(u.ents)
	for live > 0 {
		for u.next < len(u.batch) {
			c := u.batch[u.next]
			u.next++
			if c.userData == wakeTag {
				if u.drain() {
					u.ring.Enter(false)
					return
				}
				u.ring.Read(u.efd, u.wake[:], wakeTag)
				continue
			}
			e := &u.ents[c.userData]
			if c.res < 0 {
				if !e.dead {
					e.dead = true
					live--
				}
				continue
			}
			u.serve(e)
		}
		if live == 0 {
			break
		}
		if err := u.ring.Enter(true); err != nil {
			u.s.exp.log.Error("FUSE io_uring queue failed; stopping it", "qid", u.qid, "err", err)
			return
		}
		u.take()
	}
	u.ring.Enter(false)
}

// take moves the completions there are into the batch.
func (u *uringQueue) take() {
	u.batch, u.next = u.batch[:0], 0
	u.ring.Completions(func(ud uint64, res int32) { u.batch = append(u.batch, completion{ud, res}) })
}

// drain queues the commits other goroutines handed back; it reports
// whether the queue is closing.
func (u *uringQueue) drain() bool {
	u.mu.Lock()
	commits, closing := u.commits, u.closing
	u.commits = nil
	u.mu.Unlock()
	for _, c := range commits {
		u.queueCommit(c.e, c.unique)
	}
	return closing
}

// serve lays the request out as /dev/fuse would have delivered it (its
// headers just before its payload) and dispatches it.
func (u *uringQueue) serve(e *ringEntry) {
	h := (*fuse.InHeader)(unsafe.Pointer(&e.buf[0]))
	payloadSz := int(binary.NativeEndian.Uint32(e.buf[uringPayloadSzOff:]))
	opSize := int(h.Length) - inHeaderSize - payloadSz
	if opSize < 0 || opSize > uringOpIn || payloadSz > maxWrite {
		u.s.exp.log.Error("malformed FUSE io_uring request", "opcode", h.Opcode, "len", h.Length, "payload", payloadSz)
		e.commit(h.Unique, -int32(unix.EIO), nil, nil, true)
		return
	}
	start := uringArgsAt - inHeaderSize - opSize
	copy(e.buf[start+inHeaderSize:uringArgsAt], e.buf[uringOpIn:uringOpIn+opSize])
	copy(e.buf[start:], e.buf[:inHeaderSize])
	u.q.to = replyTo{ent: e, direct: true}
	u.q.out = e.payload() // an inline read fills the reply's payload in place
	u.s.serveRequest(&u.q, e.buf[start:uringArgsAt+payloadSz])
}

// possibleCPUs is how many queues the kernel expects: one per possible
// CPU (/sys/devices/system/cpu/possible).
func possibleCPUs() (int, error) {
	b, err := os.ReadFile("/sys/devices/system/cpu/possible")
	if err != nil {
		return 0, err
	}
	return countCPUs(string(b))
}

// countCPUs counts the CPUs of a kernel CPU list ("0-3,8-11", "0").
func countCPUs(list string) (int, error) {
	n := 0
	for _, part := range strings.Split(strings.TrimSpace(list), ",") {
		lo, hi, found := strings.Cut(part, "-")
		a, err1 := strconv.Atoi(lo)
		z := a
		var err2 error
		if found {
			z, err2 = strconv.Atoi(hi)
		}
		if err1 != nil || err2 != nil || a < 0 || z < a {
			return 0, fmt.Errorf("cannot read the CPU list %q", list)
		}
		n += z - a + 1
	}
	return n, nil
}
