// Package fuse exports one image as a single regular file through FUSE, with
// the op-by-op behaviour of qemu-storage-daemon's FUSE export.
//
// [Export] holds the op handlers: go-fuse's request structs in, the
// [formats.Image] called, go-fuse's reply structs out. The server
// (server_linux.go) reads /dev/fuse and calls them; mount_linux.go mounts;
// errno.go maps errors. A READ is planned once (Export.planRead), then lent
// or tried in the loop, else read where it may wait (read_linux.go;
// docs/design.md, The request path).
package fuse

import (
	"context"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/coroutines"
	"github.com/blockexport/blockexport/formats"
)

// Options are the export's behaviour switches.
type Options struct {
	// Writable exports accept writes; others answer EACCES (and are mounted
	// read-only, so the kernel refuses write opens with EROFS first).
	Writable bool
	// Growable exports grow the image on writes past its end; others clamp
	// them (short write, ENOSPC when nothing fits).
	Growable bool
	// KernelCache lets the kernel cache the export's buffered opens
	// (kernelcache_linux.go).
	KernelCache bool
	// KeepCache keeps the kernel's cache of the export across opens:
	// only where nobody but this export can change the image (Tune).
	KeepCache bool
	// ReadAheadKB is the export's read-ahead window under the kernel
	// cache (0: MinReadAheadKB).
	ReadAheadKB int
	// NoPageLend: reads are never replied straight from the image file's
	// mapping (--mapped-reads=false; see formats.PageLender).
	NoPageLend bool
	Logger     *slog.Logger
}

// attrTimeout is how long the kernel may cache attributes (QEMU: 1 s).
const attrTimeout = time.Second

// Export serves one image as the root inode (ino 1) of a FUSE mount, or
// as the one file in it (ino 2) when the root is a directory.
type Export struct {
	img  formats.Image
	opts Options
	log  *slog.Logger

	inflight coroutines.InFlight
	growMu   sync.Mutex // serializes growth past the end of the image

	allowOther atomic.Bool   // the mount has allow_other: SetAttr allows more (QEMU's rules)
	ino        uint64        // the file's inode: the root, or the one file in it
	mode       atomic.Uint32 // permission bits of the file
	uid, gid   atomic.Uint32
	// mtimeNs is the file's mtime in Unix nanoseconds; only the kernel
	// cache's SETATTR changes it.
	mtimeNs atomic.Int64
	// inval, with the kernel cache on, drops the kernel's cached pages of
	// [off, off+length) (length 0: to the end).
	inval func(off, length int64)
	// closing: the export is being stopped with the kernel cache on;
	// GETATTR fails, so that a buffered write that has not yet begun
	// fails too instead of landing in a cache nobody writes back (see
	// server.flushKernelCache).
	closing atomic.Bool
	// writebackFailed, set with the writeback cache, mends the kernel's
	// cache after a write-back WRITE that failed for [off, off+length).
	writebackFailed func(off, length int64)
	// kernelSize, set with the writeback cache, is the file's size as the
	// kernel has it: larger than the image's while a buffered write that
	// grew the file waits in the page cache (see readPastImage).
	kernelSize func() (int64, bool)
	// marks, with the kernel cache on, says where READs may have put the
	// image's bytes in the kernel's cache (readmarks.go).
	marks  *readMarks
	lender formats.CacheLender // the image, when it lends its cache (lendCache)
	pager  formats.PageLender  // the image, when it lends its files' pages (lendPages)
	// dropping: the drops (invalidate) that cleared their marks and have
	// not returned.
	dropMu   sync.Mutex
	dropping []*drop
}

// drop is a drop of the kernel's pages of [from, end) under way; done is
// closed when it has returned.
type drop struct {
	from, end int64
	done      chan struct{}
}

// bypassDrop is what a write that bypassed the page cache must see done
// before its reply (dropAfterBypass): its own drop of the kernel's pages
// of [from, from+length), or the drops under way that cover what it
// wrote (wait), or nothing.
type bypassDrop struct {
	from, length int64
	own          bool
	wait         []chan struct{}
}

