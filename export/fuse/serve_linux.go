package fuse

// The serve loop: our own /dev/fuse processing, as QEMU's 2026 export does.
// go-fuse's server hands every request between goroutines and keeps a 1 MiB
// buffer per reader; measured here it reached 0.55-0.66x QEMU on small
// reads. This loop reads a request into a buffer it owns, runs it inline
// when it cannot block (page-cache hits, null devices, attributes), and
// only otherwise copies it to a goroutine that replies when its I/O is done.
// go-fuse still supplies the protocol structs the handlers take.

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/coroutines"
	"github.com/blockexport/blockexport/formats"
)

// Opcodes (include/uapi/linux/fuse.h); go-fuse keeps its own unexported.
const (
	opLookup      = 1
	opForget      = 2
	opGetattr     = 3
	opSetattr     = 4
	opOpen        = 14
	opRead        = 15
	opWrite       = 16
	opStatfs      = 17
	opRelease     = 18
	opFsync       = 20
	opFlush       = 25
	opInit        = 26
	opInterrupt   = 36
	opDestroy     = 38
	opBatchForget = 42
	opFallocate   = 43
	opLseek       = 46
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
	// puts the payload on a page boundary. An O_DIRECT image (--cache
	// none) can then write it as it is; at offset 0 every write needed
	// a bounce copy (measured: and a read-modify-write, see raw.WriteAt).
	reqPad = 4096 - int(unsafe.Sizeof(fuse.WriteIn{}))

	kernelVersion = 7
	ourMinor      = 28 // the structs go-fuse's types describe
)

// server serves one FUSE connection with one or more queues (cloned fds).
type server struct {
	exp *Export
	fds []int

	inlineReads  formats.NoWaitReader // nil: reads always go async
	reads        missTracker          // when the inline read is worth trying
	inlineWrites bool
	tryWrites    formats.NoWaitWriter // nil: writes go as inlineWrites says

	// pollFor > 0: the queues spin on non-blocking reads that long after
	// each request before sleeping (trading CPU for latency).
	pollFor time.Duration

	stats *Stats // nil: not counting

	passthrough bool   // ask for FUSE passthrough at INIT
	negotiated  uint64 // INIT flags both sides agreed on

	async  sync.WaitGroup // requests running in goroutines
	nasync atomic.Int32   // how many: none means a request may be lone
	// lone is the context of a request the loop runs itself, blocking,
	// because it has no other to serve (coroutines.Lone).
	lone  context.Context
	bufs  *coroutines.BufPool // request copies and read buffers, up to 1 MiB
	small *coroutines.BufPool // the same for requests up to 8 KiB
	loops sync.WaitGroup      // the queue loops
	bulk  bulkHelper
}

func newServer(exp *Export, fd int) *server {
	s := &server{exp: exp, fds: []int{fd},
		lone:  coroutines.Lone(context.Background()),
		bulk:  bulkHelper{fd: -1},
		bufs:  coroutines.NewBufPool(reqPad+bufSize, 4096),
		small: coroutines.NewBufPool(reqPad+8192, 4096)}
	if r, ok := exp.img.(formats.NoWaitReader); ok {
		s.inlineReads = r
	}
	if w, ok := exp.img.(formats.InlineWriter); ok {
		s.inlineWrites = w.InlineWrites()
	}
	if w, ok := exp.img.(formats.NoWaitWriter); ok && !s.inlineWrites {
		s.tryWrites = w
	}
	return s
}

// handshake answers INIT on the first fd: the kernel sends nothing else
// before it.
func (s *server) handshake() error {
	buf := make([]byte, bufSize)
	for {
		n, err := unix.Read(s.fds[0], buf)
		if err == unix.EINTR {
			continue
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
			s.replyErr(s.fds[0], h.Unique, unix.EPROTO)
			return fmt.Errorf("fuse: kernel speaks protocol %d, we speak %d", in.Major, kernelVersion)
		}
		offered := uint64(in.Flags)
		if in.Flags&fuse.CAP_INIT_EXT != 0 {
			offered |= uint64(in.Flags2) << 32
		}
		want := uint64(fuse.CAP_ASYNC_READ | fuse.CAP_BIG_WRITES | fuse.CAP_MAX_PAGES |
			fuse.CAP_ASYNC_DIO | fuse.CAP_INIT_EXT | fuse.CAP_DIRECT_IO_ALLOW_MMAP)
		if s.passthrough {
			want |= fuse.CAP_PASSTHROUGH
		}
		flags := offered & want
		s.negotiated = flags
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
		if flags&fuse.CAP_PASSTHROUGH != 0 {
			out.MaxStackDepth = 1 // the backing file may be on a stacked fs
		}
		s.reply(s.fds[0], h.Unique, 0, unsafe.Slice((*byte)(unsafe.Pointer(&out)), unsafe.Sizeof(out)), nil)
		return nil
	}
}

