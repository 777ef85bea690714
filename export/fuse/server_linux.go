package fuse

// The server: our own /dev/fuse processing, as QEMU's export does
// (docs/design.md, Our own /dev/fuse loop), on go-fuse's protocol structs:
// here the connection (INIT, queues); a queue's loop, the opcode table,
// reads, replies and the rest in the files named for them.

import (
	"context"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/coroutines"
	"github.com/blockexport/blockexport/formats"
)

// Opcodes (include/uapi/linux/fuse.h); go-fuse keeps its own unexported.
const (
	opLookup      = 1
	opForget      = 2
	opGetattr     = 3
	opSetattr     = 4
	opSymlink     = 6
	opMknod       = 8
	opMkdir       = 9
	opUnlink      = 10
	opRmdir       = 11
	opRename      = 12
	opLink        = 13
	opOpen        = 14
	opRead        = 15
	opWrite       = 16
	opStatfs      = 17
	opRelease     = 18
	opFsync       = 20
	opFlush       = 25
	opInit        = 26
	opOpendir     = 27
	opReaddir     = 28
	opReleasedir  = 29
	opFsyncdir    = 30
	opCreate      = 35
	opInterrupt   = 36
	opDestroy     = 38
	opBatchForget = 42
	opFallocate   = 43
	opRename2     = 45
	opLseek       = 46
	opSyncfs      = 50
	opTmpfile     = 51
)

const (
	// maxWrite is the largest READ/WRITE payload we negotiate.
	maxWrite = 1 << 20
	// bufSize holds the largest request: headers plus maxWrite of data.
	bufSize = maxWrite + 4096

	inHeaderSize  = int(unsafe.Sizeof(fuse.InHeader{}))
	outHeaderSize = int(unsafe.Sizeof(fuse.OutHeader{}))

	// reqPad is where a request starts in its (page-aligned) buffer: a
	// WRITE's payload follows its 80 bytes of headers, so starting there
	// puts the payload on a page boundary, which an O_DIRECT image
	// (--cache none) writes as it is, without a bounce copy.
	reqPad = 4096 - int(unsafe.Sizeof(fuse.WriteIn{}))

	kernelVersion = 7
	ourMinor      = 28 // the structs go-fuse's types describe
)

// server serves one FUSE connection with one or more queues (cloned fds).
type server struct {
	exp *Export
	fds []int

	pollFor time.Duration // --poll-us: spin on non-blocking reads that long
	// parkIdle: an idle queue waits in the netpoller (MountOptions.ParkIdle)
	// through parked[i], the handle of fds[i], whose os.File files[i]
	// owns the fd.
	parkIdle time.Duration
	parked   []syscall.RawConn
	files    []*os.File
	parks    atomic.Int64 // how many times a queue parked (tests)
	pace     bool         // spin for a reader at queue depth 1 (depthGuess)

	// comp is set when the one queue reads the image's completions
	// itself (formats.Completions); cfds and pfds are its loop's scratch.
	comp formats.Completions
	cfds []int
	pfds []unix.PollFd

	stats *Stats // nil: not counting

	// stalls: the image's requests may wait on a network peer for up to
	// its reconnect timeout (formats.Features.MayStall), so none may hold
	// a loop's thread for long: see runHere.
	stalls bool

	fileName string      // --file-name: the root is a directory (dir_linux.go)
	extra    []extraFile // the files beside it (partitions)

	negotiated uint64       // INIT flags both sides agreed on
	calls      *kernelCalls // with the kernel cache on (kernelcalls_linux.go)

	// hand runs what may wait (coroutines.Handoff); pending lets an
	// INTERRUPT cancel those requests.
	hand    *coroutines.Handoff
	pending pending
	bufs    *mappedPool    // request buffers and read buffers, up to 1 MiB (mapped_linux.go)
	small   *aio.BufPool   // the same for requests up to 8 KiB
	loops   sync.WaitGroup // the queue loops
	bulk    bulkHelper
}

func newServer(exp *Export, fd int) *server {
	return &server{exp: exp, fds: []int{fd}, stalls: exp.img.Features().MayStall,
		hand:    coroutines.NewHandoff(context.Background()),
		pending: pending{m: map[uint64]*reqCtx{}, grace: interruptGrace},
		bulk:    bulkHelper{fd: -1},
		bufs:    newMappedPool(reqPad + bufSize),
		small:   aio.NewBufPool(reqPad+8192, 4096)}
}