// needed says whether the write's reply must wait for anything.
func (d bypassDrop) needed() bool { return d.own || len(d.wait) > 0 }

// New makes an export of img. The image must stay open until the export is
// unmounted.
func New(img formats.Image, o Options) *Export {
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	e := &Export{
		img:  img,
		opts: o,
		log:  o.Logger,
		ino:  rootIno,
	}
	if o.KernelCache {
		e.marks = new(readMarks)
	}
	if l, ok := formats.As[formats.CacheLender](img); ok && l.CanLend() && !o.NoPageLend {
		e.lender = l
	}
	if l, ok := formats.As[formats.PageLender](img); ok && !o.NoPageLend {
		e.pager = l
	}
	e.mtimeNs.Store(time.Now().UnixNano())
	mode := uint32(0o400)
	if o.Writable {
		mode |= 0o200
	}
	e.mode.Store(mode)
	e.uid.Store(uint32(unix.Geteuid()))
	e.gid.Store(uint32(unix.Getegid()))
	return e
}

func (e *Export) fillAttr(ctx context.Context, a *fuse.Attr) {
	size := e.img.Size()
	blocks := (size + 511) / 512
	if alloc, err := e.img.AllocatedSize(ctx); err == nil && alloc >= 0 {
		blocks = (alloc + 511) / 512
	}
	mt := time.Unix(0, e.mtimeNs.Load())
	sec, nsec := uint64(mt.Unix()), uint32(mt.Nanosecond())
	*a = fuse.Attr{
		Ino:    e.ino,
		Size:   uint64(size),
		Blocks: uint64(blocks),
		Atime:  sec, Mtime: sec, Ctime: sec,
		Atimensec: nsec, Mtimensec: nsec, Ctimensec: nsec,
		Mode:    unix.S_IFREG | e.mode.Load(),
		Nlink:   1,
		Owner:   fuse.Owner{Uid: e.uid.Load(), Gid: e.gid.Load()},
		Blksize: 4096,
	}
}

func (e *Export) GetAttr(ctx context.Context, _ *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	if e.closing.Load() {
		return fuse.EIO
	}
	e.fillAttr(ctx, &out.Attr)
	out.SetTimeout(attrTimeout)
	return fuse.OK
}

// SetAttr supports size (resize) and mode, and uid/gid with allow_other;
// file handle, lock owner and kill-suid bits are ignored; anything else is
// ENOTSUP. The errno rules are QEMU's.
func (e *Export) SetAttr(ctx context.Context, in *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	valid := in.Valid &^ (fuse.FATTR_FH | fuse.FATTR_LOCKOWNER | fattrKillSUIDGID)
	supported := uint32(fuse.FATTR_SIZE | fuse.FATTR_MODE)
	if e.allowOther.Load() {
		supported |= fuse.FATTR_UID | fuse.FATTR_GID
	}
	if e.opts.KernelCache {
		// Under the writeback cache the kernel owns mtime and ctime and
		// writes them back with SETATTR (on fsync, close, truncate): a
		// refusal would fail the fsync. Atime stays refused, so touch
		// still fails as in QEMU.
		supported |= fuse.FATTR_MTIME | fuse.FATTR_CTIME | fuse.FATTR_MTIME_NOW
	}
	if valid&^supported != 0 {
		return fuse.Status(unix.ENOTSUP)
	}
	if valid&fuse.FATTR_MODE != 0 {
		// Without allow_other nobody but the owner can reach the file, so
		// group/other bits would be a lie.
		if !e.allowOther.Load() && in.Mode&0o077 != 0 {
			return fuse.EPERM
		}
		if !e.opts.Writable && in.Mode&0o222 != 0 {
			return fuse.EROFS
		}
	}
	if valid&fuse.FATTR_SIZE != 0 {
		if !e.opts.Writable {
			return fuse.EACCES
		}
		// The same size changes nothing (and drains nothing): it is how
		// the kernel cache learns the size at mount (see kernelcache).
		if int64(in.Size) != e.img.Size() {
			if st := e.resize(ctx, int64(in.Size)); !st.Ok() {
				return st
			}
		}
	}
	if valid&fuse.FATTR_MODE != 0 {
		e.mode.Store(in.Mode & 0o7777)
	}
	if valid&fuse.FATTR_UID != 0 {
		e.uid.Store(in.Uid)
	}
	if valid&fuse.FATTR_GID != 0 {
		e.gid.Store(in.Gid)
	}
	switch {
	case valid&fuse.FATTR_MTIME_NOW != 0:
		e.mtimeNs.Store(time.Now().UnixNano())
	case valid&fuse.FATTR_MTIME != 0:
		e.mtimeNs.Store(time.Unix(int64(in.Mtime), int64(in.Mtimensec)).UnixNano())
	}
	e.fillAttr(ctx, &out.Attr)
	out.SetTimeout(attrTimeout)
	return fuse.OK
}