// registerBacking hands the image's host file to the kernel for
// passthrough and returns its backing id (FUSE_DEV_IOC_BACKING_OPEN).
func (s *server) registerBacking(fd int) (int32, error) {
	if s.negotiated&fuse.CAP_PASSTHROUGH == 0 {
		return 0, errors.New("the kernel did not offer FUSE passthrough")
	}
	const iocBackingOpen = 0x4010e501 // _IOW(229, 1, struct fuse_backing_map)
	m := fuse.BackingMap{Fd: int32(fd)}
	id, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(s.fds[0]), iocBackingOpen, uintptr(unsafe.Pointer(&m)))
	if errno != 0 {
		return 0, fmt.Errorf("FUSE_DEV_IOC_BACKING_OPEN: %w", errno)
	}
	return int32(id), nil
}

// addQueues clones the connection's fd so the kernel spreads requests over
// n queues (FUSE_DEV_IOC_CLONE).
func (s *server) addQueues(n int) error {
	for i := 1; i < n; i++ {
		fd, err := s.cloneFd()
		if err != nil {
			return fmt.Errorf("fuse: queue %d: %w", i, err)
		}
		s.fds = append(s.fds, fd)
	}
	return nil
}

// cloneFd opens another /dev/fuse fd on the connection: a queue.
func (s *server) cloneFd() (int, error) {
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
	if s.pollFor > 0 {
		if err := unix.SetNonblock(fd, true); err != nil {
			unix.Close(fd)
			return -1, err
		}
	}
	return fd, nil
}

// setPoll turns on busy polling for d after each request.
func (s *server) setPoll(d time.Duration) error {
	s.pollFor = d
	if d <= 0 {
		return nil
	}
	for _, fd := range s.fds {
		if err := unix.SetNonblock(fd, true); err != nil {
			return fmt.Errorf("fuse: non-blocking queue: %w", err)
		}
	}
	return nil
}

// serve runs the queue loops and returns when the connection has ended and
// every request has been answered.
func (s *server) serve() {
	s.bulk.stop = make(chan struct{})
	var queues sync.WaitGroup
	for _, fd := range s.fds {
		s.loops.Add(1)
		queues.Add(1)
		go func() {
			defer queues.Done()
			s.loop(fd, false)
		}()
	}
	queues.Wait()
	close(s.bulk.stop) // the connection is gone: a parked helper exits
	s.loops.Wait()
	s.async.Wait()
	for _, fd := range s.fds {
		unix.Close(fd)
	}
	if s.bulk.fd >= 0 {
		unix.Close(s.bulk.fd)
	}
}

// bulkHelper is a second queue that serves only while large writes come.
//
// Why: with one queue, a buffered write's two copies (out of /dev/fuse
// into our buffer, then into the page cache) run in turn on the loop's
// thread; QEMU overlaps them on several threads and wrote 1 MiB blocks
// 25-40% faster here. A second queue doubles the bulk rate (measured:
// raw 3.0 -> 4.6 GiB/s; qcow2 writes in place 2.4 -> 3.1). It is not kept for small requests, where two
// readers of one queue take turns sleeping and lose 25% (measured at 4 KiB,
// iodepth 16). So the helper is cloned at the first large write and parks
// (stops reading /dev/fuse) once none has come for bulkIdle; its fd stays
// open, since requests it handed to goroutines reply through it.
type bulkHelper struct {
	mu      sync.Mutex
	fd      int  // -1 until cloned
	reading bool // the helper is serving (not parked)
	wake    chan struct{}
	stop    chan struct{} // closed when the connection has ended
	last    atomic.Int64  // when the last large write came (UnixNano)
}

// bulkWrite is the write size that calls the bulk helper in, and from which
// a write that cannot finish in place (qcow2 allocating or copying on
// write) leaves the loop with the buffer it was read into rather than
// being copied out of it (below it the copy costs less than a fresh
// buffer); bulkIdle is how long the helper serves after the last one.
const (
	bulkWrite = 128 << 10
	bulkIdle  = 20 * time.Millisecond
)

