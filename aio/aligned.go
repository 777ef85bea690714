package aio

import (
	"context"
	"errors"
	"io"
	"unsafe"

	"github.com/blockexport/blockexport/coroutines"
)

// Aligned wraps a file opened with O_DIRECT so that it takes any buffer,
// offset and length, as formats that keep byte-granular metadata (qcow2's
// header fields, compressed clusters, L1 entries) need. Requests already
// aligned to align (the logical block size) go straight through; others
// use an aligned bounce buffer covering whole blocks, and unaligned writes
// are read-modify-write. Every write holds a range lock on the blocks it
// covers, so that a read-modify-write never undoes a neighbouring write to
// the same block.
//
// A padded write may extend the file to the end of its last block; the
// padding reads as zeroes (formats that use this allocate whole clusters,
// so it never shows).
func Aligned(f File, align int) File {
	if align <= 1 {
		return f
	}
	return &alignedFile{File: f, align: int64(align),
		bounce: coroutines.NewBufPool(maxPooledBounce+2*align, align)}
}

// maxPooledBounce is the largest request whose bounce buffer comes from the
// pool (a FUSE or NBD request of up to 1 MiB; O_DIRECT writes from FUSE
// always bounce, their payload follows a header); larger ones allocate.
const maxPooledBounce = 1 << 20

type alignedFile struct {
	File
	align  int64
	rmw    coroutines.RangeLock
	bounce *coroutines.BufPool
}

// buf returns an aligned buffer of n bytes and the function that gives it
// back.
func (a *alignedFile) buf(n int64) ([]byte, func()) {
	if n <= int64(a.bounce.Size()) {
		b := a.bounce.Get()
		return (*b)[:n], func() { a.bounce.Put(b) }
	}
	return coroutines.AlignedBuf(int(n), int(a.align)), func() {}
}

func (a *alignedFile) ok(p []byte, off int64) bool {
	return len(p) > 0 && off%a.align == 0 && int64(len(p))%a.align == 0 &&
		uintptr(unsafe.Pointer(&p[0]))%uintptr(a.align) == 0
}

// cover widens [off, off+n) to whole blocks.
func (a *alignedFile) cover(off, n int64) (start, end int64) {
	return off / a.align * a.align, (off + n + a.align - 1) / a.align * a.align
}

func (a *alignedFile) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	if len(p) == 0 || a.ok(p, off) {
		return a.File.ReadAt(ctx, p, off)
	}
	start, end := a.cover(off, int64(len(p)))
	buf, put := a.buf(end - start)
	defer put()
	n, err := a.File.ReadAt(ctx, buf, start)
	if err != nil && !errors.Is(err, io.EOF) {
		return 0, err
	}
	got := copy(p, buf[min(int64(n), off-start):n])
	if got < len(p) {
		return got, io.EOF
	}
	return got, nil
}

func (a *alignedFile) ReadvAt(ctx context.Context, iov [][]byte, off int64) (int, error) {
	if a.allOK(iov, off) {
		return a.File.ReadvAt(ctx, iov, off)
	}
	buf := make([]byte, iovLen(iov))
	n, err := a.ReadAt(ctx, buf, off)
	scatter(iov, buf[:n])
	return n, err
}

func (a *alignedFile) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	start, end := a.cover(off, int64(len(p)))
	unlock, err := a.rmw.Lock(ctx, start, end-start)
	if err != nil {
		return 0, err
	}
	defer unlock()
	if a.ok(p, off) {
		return a.File.WriteAt(ctx, p, off)
	}
	buf, put := a.buf(end - start)
	defer put()
	// Only the first and last block keep old bytes; read just those.
	for _, blk := range []int64{start, end - a.align} {
		if blk >= off && blk+a.align <= off+int64(len(p)) {
			continue // wholly overwritten
		}
		b := buf[blk-start : blk-start+a.align]
		n, err := a.File.ReadAt(ctx, b, blk)
		if err != nil && !errors.Is(err, io.EOF) {
			return 0, err
		}
		clear(b[n:])
	}
	copy(buf[off-start:], p)
	if _, err := a.File.WriteAt(ctx, buf, start); err != nil {
		return 0, err
	}
	return len(p), nil
}

func (a *alignedFile) WritevAt(ctx context.Context, iov [][]byte, off int64) (int, error) {
	if a.allOK(iov, off) {
		start, end := a.cover(off, int64(iovLen(iov)))
		unlock, err := a.rmw.Lock(ctx, start, end-start)
		if err != nil {
			return 0, err
		}
		defer unlock()
		return a.File.WritevAt(ctx, iov, off)
	}
	buf := make([]byte, 0, iovLen(iov))
	for _, b := range iov {
		buf = append(buf, b...)
	}
	return a.WriteAt(ctx, buf, off)
}

// allOK says whether a vectored request is aligned piece by piece.
func (a *alignedFile) allOK(iov [][]byte, off int64) bool {
	for _, b := range iov {
		if !a.ok(b, off) {
			return false
		}
		off += int64(len(b))
	}
	return len(iov) > 0
}

func iovLen(iov [][]byte) int {
	n := 0
	for _, b := range iov {
		n += len(b)
	}
	return n
}

func scatter(iov [][]byte, data []byte) {
	for _, b := range iov {
		data = data[copy(b, data):]
	}
}