// fattrKillSUIDGID is FATTR_KILL_SUIDGID, which go-fuse does not name.
const fattrKillSUIDGID = 1 << 11

// Quiesce finishes the requests in flight, their replies written (a lent
// read's pages included), and holds new ones back until release: for a
// graph change that closes the image under the export (QEMU drains its
// exports likewise before one).
func (e *Export) Quiesce(ctx context.Context) (release func(), err error) {
	return e.inflight.Drain(ctx)
}

// resize changes the image size with no request in flight, so that no
// write lands beyond a new, smaller end.
func (e *Export) resize(ctx context.Context, size int64) fuse.Status {
	release, err := e.inflight.Drain(ctx)
	if err != nil {
		return errno(err)
	}
	err = e.img.Resize(ctx, size)
	release()
	if err != nil {
		e.log.Debug("resize failed", "size", size, "err", err)
		return errno(err)
	}
	// No FUSE_NOTIFY_INVAL_INODE here: a resize only comes from a
	// SETATTR, and a cached file's SETATTR of the size holds the inode's
	// write-back (fuse_set_nowrite) until its reply, so invalidating a
	// dirty page from here would wait for a write-back that waits for
	// this reply. The kernel drops its own pages after the reply
	// (truncate_pagecache, invalidate_inode_pages2 on a size change).
	return fuse.OK
}

// invalidate drops the kernel's cached pages of [off, off+length) (length
// 0: to the end) under the kernel cache, before the reply of the request
// that changed the image. Never from a serve loop: the kernel may write
// dirty pages back (to us) before it returns.
func (e *Export) invalidate(off, length int64) {
	if off < 0 {
		return // a request's offset past 2^63: nothing was written there
	}
	if length < 0 {
		length = 0 // a length past 2^63: to the end
	}
	if e.inval == nil {
		return // set with the kernel cache, as marks is
	}
	// Until this drop returns, a write into its granules must wait for
	// it: the marks are cleared now, the pages go only when it is done.
	end := int64(1<<63 - 1)
	if length > 0 && off <= end-length {
		end = off + length
	}
	r := &drop{from: off, end: end, done: make(chan struct{})}
	e.dropMu.Lock()
	e.dropping = append(e.dropping, r)
	e.marks.clear(off, end-off)
	e.dropMu.Unlock()
	e.inval(off, length)
	e.dropMu.Lock()
	e.dropping = slices.DeleteFunc(e.dropping, func(d *drop) bool { return d == r })
	e.dropMu.Unlock()
	close(r.done)
}

// finishBypass does what a write that bypassed the page cache must see
// done before its reply. Never from a serve loop (see invalidate).
func (e *Export) finishBypass(d bypassDrop) {
	if d.own {
		e.invalidate(d.from, d.length)
		return
	}
	for _, c := range d.wait {
		<-c
	}
}

// WriteBypassesCache says whether a WRITE changes the image behind the
// kernel's cache (an O_DIRECT open's, with the kernel cache on): it may
// have to drop pages a READ cached (dropAfterBypass).
func (e *Export) WriteBypassesCache(in *fuse.WriteIn) bool {
	return e.opts.KernelCache && in.WriteFlags&fuse.WRITE_CACHE == 0
}