// sawBulkWrite notes a large write and makes sure the helper is reading.
func (s *server) sawBulkWrite() {
	b := &s.bulk
	b.last.Store(time.Now().UnixNano())
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.reading {
		return
	}
	if b.fd < 0 {
		fd, err := s.cloneFd()
		if err == nil {
			err = unix.SetNonblock(fd, true) // see loop
			if err != nil {
				unix.Close(fd)
			}
		}
		if err != nil {
			s.exp.log.Debug("no bulk-write queue", "err", err)
			return
		}
		b.fd, b.wake = fd, make(chan struct{}, 1)
		b.reading = true
		s.loops.Add(1)
		go s.loop(fd, true)
		return
	}
	b.reading = true
	b.wake <- struct{}{}
}

// waitRequest sleeps until fd has a request; false: the connection has
// ended (the helper checks that every 50 ms).
func (s *server) waitRequest(fd int, helper bool) bool {
	timeout := -1
	if helper {
		timeout = 50
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

// bulkPark runs after each request the helper serves: once large writes
// have stopped, it parks the helper until they resume or the connection
// ends (false: exit).
func (s *server) bulkPark() bool {
	b := &s.bulk
	if time.Since(time.Unix(0, b.last.Load())) < bulkIdle {
		return true
	}
	b.mu.Lock()
	if time.Since(time.Unix(0, b.last.Load())) < bulkIdle {
		b.mu.Unlock()
		return true
	}
	b.reading = false
	b.mu.Unlock()
	select {
	case <-b.wake:
		return true
	case <-b.stop:
		return false
	}
}

// loop is one queue: read a request, answer it (inline or via a goroutine),
// repeat until the kernel says the connection is gone. The bulk helper
// (helper true) also parks between bursts of large writes, and never sleeps
// in read(2), so that it can see the connection end even when its own fd
// gets no ENODEV (a main queue that stopped on a protocol error).
func (s *server) loop(fd int, helper bool) {
	defer s.loops.Done()
	// No goroutine hand-off between reading a request and answering it.
	// The goroutine is deliberately not locked to its thread: measured here,
	// a locked thread that blocks in read(2) costs runtime hand-offs (futex
	// wake-ups on other threads) on every request, and sync (queue depth 1)
	// rows lost 10-20%.
	bp := s.bufs.Get()
	buf := (*bp)[reqPad:]
	out := coroutines.AlignedBuf(maxWrite, 4096)
	var spinUntil time.Time
	var yield coroutines.Yielder // see there
	for {
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
			if !s.waitRequest(fd, helper) {
				return
			}
			spinUntil = time.Time{}
			continue
		case errors.Is(err, unix.EINTR), errors.Is(err, unix.ENOENT):
			continue // interrupted, or a request the kernel already dropped
		case errors.Is(err, unix.ENODEV):
			return // unmounted or aborted
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
		bulk := h.Opcode == opWrite && n >= bulkWrite && s.exp.opts.Writable
		if bulk && (s.inlineWrites || s.tryWrites != nil) {
			s.sawBulkWrite()
		}
		switch {
		case bulk && s.tryWrites != nil && s.tryWriteCounted(fd, buf[:n]):
			// qcow2, in place: inline, like raw (with the bulk helper
			// the two queues each do both copies; measured 1 MiB
			// writes 2.3-2.5 GiB/s handed off, 2.9-3.4 so).
		case bulk && !s.inlineWrites:
			// A large write that must wait (qcow2 allocating) goes to a
			// goroutine with the buffer it was read into, and the loop
			// reads on into a fresh one: the request is not copied.
			s.goAsyncOwned(fd, bp, n)
			bp = s.bufs.Get()
			buf = (*bp)[reqPad:]
		default:
			s.dispatch(fd, buf[:n], out)
		}
		yield.Tick()
		if helper && !s.bulkPark() {
			return
		}
	}
}

// goAsyncOwned finishes the request in (*bp)[:n] in a goroutine that owns
// the buffer and gives it back to the pool.
func (s *server) goAsyncOwned(fd int, bp *[]byte, n int) {
	var began time.Time
	if s.stats != nil {
		began = time.Now()
	}
	s.async.Add(1)
	s.nasync.Add(1)
	go func() {
		defer s.async.Done()
		defer s.nasync.Add(-1)
		defer s.bufs.Put(bp)
		req := (*bp)[reqPad : reqPad+n]
		s.slow(context.Background(), fd, req)
		if s.stats != nil {
			s.count(req, began)
		}
	}()
}

// count records a finished request for --stats.
func (s *server) count(req []byte, began time.Time) {
	k, n := kindOther, 0
	switch (*fuse.InHeader)(unsafe.Pointer(&req[0])).Opcode {
	case opRead:
		k, n = kindRead, int(decode[fuse.ReadIn](req).Size)
	case opWrite:
		k, n = kindWrite, int(decode[fuse.WriteIn](req).Size)
	}
	s.stats.record(k, n, time.Since(began))
}

// Every request runs with context.Background(): the kernel's INTERRUPT is
// not acted on (a request runs to completion; block I/O is short).

// dispatch answers one request. Requests that may block are copied out of
// the loop's buffer and finished by a goroutine.
func (s *server) dispatch(fd int, req, out []byte) {
	if s.stats != nil {
		s.dispatchCounted(fd, req, out)
		return
	}
	s.dispatchOne(fd, req, out, time.Time{})
}

// dispatchCounted is dispatch with --stats: inline requests are counted
// here, async ones when they reply.
func (s *server) dispatchCounted(fd int, req, out []byte) {
	began := time.Now()
	if s.dispatchOne(fd, req, out, began) {
		s.count(req, began)
	}
}

// dispatchOne answers one request; it reports whether it finished inline
// (false: a goroutine finishes it, or it needs no reply).
func (s *server) dispatchOne(fd int, req, out []byte, began time.Time) bool {
	h := (*fuse.InHeader)(unsafe.Pointer(&req[0]))
	e := s.exp
	switch h.Opcode {
	case opForget, opBatchForget, opInterrupt:
		return false // no reply
	case opInit:
		s.replyErr(fd, h.Unique, unix.EPROTO) // only once, in handshake
	case opDestroy:
		s.reply(fd, h.Unique, 0, nil, nil)
	case opLookup:
		s.replyErr(fd, h.Unique, unix.ENOENT)
	case opGetattr:
		var o fuse.AttrOut
		st := e.GetAttr(context.Background(), decode[fuse.GetAttrIn](req), &o)
		replyOut(s, fd, h.Unique, st, &o)
	case opOpen:
		var o fuse.OpenOut
		st := e.Open(decode[fuse.OpenIn](req), &o)
		replyOut(s, fd, h.Unique, st, &o)
	case opRelease:
		s.reply(fd, h.Unique, 0, nil, nil)
	case opStatfs:
		var o fuse.StatfsOut
		st := e.StatFs(context.Background(), h, &o)
		replyOut(s, fd, h.Unique, st, &o)
	case opRead:
		in := decode[fuse.ReadIn](req)
		if s.inlineReads != nil && s.reads.shouldTry() {
			n, st, ok := e.readNoWait(s.inlineReads, in, out)
			s.reads.note(ok)
			if ok {
				s.replyData(fd, h.Unique, st, out[:n])
				return true
			}
		}
		return s.goAsync(fd, req, began)
	case opWrite:
		if s.inlineWrites {
			s.handleWrite(context.Background(), fd, req)
			return true
		}
		if s.tryWrites != nil && s.tryWrite(fd, req) {
			return true
		}
		return s.goAsync(fd, req, began)
	case opSetattr, opFsync, opFlush, opFallocate, opLseek:
		return s.goAsync(fd, req, began)
	default:
		s.replyErr(fd, h.Unique, unix.ENOSYS)
	}
	return true
}

// missTracker decides whether the serve loop tries a read without
// blocking. On a page-cache miss that try is not free: it starts the
// readahead and submits the disk read itself, one request after another
// on the loop's thread (measured: cold random 4 KiB reads at queue depth
// 16, 13.5k IOPS so, 23.4-23.9k when the loop skips the try and the
// goroutines submit). So the loop counts its tries in windows of
// missWindow: when fewer than half of a window hit, it stops trying except
// for every probeEvery-th read, whose outcomes make the next window.
//
// It sits on every inline read, so it keeps to one atomic add per try.
type missTracker struct {
	skipping atomic.Bool
	window   atomic.Uint64 // this window's tries<<32 | hits
	seen     atomic.Uint32 // reads while skipping, for the probes
}

const (
	missWindow = 64
	probeEvery = 8
)

func (m *missTracker) shouldTry() bool {
	return !m.skipping.Load() || m.seen.Add(1)%probeEvery == 0
}

func (m *missTracker) note(hit bool) {
	d := uint64(1) << 32
	if hit {
		d++
	}
	if w := m.window.Add(d); w>>32 == missWindow {
		// The try that fills the window judges it and starts the next
		// (tries other queues add meanwhile count there).
		m.window.Add(-w)
		m.skipping.Store(2*(w&0xffffffff) < missWindow)
	}
}

// goAsync finishes a request that may wait: in the loop itself when it is
// lone (see isLone), else in a goroutine of its own with a copy of req.
// Buffers come from two size classes, so that 4 KiB requests do not pin
// 1 MiB each; the copy starts at reqPad, as in the loop's buffer, so a
// payload stays aligned. It reports whether the request finished here.
func (s *server) goAsync(fd int, req []byte, began time.Time) bool {
	if op := (*fuse.InHeader)(unsafe.Pointer(&req[0])).Opcode; (op == opRead || op == opWrite) && s.isLone(fd) {
		s.slow(s.lone, fd, req)
		return true
	}
	pool := s.pool(reqPad + len(req))
	b, bp := pool.Buffer(reqPad + len(req))
	b = b[reqPad:]
	copy(b, req)
	s.async.Add(1)
	s.nasync.Add(1)
	go func() {
		defer s.async.Done()
		defer s.nasync.Add(-1)
		defer pool.Release(bp)
		s.slow(context.Background(), fd, b)
		if s.stats != nil {
			s.count(b, began)
		}
	}()
	// Let the new goroutine run on this thread now, while its P is ours:
	// it submits its I/O and parks at once. Left queued behind a loop
	// that goes back to sleep in read(2), it waited for another thread
	// to steal it (measured: O_DIRECT 4 KiB reads at queue depth 16,
	// 22k IOPS so, 31k with the yield).
	runtime.Gosched()
	return false
}

// isLone says whether the loop on fd may run a read or write that waits
// itself (others, fsync above all, may take long):
// no other request is in flight in a goroutine and none is waiting on
// fd, so blocking the loop delays nobody, and the request skips the
// hand-offs between threads that a goroutine and the ring cost.
func (s *server) isLone(fd int) bool {
	if s.nasync.Load() != 0 {
		return false
	}
	pfd := [1]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	n, err := unix.Poll(pfd[:], 0)
	return err == nil && n == 0
}

// pool is the buffer pool for n bytes: the small one where it will do.
func (s *server) pool(n int) *coroutines.BufPool {
	if n <= s.small.Size() {
		return s.small
	}
	return s.bufs
}

// slow runs a request that may wait for I/O.
func (s *server) slow(ctx context.Context, fd int, req []byte) {
	h := (*fuse.InHeader)(unsafe.Pointer(&req[0]))
	e := s.exp
	switch h.Opcode {
	case opRead:
		in := decode[fuse.ReadIn](req)
		size := min(int(in.Size), maxWrite)
		pool := s.pool(size)
		ob, bp := pool.Buffer(size)
		defer pool.Release(bp)
		n, st := e.ReadInto(ctx, in, ob)
		s.replyData(fd, h.Unique, st, ob[:n])
	case opWrite:
		s.handleWrite(ctx, fd, req)
	case opSetattr:
		var o fuse.AttrOut
		st := e.SetAttr(ctx, decode[fuse.SetAttrIn](req), &o)
		replyOut(s, fd, h.Unique, st, &o)
	case opFsync:
		s.replyStatus(fd, h.Unique, e.Fsync(ctx, decode[fuse.FsyncIn](req)))
	case opFlush:
		s.replyStatus(fd, h.Unique, e.Flush(ctx, decode[fuse.FlushIn](req)))
	case opFallocate:
		s.replyStatus(fd, h.Unique, e.Fallocate(ctx, decode[fuse.FallocateIn](req)))
	case opLseek:
		var o fuse.LseekOut
		st := e.Lseek(ctx, decode[fuse.LseekIn](req), &o)
		replyOut(s, fd, h.Unique, st, &o)
	}
}

// writePayload splits a WRITE request into its op struct and payload; ok
// false means the payload is not all there.
func writePayload(req []byte) (in *fuse.WriteIn, data []byte, ok bool) {
	in = decode[fuse.WriteIn](req)
	hdr := int(unsafe.Sizeof(fuse.WriteIn{}))
	if len(req) < hdr || int(in.Size) > len(req)-hdr {
		return in, nil, false
	}
	return in, req[hdr : hdr+int(in.Size)], true
}

func (s *server) handleWrite(ctx context.Context, fd int, req []byte) {
	h := (*fuse.InHeader)(unsafe.Pointer(&req[0]))
	in, data, ok := writePayload(req)
	if !ok {
		s.replyErr(fd, h.Unique, unix.EINVAL)
		return
	}
	n, st := s.exp.Write(ctx, in, data)
	o := fuse.WriteOut{Size: n}
	replyOut(s, fd, h.Unique, st, &o)
}

// tryWrite finishes a write inline if the image can do it without waiting;
// false means it did nothing and the request goes async.
// tryWriteCounted is tryWrite for the loop itself, counted for --stats.
func (s *server) tryWriteCounted(fd int, req []byte) bool {
	var began time.Time
	if s.stats != nil {
		began = time.Now()
	}
	if !s.tryWrite(fd, req) {
		return false
	}
	if s.stats != nil {
		s.count(req, began)
	}
	return true
}

func (s *server) tryWrite(fd int, req []byte) bool {
	h := (*fuse.InHeader)(unsafe.Pointer(&req[0]))
	in, data, ok := writePayload(req)
	if !ok {
		return false // the async path answers EINVAL
	}
	n, st, ok := s.exp.writeNoWait(s.tryWrites, in, data)
	if !ok {
		return false
	}
	o := fuse.WriteOut{Size: n}
	replyOut(s, fd, h.Unique, st, &o)
	return true
}

// decode views the request's op struct (which embeds the InHeader) in
// place. A request shorter than the struct (an older kernel's layout) is
// copied into a zeroed one.
func decode[T any](req []byte) *T {
	var zero T
	if size := int(unsafe.Sizeof(zero)); len(req) < size {
		t := new(T)
		copy(unsafe.Slice((*byte)(unsafe.Pointer(t)), size), req)
		return t
	}
	return (*T)(unsafe.Pointer(&req[0]))
}

func (s *server) replyStatus(fd int, unique uint64, st fuse.Status) {
	if st != fuse.OK {
		s.replyErr(fd, unique, unix.Errno(st))
		return
	}
	s.reply(fd, unique, 0, nil, nil)
}

func (s *server) replyErr(fd int, unique uint64, errno unix.Errno) {
	s.reply(fd, unique, -int32(errno), nil, nil)
}

// replyOut sends *v as the reply payload when st is OK. (Generic, not an
// interface, so the reply struct stays on the caller's stack.)
func replyOut[T any](s *server, fd int, unique uint64, st fuse.Status, v *T) {
	if st != fuse.OK {
		s.replyErr(fd, unique, unix.Errno(st))
		return
	}
	s.reply(fd, unique, 0, unsafe.Slice((*byte)(unsafe.Pointer(v)), unsafe.Sizeof(*v)), nil)
}

func (s *server) replyData(fd int, unique uint64, st fuse.Status, data []byte) {
	if st != fuse.OK {
		s.replyErr(fd, unique, unix.Errno(st))
		return
	}
	s.reply(fd, unique, 0, nil, data)
}

// reply writes header + a + b with one writev. A reply to a request the
// kernel has dropped meanwhile (ENOENT) is not an error.
func (s *server) reply(fd int, unique uint64, errno int32, a, b []byte) {
	oh := fuse.OutHeader{Length: uint32(outHeaderSize + len(a) + len(b)), Status: errno, Unique: unique}
	var iov [3]unix.Iovec
	iov[0] = unix.Iovec{Base: (*byte)(unsafe.Pointer(&oh))}
	iov[0].SetLen(outHeaderSize)
	cnt := 1
	for _, p := range [2][]byte{a, b} {
		if len(p) > 0 {
			iov[cnt] = unix.Iovec{Base: &p[0]}
			iov[cnt].SetLen(len(p))
			cnt++
		}
	}
	for {
		_, _, e := unix.Syscall(unix.SYS_WRITEV, uintptr(fd), uintptr(unsafe.Pointer(&iov[0])), uintptr(cnt))
		switch e {
		case 0, unix.ENOENT, unix.ENODEV:
			return
		case unix.EINTR:
			continue
		}
		s.exp.log.Warn("writing a FUSE reply failed", "unique", unique, "err", e)
		return
	}
}
