package fuse

import (
	"bytes"
	"sync"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// kcRange is one invalidation or failed write-back the export asked for.
type kcRange struct{ off, length int64 }

// kcRecorder stands in for the server: it records what the export asks
// the kernel to drop and which write-backs it reports failed.
type kcRecorder struct {
	mu     sync.Mutex
	inval  []kcRange
	failed chan kcRange
}

func kcExport(t *testing.T, size int64, o Options) (*Export, *kcRecorder) {
	t.Helper()
	o.KernelCache = true
	e := New(newNull(t, size), o)
	r := &kcRecorder{failed: make(chan kcRange, 64)}
	e.inval = func(off, length int64) {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.inval = append(r.inval, kcRange{off, length})
	}
	e.writebackFailed = func(off, length int64) { r.failed <- kcRange{off, length} }
	return e, r
}

func (r *kcRecorder) take() []kcRange {
	r.mu.Lock()
	defer r.mu.Unlock()
	got := r.inval
	r.inval = nil
	return got
}

// TestKernelCacheOpenFlags: buffered opens get no direct I/O (and keep the
// cache only with KeepCache); O_DIRECT opens keep direct I/O; without
// the kernel cache every open has direct I/O.
func TestKernelCacheOpenFlags(t *testing.T) {
	for _, c := range []struct {
		kc, keep bool
		flags    uint32
		want     uint32
	}{
		{true, false, unix.O_RDWR, 0},
		{true, true, unix.O_RDWR, fuse.FOPEN_KEEP_CACHE},
		{true, true, unix.O_RDWR | unix.O_DIRECT, fuse.FOPEN_DIRECT_IO | fuse.FOPEN_PARALLEL_DIRECT_WRITES},
		{false, false, unix.O_RDONLY, fuse.FOPEN_DIRECT_IO | fuse.FOPEN_PARALLEL_DIRECT_WRITES},
	} {
		e := New(newNull(t, 1<<20), Options{Writable: true, KernelCache: c.kc, KeepCache: c.keep})
		var out fuse.OpenOut
		e.Open(&fuse.OpenIn{Flags: c.flags}, &out)
		if out.OpenFlags != c.want {
			t.Errorf("kernel cache %v keep %v flags %#o: open flags %#x, want %#x", c.kc, c.keep, c.flags, out.OpenFlags, c.want)
		}
	}
}

// TestKernelCacheSetattrTimes: with the kernel cache the mtime the kernel
// writes back is taken (and reported); atime stays refused; without it,
// times are refused as in QEMU.
func TestKernelCacheSetattrTimes(t *testing.T) {
	e, _ := kcExport(t, 1<<20, Options{Writable: true})
	in := &fuse.SetAttrIn{}
	in.Valid = fuse.FATTR_MTIME | fuse.FATTR_CTIME | fuse.FATTR_FH
	in.Mtime, in.Mtimensec = 1_000_000_000, 5
	var out fuse.AttrOut
	if st := e.SetAttr(ctx, in, &out); st != fuse.OK {
		t.Fatalf("setattr mtime: %v", st)
	}
	if out.Mtime != 1_000_000_000 || out.Mtimensec != 5 {
		t.Fatalf("mtime %d.%d, want 1000000000.5", out.Mtime, out.Mtimensec)
	}
	in.Valid = fuse.FATTR_ATIME | fuse.FATTR_MTIME
	if st := e.SetAttr(ctx, in, &out); st != fuse.Status(unix.ENOTSUP) {
		t.Fatalf("setattr atime: %v, want ENOTSUP", st)
	}
	plain := New(newNull(t, 1<<20), Options{Writable: true})
	in.Valid = fuse.FATTR_MTIME
	if st := plain.SetAttr(ctx, in, &out); st != fuse.Status(unix.ENOTSUP) {
		t.Fatalf("setattr mtime without the kernel cache: %v, want ENOTSUP", st)
	}
}

// TestKernelCacheInvalidates: writes that bypassed the cache where a READ
// was answered before (the kernel may hold its pages) and punched and
// zeroed ranges (not resizes) ask for the pages they changed to be
// dropped, whole 64 KiB granules for the writes; write-backs from the
// cache and bypassing writes no READ reached before do not; a write-back
// past the end of a non-growable image is reported failed for what did
// not fit.
func TestKernelCacheInvalidates(t *testing.T) {
	e, r := kcExport(t, 200000, Options{Writable: true})
	if _, st := e.Write(ctx, &fuse.WriteIn{Offset: 4096}, make([]byte, 512)); st != fuse.OK {
		t.Fatal(st)
	}
	if got := r.take(); len(got) != 0 {
		t.Fatalf("direct write where no READ was: invalidated %v, want nothing", got)
	}
	buf := make([]byte, 4096)
	if _, st := readInto(e, &fuse.ReadIn{Offset: 70000, Size: 4096}, buf); st != fuse.OK {
		t.Fatal(st)
	}
	if _, st := e.Write(ctx, &fuse.WriteIn{Offset: 4096}, make([]byte, 512)); st != fuse.OK || len(r.take()) != 0 {
		t.Fatalf("direct write in another granule than the READ's: %v, or invalidated", st)
	}
	if _, st := e.Write(ctx, &fuse.WriteIn{Offset: 60000}, make([]byte, 8192)); st != fuse.OK {
		t.Fatal(st)
	}
	if got := r.take(); len(got) != 1 || got[0] != (kcRange{0, 128 << 10}) {
		t.Fatalf("direct write over the READ's granule: invalidated %v, want [0 +131072]", got)
	}
	if _, st := e.Write(ctx, &fuse.WriteIn{Offset: 70000}, make([]byte, 512)); st != fuse.OK || len(r.take()) != 0 {
		t.Fatalf("a second direct write with no READ since: %v, or invalidated", st)
	}
	// TryWrite: the loop is told to drop them, not to do it itself.
	if _, ok := tryReadInto(e, &fuse.ReadIn{Offset: 150000, Size: 4096}, buf); !ok {
		t.Fatal("try read: would wait")
	}
	n, st, ok, d := e.TryWrite(&fuse.WriteIn{Offset: 140000}, make([]byte, 4096))
	if !ok || st != fuse.OK || n != 4096 || !d.own || d.from != 128<<10 || d.length != 64<<10 || len(r.take()) != 0 {
		t.Fatalf("try write over a READ's granule: %v %v %d, drop %+v", ok, st, n, d)
	}
	e.finishBypass(d) // as the loop has it done
	r.take()
	if _, _, ok, d := e.TryWrite(&fuse.WriteIn{Offset: 140000}, make([]byte, 4096)); !ok || d.needed() {
		t.Fatalf("try write again: %v, drop %+v", ok, d)
	}
	if _, st := e.Write(ctx, &fuse.WriteIn{Offset: 0, WriteFlags: fuse.WRITE_CACHE}, make([]byte, 4096)); st != fuse.OK {
		t.Fatal(st)
	}
	if got := r.take(); len(got) != 0 {
		t.Fatalf("write-back: invalidated %v, want nothing", got)
	}
	if st := e.Fallocate(ctx, &fuse.FallocateIn{Offset: 0, Length: 8192, Mode: unix.FALLOC_FL_PUNCH_HOLE | unix.FALLOC_FL_KEEP_SIZE}); st != fuse.OK {
		t.Fatal(st)
	}
	if got := r.take(); len(got) != 1 || got[0] != (kcRange{0, 8192}) {
		t.Fatalf("punch: invalidated %v, want [0 +8192]", got)
	}
	in := &fuse.SetAttrIn{}
	in.Valid, in.Size = fuse.FATTR_SIZE, 6000
	if st := e.SetAttr(ctx, in, &fuse.AttrOut{}); st != fuse.OK {
		t.Fatal(st)
	}
	// A resize invalidates nothing itself: the kernel holds the inode's
	// write-back until the SETATTR's reply, so an invalidation from here
	// deadlocks on a dirty page; the kernel drops its pages after the
	// reply (TestTruncateOverDirtyPagesReturns).
	if got := r.take(); len(got) != 0 {
		t.Fatalf("shrink: invalidated %v, want nothing", got)
	}
	// The same size is no resize and drops nothing.
	if st := e.SetAttr(ctx, in, &fuse.AttrOut{}); st != fuse.OK || len(r.take()) != 0 {
		t.Fatalf("same size: %v", st)
	}
	// A write-back across the end: short, and the rest reported failed.
	n, st = e.Write(ctx, &fuse.WriteIn{Offset: 4096, WriteFlags: fuse.WRITE_CACHE}, make([]byte, 4096))
	if st != fuse.OK || n != 6000-4096 {
		t.Fatalf("write-back across the end: %d %v", n, st)
	}
	select {
	case f := <-r.failed:
		if f != (kcRange{6000, 4096 - (6000 - 4096)}) {
			t.Fatalf("failed write-back %v, want [6000 +2192]", f)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a short write-back was not reported")
	}
}

// TestKernelCacheClosingRefusesGetattr: once the export is closing,
// GETATTR fails, so that the kernel fails buffered writes that have not
// begun (see flushKernelCache).
func TestKernelCacheClosingRefusesGetattr(t *testing.T) {
	e, _ := kcExport(t, 1<<20, Options{Writable: true})
	if st := e.GetAttr(ctx, &fuse.GetAttrIn{}, &fuse.AttrOut{}); st != fuse.OK {
		t.Fatal(st)
	}
	e.closing.Store(true)
	if st := e.GetAttr(ctx, &fuse.GetAttrIn{}, &fuse.AttrOut{}); st != fuse.EIO {
		t.Fatalf("getattr while closing: %v, want EIO", st)
	}
}

// FuzzKernelCacheRequests drives the kernel-cache paths of the handlers
// (writes with and without WRITE_CACHE, fallocate, setattr size and
// times) with any offsets, lengths and flags, offsets near 2^63 seeded:
// no panic, and every range the export asks the kernel to drop starts at
// 0 or after and has a length of 0 (to the end) or more.
func FuzzKernelCacheRequests(f *testing.F) {
	f.Add(uint8(0), uint64(4096), uint64(512), uint32(0), uint32(0))
	f.Add(uint8(0), uint64(1<<63-1), uint64(4096), uint32(fuse.WRITE_CACHE), uint32(0))
	f.Add(uint8(1), uint64(1<<63), uint64(1<<63), uint32(0), uint32(unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE))
	f.Add(uint8(1), uint64(9000), uint64(1<<64-1), uint32(0), uint32(unix.FALLOC_FL_ZERO_RANGE|unix.FALLOC_FL_KEEP_SIZE))
	f.Add(uint8(2), uint64(1<<62), uint64(0), uint32(fuse.FATTR_SIZE|fuse.FATTR_MTIME), uint32(0))
	f.Add(uint8(2), uint64(0), uint64(1<<64-1), uint32(fuse.FATTR_MTIME_NOW|fuse.FATTR_CTIME), uint32(0))
	f.Add(uint8(3), uint64(4096), uint64(4096), uint32(0), uint32(0))
	f.Add(uint8(3), uint64(9000), uint64(4096), uint32(fuse.READ_LOCKOWNER), uint32(0))
	f.Fuzz(func(t *testing.T, op uint8, off, length uint64, flags, mode uint32) {
		e, r := kcExport(t, 10000, Options{Writable: true})
		switch op % 4 {
		case 3:
			// A READ (page-filling, or direct with READ_LOCKOWNER in
			// flags), then an O_DIRECT write over it: the write drops
			// the kernel's pages if and only if the READ may have
			// cached some.
			size := min(length, 1<<16)
			n, _ := readInto(e, &fuse.ReadIn{Offset: off, Size: uint32(size), ReadFlags: flags}, make([]byte, size))
			r.take()
			wn, st := e.Write(ctx, &fuse.WriteIn{Offset: off}, make([]byte, size))
			drops := r.take()
			switch {
			case n > 0 && wn > 0 && st.Ok() && flags&fuse.READ_LOCKOWNER == 0 && len(drops) == 0:
				t.Fatalf("a write of %d at %d over a page-filling READ dropped nothing", wn, off)
			case flags&fuse.READ_LOCKOWNER != 0 && len(drops) != 0:
				t.Fatalf("a write over a direct read dropped %v", drops)
			}
			return
		case 0:
			e.Write(ctx, &fuse.WriteIn{Offset: off, WriteFlags: flags}, make([]byte, min(length, 1<<16)))
		case 1:
			e.Fallocate(ctx, &fuse.FallocateIn{Offset: off, Length: length, Mode: mode})
		case 2:
			in := &fuse.SetAttrIn{}
			in.Valid, in.Size, in.Mtime, in.Mtimensec = flags, off%(1<<20), length, mode
			e.SetAttr(ctx, in, &fuse.AttrOut{})
		}
		for _, g := range r.take() {
			if g.off < 0 || g.length < 0 {
				t.Fatalf("asked to drop [%d +%d]", g.off, g.length)
			}
		}
	})
}

// TestReadPastImageUnderWritebackCache: with the writeback cache a READ
// past the image's end reads zeroes up to the kernel's size (a buffered
// write past the end not yet written back), and ends there; without the
// writeback cache it ends at the image's end; a read past 2^63 reads
// nothing.
func TestReadPastImageUnderWritebackCache(t *testing.T) {
	e, _ := kcExport(t, 10000, Options{Writable: true, Growable: true})
	buf := make([]byte, 8192)
	read := func(off uint64, size uint32) (int, []byte) {
		t.Helper()
		for i := range buf {
			buf[i] = 0xa5
		}
		n, st := readInto(e, &fuse.ReadIn{Offset: off, Size: size}, buf)
		if st != fuse.OK {
			t.Fatalf("read %d+%d: %v", off, size, st)
		}
		return n, buf[:n]
	}
	if n, _ := read(8192, 8192); n != 10000-8192 {
		t.Fatalf("no kernel size: read across the end gave %d bytes, want %d", n, 10000-8192)
	}
	e.kernelSize = func() (int64, bool) { return 20000, true }
	n, got := read(8192, 8192)
	if n != 8192 || !bytes.Equal(got[10000-8192:], make([]byte, 8192-(10000-8192))) {
		t.Fatalf("read across the image's end: %d bytes, want 8192 with zeroes past 10000", n)
	}
	if n, got := read(16384, 8192); n != 20000-16384 || !bytes.Equal(got, make([]byte, n)) {
		t.Fatalf("read across the kernel's end: %d bytes, want %d zeroes", n, 20000-16384)
	}
	if n, _ := read(20000, 4096); n != 0 {
		t.Fatalf("read at the kernel's end: %d bytes, want 0", n)
	}
	if n, _ := read(1<<63, 4096); n != 0 {
		t.Fatalf("read at 2^63: %d bytes, want 0", n)
	}
	if !e.readCrossesEnd(&fuse.ReadIn{Offset: 8192, Size: 4096}) || e.readCrossesEnd(&fuse.ReadIn{Offset: 0, Size: 4096}) {
		t.Fatal("readCrossesEnd: a read across the end must leave the serve loop, one inside must not")
	}
	e.kernelSize = func() (int64, bool) { return 0, false }
	if n, _ := read(8192, 8192); n != 10000-8192 {
		t.Fatalf("kernel size unknown: %d bytes, want %d", n, 10000-8192)
	}
}

// TestDirectReadsLeaveNoMark: a direct read (FUSE_READ_LOCKOWNER: an
// O_DIRECT open's read(2)) puts nothing in the kernel's cache, so an
// O_DIRECT write over it drops nothing; a READ without the flag (read-
// ahead, a page fault of a mapping, of an O_DIRECT open too) marks, and
// the write over it drops its granule. Through every read path: the one
// a goroutine runs, the loop's try, and a lending image's.
func TestDirectReadsLeaveNoMark(t *testing.T) {
	e, r := kcExport(t, 1<<20, Options{Writable: true})
	buf := make([]byte, 4096)
	reads := map[string]func(in *fuse.ReadIn){
		"read":    func(in *fuse.ReadIn) { readInto(e, in, buf) },
		"tryRead": func(in *fuse.ReadIn) { tryReadInto(e, in, buf) },
	}
	lend := &lender{Image: newNull(t, 1<<20), data: make([]byte, 1<<20)}
	le, lr := kcExport(t, 1<<20, Options{Writable: true})
	le.img, le.lender = lend, lend
	for name, read := range reads {
		read(&fuse.ReadIn{Offset: 0, Size: 4096, ReadFlags: fuse.READ_LOCKOWNER})
		if _, st := e.Write(ctx, &fuse.WriteIn{Offset: 0}, make([]byte, 4096)); st != fuse.OK || len(r.take()) != 0 {
			t.Fatalf("%s: a write over a direct read dropped pages (%v)", name, st)
		}
		read(&fuse.ReadIn{Offset: 0, Size: 4096})
		if _, st := e.Write(ctx, &fuse.WriteIn{Offset: 0}, make([]byte, 4096)); st != fuse.OK || len(r.take()) != 1 {
			t.Fatalf("%s: a write over a page-cache READ did not drop its granule (%v)", name, st)
		}
	}
	for _, c := range []struct {
		flags uint32
		drops int
	}{{fuse.READ_LOCKOWNER, 0}, {0, 1}} {
		if _, release, _, ok := lendFromCache(le, &fuse.ReadIn{Offset: 0, Size: 4096, ReadFlags: c.flags}); !ok {
			t.Fatal("not lent")
		} else {
			release()
		}
		if _, st := le.Write(ctx, &fuse.WriteIn{Offset: 0}, make([]byte, 4096)); st != fuse.OK || len(lr.take()) != c.drops {
			t.Fatalf("lent read flags %#x: the write over it dropped other than %d granules (%v)", c.flags, c.drops, st)
		}
	}
}