// grow makes the image at least size bytes long. It runs inside a request
// (in flight), so it must not drain; growth never cuts off a request in
// flight, so a mutex against concurrent growers is enough.
func (e *Export) grow(ctx context.Context, size int64) error {
	e.growMu.Lock()
	defer e.growMu.Unlock()
	if e.img.Size() >= size {
		return nil
	}
	return e.img.Resize(ctx, size)
}

// growAllocated is fallocate's grow: with the new tail allocated on the
// host where the image can (a raw file), as QEMU's FUSE export
// truncates with preallocation=falloc there (iotest 308 checks the
// disk usage grows); a plain grow elsewhere.
func (e *Export) growAllocated(ctx context.Context, size int64) error {
	p, ok := e.img.(interface {
		GrowPreallocated(ctx context.Context, size int64, full bool) error
	})
	if !ok {
		return e.grow(ctx, size)
	}
	e.growMu.Lock()
	defer e.growMu.Unlock()
	if e.img.Size() >= size {
		return nil
	}
	return p.GrowPreallocated(ctx, size, false)
}

// Open hands out no file handle. Direct I/O with parallel writes (shared
// mmap works: DIRECT_IO_ALLOW_MMAP), except for buffered opens under the
// kernel cache, kept across opens where KeepCache says.
func (e *Export) Open(in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	if e.opts.KernelCache && in.Flags&unix.O_DIRECT == 0 {
		out.OpenFlags = 0
		if e.opts.KeepCache {
			out.OpenFlags = fuse.FOPEN_KEEP_CACHE
		}
		return fuse.OK
	}
	out.OpenFlags = fuse.FOPEN_DIRECT_IO | fuse.FOPEN_PARALLEL_DIRECT_WRITES
	return fuse.OK
}

// readOp is one READ, worked out once (planRead). It holds the export in
// flight from planRead to endRead: a resize waits for it (the slices a
// lend returns are read by the reply's writev).
type readOp struct {
	off, n int64 // n bytes of the image at off
	zeroes int64 // then zeroes, up to the kernel's size (readPastImage)
	// fillsCache: the kernel may keep what this READ reads in its page
	// cache (cachesRead): its granules are marked.
	fillsCache bool
}

// size is the reply's payload.
func (r readOp) size() int64 { return r.n + r.zeroes }

// readLimit is the most a READ returns: what it asks, up to maxWrite.
func readLimit(in *fuse.ReadIn) int64 { return min(int64(in.Size), maxWrite) }

// planRead works out a READ once (clamped, zeroes past the image under the
// writeback cache, granules marked, counted in flight until endRead). A
// serve loop asks with loop set: false, nothing counted, where it might
// wait (a drain, or a read that would ask the kernel's size).
func (e *Export) planRead(in *fuse.ReadIn, loop bool) (readOp, bool) {
	if !loop {
		e.inflight.Begin()
	} else if e.readCrossesEnd(in) || !e.inflight.TryBegin() {
		return readOp{}, false
	}
	r := readOp{off: int64(in.Offset), fillsCache: e.cachesRead(in)}
	size := e.img.Size() // fixed while the read is counted: a resize drains first
	if r.off >= 0 && r.off < size {
		r.n = min(readLimit(in), size-r.off)
	}
	r.zeroes = e.readPastImage(in, r.off+r.n, size)
	if r.fillsCache {
		e.marks.mark(r.off, r.size())
	}
	return r, true
}

// endRead ends what planRead began, once the reply is written.
func (e *Export) endRead() { e.inflight.End() }

// lendPages lends the read's bytes as slices of the image files' mappings
// (formats.PageLender), appended to v; false: the caller reads. Not for a
// READ that fills the kernel's cache: the image is read drop-behind for
// those, and lent pages would stay in the image's cache too.
func (e *Export) lendPages(r readOp, v [][]byte) ([][]byte, bool) {
	if e.pager == nil || r.fillsCache || r.n == 0 || r.zeroes > 0 {
		return v, false
	}
	v, ok := e.pager.TryLendAt(r.off, r.n, v)
	return v, ok && len(v) <= maxLent
}

