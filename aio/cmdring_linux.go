package aio

import (
	"fmt"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

const (
	opURingCmd = 46 // IORING_OP_URING_CMD
	// cmdAreaOff is where a 128-byte SQE's command bytes start (the
	// kernel's sqe->cmd).
	cmdAreaOff = 48
)

// CmdLen is how many command bytes a 128-byte SQE holds.
const CmdLen = 80

// CmdRing is an io_uring of 128-byte SQEs for passthrough commands
// (IORING_OP_URING_CMD: FUSE over io_uring registers and commits its
// ring entries with them) that one thread drives by itself: it queues
// SQEs, submits them and waits for completions in one io_uring_enter,
// and walks the completions. Not safe for concurrent use: the owner
// thread is the ring's task, where the kernel runs the commands' task
// work, which is why it should stay on one OS thread
// (runtime.LockOSThread).
type CmdRing struct {
	ringMem
	unsub uint32 // SQEs queued and not yet submitted
}

// NewCmdRing makes a command ring with room for entries SQEs; the
// completion ring holds twice as many.
func NewCmdRing(entries uint32) (*CmdRing, error) {
	m, err := setupRing(entries, 2*entries, setupSQE128)
	if err != nil {
		return nil, err
	}
	return &CmdRing{ringMem: m}, nil
}

// room says how many SQEs can still be queued before a submit.
func (r *CmdRing) room() uint32 {
	return r.sqEntries - (*r.sqTail - atomic.LoadUint32(r.sqHead))
}

// next claims the next SQE, zeroed; nil when the SQ is full.
func (r *CmdRing) next() *sqe {
	if r.room() == 0 {
		return nil
	}
	tail := *r.sqTail
	e := r.sqeAt(tail)
	atomic.StoreUint32(r.sqTail, tail+1)
	r.unsub++
	return e
}

// URingCmd queues IORING_OP_URING_CMD on fd: op is the command (cmd_op),
// addr and length its buffer argument, cmd its command bytes, userData
// what its completion carries. It reports false when the SQ is full
// (Enter first).
func (r *CmdRing) URingCmd(fd int, op uint32, addr uintptr, length uint32, cmd *[CmdLen]byte, userData uint64) bool {
	e := r.next()
	if e == nil {
		return false
	}
	e.opcode = opURingCmd
	e.fd = int32(fd)
	e.off = uint64(op) // cmd_op shares the offset field
	e.addr = uint64(addr)
	e.len = length
	e.userData = userData
	*(*[CmdLen]byte)(unsafe.Add(unsafe.Pointer(e), cmdAreaOff)) = *cmd
	return true
}

// Read queues a read of len(buf) bytes from fd (an eventfd, say) into
// buf, which must stay put until the completion.
func (r *CmdRing) Read(fd int, buf []byte, userData uint64) bool {
	e := r.next()
	if e == nil {
		return false
	}
	e.opcode = opRead
	e.fd = int32(fd)
	e.addr = uint64(uintptr(unsafe.Pointer(&buf[0])))
	e.len = uint32(len(buf))
	e.userData = userData
	return true
}

// Enter submits what was queued and, with wait, sleeps until at least
// one completion is there. An interrupted wait returns nil: the caller
// walks whatever completions there are and comes back.
func (r *CmdRing) Enter(wait bool) error {
	var minComplete, flags uint32
	if wait {
		minComplete, flags = 1, enterGetEvents
	}
	for {
		n, _, errno := unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(r.unsub), uintptr(minComplete), uintptr(flags), 0, 0)
		switch errno {
		case 0:
			r.unsub -= uint32(n)
			return nil
		case unix.EINTR:
			if r.unsub == 0 {
				return nil
			}
		case unix.EAGAIN, unix.EBUSY:
			// The CQ is full: the caller must walk it before more fit.
			return nil
		default:
			return fmt.Errorf("io_uring_enter: %w", errno)
		}
	}
}

// Completions calls fn for each completion there is, in order, and
// frees their CQ entries. It reports how many there were.
func (r *CmdRing) Completions(fn func(userData uint64, res int32)) int {
	head := *r.cqHead
	tail := atomic.LoadUint32(r.cqTail)
	n := int(tail - head)
	for ; head != tail; head++ {
		c := r.cqes[head&r.cqMask]
		atomic.StoreUint32(r.cqHead, head+1) // fn may queue SQEs whose completions need room
		fn(c.userData, c.res)
	}
	return n
}

// Pending says whether completions wait to be walked.
func (r *CmdRing) Pending() bool { return *r.cqHead != atomic.LoadUint32(r.cqTail) }

// Close releases the ring. The kernel cancels the commands still queued.
func (r *CmdRing) Close() { r.release() }