// handshake answers INIT on the first fd: the kernel sends nothing else
// before it.
func (s *server) handshake() error {
	// The buffer the first queue's loop takes next, rather than 1 MiB
	// of garbage per mount (see mapped_linux.go).
	bp := s.bufs.Get()
	defer s.bufs.Put(bp)
	buf := (*bp)[reqPad:]
	n, err := unix.Read(s.fds[0], buf)
	for err == unix.EINTR {
		n, err = unix.Read(s.fds[0], buf)
	}
	if err != nil {
		return fmt.Errorf("fuse: reading INIT: %w", err)
	}
	h := (*fuse.InHeader)(unsafe.Pointer(&buf[0]))
	if n < inHeaderSize || h.Opcode != opInit {
		return fmt.Errorf("fuse: expected INIT, got opcode %d", h.Opcode)
	}
	in := decode[fuse.InitIn](buf[:n])
	if in.Major != kernelVersion {
		s.replyErr(replyTo{fd: s.fds[0]}, h.Unique, unix.EPROTO)
		return fmt.Errorf("fuse: kernel speaks protocol %d, we speak %d", in.Major, kernelVersion)
	}
	offered := uint64(in.Flags)
	if in.Flags&fuse.CAP_INIT_EXT != 0 {
		offered |= uint64(in.Flags2) << 32
	}
	want := uint64(fuse.CAP_ASYNC_READ | fuse.CAP_BIG_WRITES | fuse.CAP_MAX_PAGES |
		fuse.CAP_ASYNC_DIO | fuse.CAP_INIT_EXT | fuse.CAP_DIRECT_IO_ALLOW_MMAP)
	if s.exp.opts.KernelCache && s.exp.opts.Writable {
		// Only writes need it, and without it the kernel takes the
		// size from GETATTR as usual.
		want |= fuse.CAP_WRITEBACK_CACHE
	}
	flags := offered & want
	s.negotiated = flags
	if want&fuse.CAP_WRITEBACK_CACHE != 0 && flags&fuse.CAP_WRITEBACK_CACHE == 0 {
		s.replyErr(replyTo{fd: s.fds[0]}, h.Unique, unix.EPROTO)
		return fmt.Errorf("fuse: --kernel-cache: the kernel did not offer FUSE_WRITEBACK_CACHE")
	}
	out := fuse.InitOut{
		Major:               kernelVersion,
		Minor:               min(ourMinor, in.Minor),
		MaxReadAhead:        in.MaxReadAhead,
		Flags:               uint32(flags),
		Flags2:              uint32(flags >> 32),
		MaxBackground:       256,
		CongestionThreshold: 192,
		MaxWrite:            maxWrite,
		TimeGran:            1,
		MaxPages:            maxWrite / 4096,
	}
	s.reply(replyTo{fd: s.fds[0]}, h.Unique, 0, unsafe.Slice((*byte)(unsafe.Pointer(&out)), unsafe.Sizeof(out)))
	return nil
}

// cloneFd opens another /dev/fuse fd on the connection: a queue.
func (s *server) cloneFd(nonblock bool) (int, error) {
	const iocClone = 0x8004e500 // _IOR(229, 0, uint32_t)
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	src := uint32(s.fds[0])
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), iocClone, uintptr(unsafe.Pointer(&src))); errno != 0 {
		unix.Close(fd)
		return -1, fmt.Errorf("FUSE_DEV_IOC_CLONE: %w", errno)
	}
	if err := unix.SetNonblock(fd, nonblock); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// serve runs the queue loops and returns when the connection has ended and
// every request has been answered.
func (s *server) serve() {
	s.bulk.stop = make(chan struct{})
	var queues sync.WaitGroup
	for _, fd := range s.fds {
		s.loops.Add(1)
		queues.Add(1)
		go s.loop(fd, false, queues.Done)
	}
	queues.Wait()
	close(s.bulk.stop) // the connection is gone: a parked helper exits
	s.loops.Wait()
	s.hand.Wait()
	for i, fd := range s.fds {
		if i < len(s.files) {
			s.files[i].Close() // out of the netpoller, and the fd closed
			continue
		}
		unix.Close(fd)
	}
	if s.bulk.fd >= 0 {
		unix.Close(s.bulk.fd)
	}
}