// tryRead reads r into buf if the image can without waiting.
func (e *Export) tryRead(r readOp, buf []byte) (int, bool) {
	if r.zeroes > 0 {
		return 0, false
	}
	return int(r.n), r.n == 0 || e.img.TryReadAt(buf[:r.n], r.off)
}

// maxLent bounds the slices one lent read is answered from (a writev's
// vector: the header and these), past which it is read into a buffer.
const maxLent = 128

// lendCache lends the read's bytes where they lie in the image's cache
// (formats.CacheLender); false: the caller reads. release, when not nil,
// ends the loan once the reply is written.
func (e *Export) lendCache(ctx context.Context, r readOp) (bufs [][]byte, release func(), st fuse.Status, ok bool) {
	if e.lender == nil || r.n == 0 || r.zeroes > 0 {
		return nil, nil, fuse.OK, false
	}
	bufs, release, ok, err := e.lender.LendAt(ctx, r.off, r.n, maxLent)
	if err != nil {
		e.log.Debug("read failed", "off", r.off, "len", r.n, "err", err)
		return nil, nil, errno(err), true
	}
	return bufs, release, fuse.OK, ok
}

// read reads r into buf, which holds r.size() bytes.
func (e *Export) read(ctx context.Context, r readOp, buf []byte) (int, fuse.Status) {
	if r.n > 0 {
		if _, err := e.img.ReadAt(ctx, buf[:r.n], r.off); err != nil {
			e.log.Debug("read failed", "off", r.off, "len", r.n, "err", err)
			return 0, errno(err)
		}
	}
	clear(buf[r.n:r.size()])
	return int(r.size()), fuse.OK
}

// cachesRead says whether the kernel may keep what a READ reads in its page
// cache, so that it must mark its granules. Not a direct read (an O_DIRECT
// open's read(2)), which the kernel sends alone with FUSE_READ_LOCKOWNER;
// reads that fill pages carry none (docs/design.md, The kernel cache).
func (e *Export) cachesRead(in *fuse.ReadIn) bool {
	return e.marks != nil && in.ReadFlags&fuse.READ_LOCKOWNER == 0
}

// readPastImage is how many zero bytes a read gets past dataEnd, the
// image's end, under the writeback cache: up to the kernel's size. A
// buffered write past the end grows the file in the kernel at once and the
// image only at write-back; meanwhile an O_DIRECT read of the hole it left
// must read zeroes, not end early.
func (e *Export) readPastImage(in *fuse.ReadIn, dataEnd, size int64) int64 {
	off := int64(in.Offset)
	if e.kernelSize == nil || off < 0 {
		return 0
	}
	want := off + readLimit(in)
	if want <= dataEnd || dataEnd < size {
		return 0 // the image's bytes fill the read, or it ends before the image does
	}
	ks, ok := e.kernelSize()
	if !ok || ks <= dataEnd {
		return 0
	}
	return min(want, ks) - dataEnd
}

// readCrossesEnd says whether a READ reaches past the image's end while
// the kernel may know a larger size: such a read asks the kernel its
// size, which may send a request, so it never runs in a serve loop.
func (e *Export) readCrossesEnd(in *fuse.ReadIn) bool {
	return e.kernelSize != nil && int64(in.Offset)+int64(in.Size) > e.img.Size()
}

// Write writes the payload at the request's offset: clamped at the end of
// a non-growable image (short write; ENOSPC when nothing fits), growing a
// growable one.
func (e *Export) Write(ctx context.Context, in *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	n, st := e.write(ctx, in, data)
	e.finishBypass(e.afterWrite(in, len(data), n, st))
	return n, st
}

// afterWrite: a bypassing write's drop, else the mending of a failed write-back.
func (e *Export) afterWrite(in *fuse.WriteIn, size int, n uint32, st fuse.Status) bypassDrop {
	if e.WriteBypassesCache(in) {
		return e.dropAfterBypass(in, size, n, st)
	}
	e.checkWriteback(in, n, st, size)
	return bypassDrop{}
}

// dropAfterBypass says what a write that bypassed the page cache must see
// done before its reply, once it has landed (a failed one may have landed
// in part): where a READ marked a granule it reaches, a drop of its whole
// granules of its own; else, where a drop that cleared such a mark is
// still under way (a page cached before it may hold the old bytes until
// it returns), a wait for those drops rather than a notify of its own;
// else nothing (docs/design.md, The kernel cache).
func (e *Export) dropAfterBypass(in *fuse.WriteIn, size int, n uint32, st fuse.Status) bypassDrop {
	if n == 0 && st.Ok() {
		return bypassDrop{}
	}
	from, length, marked := e.marks.marked(int64(in.Offset), int64(size))
	if length == 0 {
		return bypassDrop{}
	}
	if marked {
		return bypassDrop{from: from, length: length, own: true}
	}
	end := from + min(length, 1<<63-1-from)
	var wait []chan struct{}
	e.dropMu.Lock()
	for _, d := range e.dropping {
		if d.from < end && from < d.end {
			wait = append(wait, d.done)
		}
	}
	e.dropMu.Unlock()
	return bypassDrop{wait: wait}
}

// checkWriteback: when the kernel's write-back of pages failed or fell
// short (a full host, past the end of a non-growable image), the kernel
// reports the error at fsync and close, but would keep the pages and its
// larger size: once this reply is out, they are mended (mendFailedWriteback).
func (e *Export) checkWriteback(in *fuse.WriteIn, n uint32, st fuse.Status, length int) {
	if e.writebackFailed == nil || in.WriteFlags&fuse.WRITE_CACHE == 0 || (st.Ok() && int(n) >= length) {
		return
	}
	go e.writebackFailed(int64(in.Offset)+int64(n), int64(length)-int64(n))
}

func (e *Export) write(ctx context.Context, in *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	if !e.opts.Writable {
		return 0, fuse.EACCES
	}
	e.inflight.Begin()
	defer e.inflight.End()
	off, n := int64(in.Offset), int64(len(data))
	if n == 0 {
		return 0, fuse.OK
	}
	if size := e.img.Size(); off+n > size {
		if e.opts.Growable {
			if err := e.grow(ctx, off+n); err != nil {
				return 0, errno(err)
			}
		} else if off >= size {
			return 0, fuse.Status(unix.ENOSPC)
		} else {
			n = size - off // short write up to the end
		}
	}
	if _, err := e.img.WriteAt(ctx, data[:n], off); err != nil {
		e.log.Debug("write failed", "off", off, "len", n, "err", err)
		return 0, errno(err)
	}
	return uint32(n), fuse.OK
}

// TryWrite is Write for a serve loop that must not block: only writes that
// need neither clamping nor growth and that the image does at once, with
// no drain under way; ok false: nothing happened. The loop must not do a
// drop the write needs (d.needed()): the notify may wait for a write-back
// only the loop can answer.
func (e *Export) TryWrite(in *fuse.WriteIn, data []byte) (n uint32, st fuse.Status, ok bool, d bypassDrop) {
	if !e.opts.Writable || len(data) == 0 || !e.inflight.TryBegin() {
		return 0, fuse.OK, false, bypassDrop{}
	}
	defer e.inflight.End()
	if int64(in.Offset)+int64(len(data)) > e.img.Size() {
		return 0, fuse.OK, false, bypassDrop{}
	}
	done, err := e.img.TryWriteAt(data, int64(in.Offset))
	if !done {
		return 0, fuse.OK, false, bypassDrop{}
	}
	n, st = uint32(len(data)), fuse.OK
	if err != nil {
		e.log.Debug("write failed", "off", in.Offset, "len", len(data), "err", err)
		n, st = 0, errno(err)
	}
	return n, st, true, e.afterWrite(in, len(data), n, st)
}

// Fallocate follows QEMU: mode 0 only at or past the end (it grows the
// image); PUNCH_HOLE (with KEEP_SIZE) zeroes and may deallocate; ZERO_RANGE
// zeroes and grows without KEEP_SIZE; KEEP_SIZE clamps to the end.
func (e *Export) Fallocate(ctx context.Context, in *fuse.FallocateIn) fuse.Status {
	st := e.fallocate(ctx, in)
	if st.Ok() && in.Mode&(unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_ZERO_RANGE) != 0 {
		// The kernel drops its own pages of the range too; this covers a
		// page read back in while we zeroed.
		e.invalidate(int64(in.Offset), int64(in.Length))
	}
	return st
}

func (e *Export) fallocate(ctx context.Context, in *fuse.FallocateIn) fuse.Status {
	if !e.opts.Writable {
		return fuse.EACCES
	}
	e.inflight.Begin()
	defer e.inflight.End()
	off, length, mode := int64(in.Offset), int64(in.Length), in.Mode
	size := e.img.Size()
	if mode&unix.FALLOC_FL_KEEP_SIZE != 0 {
		length = min(length, size-off)
	}
	punch := mode&unix.FALLOC_FL_PUNCH_HOLE != 0 // zeroes that may be deallocated
	switch {
	case mode == 0:
		if off < size {
			return fuse.Status(unix.EOPNOTSUPP)
		}
		return errno(e.growAllocated(ctx, off+length))
	case punch && mode&unix.FALLOC_FL_KEEP_SIZE == 0:
		return fuse.EINVAL
	case punch && mode&^(unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE) != 0:
		return fuse.Status(unix.EOPNOTSUPP)
	case punch:
	case mode&unix.FALLOC_FL_ZERO_RANGE == 0, mode&^(unix.FALLOC_FL_ZERO_RANGE|unix.FALLOC_FL_KEEP_SIZE) != 0:
		return fuse.Status(unix.EOPNOTSUPP)
	case mode&unix.FALLOC_FL_KEEP_SIZE == 0 && off+length > size:
		if err := e.grow(ctx, off+length); err != nil {
			return errno(err)
		}
	}
	if length <= 0 {
		return fuse.OK
	}
	return errno(e.img.WriteZeroes(ctx, off, length, punch))
}

// Lseek answers SEEK_DATA and SEEK_HOLE from the image's allocation (the
// kernel handles the other whence values itself). The end of the image
// counts as a hole.
func (e *Export) Lseek(ctx context.Context, in *fuse.LseekIn, out *fuse.LseekOut) fuse.Status {
	if in.Whence != unix.SEEK_DATA && in.Whence != unix.SEEK_HOLE {
		return fuse.EINVAL
	}
	e.inflight.Begin()
	defer e.inflight.End()
	off, size := int64(in.Offset), e.img.Size()
	wantData := in.Whence == unix.SEEK_DATA
	for off < size {
		ext, err := e.img.Extent(ctx, off, size-off)
		if err != nil {
			return errno(err)
		}
		if ext.Data == wantData {
			out.Offset = uint64(off)
			return fuse.OK
		}
		if ext.Length <= 0 {
			return fuse.EIO // a format bug; never loop on it
		}
		off += ext.Length
	}
	if !wantData && off == size {
		out.Offset = uint64(size)
		return fuse.OK
	}
	return fuse.Status(unix.ENXIO)
}

// Flush makes the image durable: for FLUSH, FSYNC and SYNCFS alike, as in QEMU.

func (e *Export) Flush(ctx context.Context) fuse.Status {
	if !e.opts.Writable {
		return fuse.OK
	}
	if err := e.img.Flush(ctx); err != nil {
		e.log.Warn("flush failed", "err", err)
		return errno(err)
	}
	return fuse.OK
}

// StatFs describes the export as a file system holding one file: its size
// in 4 KiB blocks, the unallocated part free. (QEMU answers ENOSYS, which
// makes df fail.)
func (e *Export) StatFs(ctx context.Context, _ *fuse.InHeader, out *fuse.StatfsOut) fuse.Status {
	const bs = 4096
	size := e.img.Size()
	used := int64(0)
	if alloc, err := e.img.AllocatedSize(ctx); err == nil && alloc > 0 {
		used = min(alloc, size)
	}
	blocks := uint64((size + bs - 1) / bs)
	free := uint64(max(size-used, 0) / bs)
	*out = fuse.StatfsOut{
		Blocks: blocks, Bfree: free, Bavail: free,
		Files: 1, Ffree: 0,
		Bsize: bs, Frsize: bs, NameLen: 255,
	}
	return fuse.OK
}
