package aio

import (
	"context"
	"errors"
	"io"
	"unsafe"

	"github.com/blockexport/blockexport/coroutines"
)

// Aligned wraps a file opened with O_DIRECT so that it takes any buffer,
// offset and length, as formats with byte-granular metadata need. Aligned
// requests go straight through; others use an aligned bounce buffer of
// whole blocks, unaligned writes read-modify-write under a range lock on
// their blocks, so that none undoes a neighbouring write to the same block.
// A padded write may extend the file to the end of its last block, with
// zeroes (the formats that use this allocate whole clusters).
func Aligned(f File, align int) File {
	if align <= 1 {
		return f
	}
	return &alignedFile{File: f, align: int64(align),
		bounce: NewBufPool(maxPooledBounce+2*align, align)}
}

// maxPooledBounce is the largest request whose bounce buffer comes from the
// pool (a FUSE or NBD request of up to 1 MiB; O_DIRECT writes from FUSE
// always bounce, their payload follows a header); larger ones allocate.
const maxPooledBounce = 1 << 20

type alignedFile struct {
	File
	align  int64
	rmw    coroutines.RangeLock
	bounce *BufPool
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
	return a.readBounced(ctx, [][]byte{p}, off)
}

func (a *alignedFile) ReadvAt(ctx context.Context, iov [][]byte, off int64) (int, error) {
	if a.allOK(iov, off) {
		return a.File.ReadvAt(ctx, iov, off)
	}
	return a.readBounced(ctx, iov, off)
}

// readBounced reads the blocks covering iov into a bounce buffer and
// scatters the requested bytes; short at the end of the file, with io.EOF.
func (a *alignedFile) readBounced(ctx context.Context, iov [][]byte, off int64) (int, error) {
	want := iovLen(iov)
	if want == 0 {
		return 0, nil
	}
	start, end := a.cover(off, int64(want))
	buf, bp := a.bounce.Buffer(int(end - start))
	defer a.bounce.Release(bp)
	n, err := a.File.ReadAt(ctx, buf, start)
	if err != nil && !errors.Is(err, io.EOF) {
		return 0, err
	}
	data := buf[min(int64(n), off-start):n]
	got := 0
	for _, b := range iov {
		c := copy(b, data)
		data, got = data[c:], got+c
	}
	if got < want {
		return got, io.EOF
	}
	return got, nil
}

func (a *alignedFile) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	return a.write(ctx, [][]byte{p}, off)
}

func (a *alignedFile) WritevAt(ctx context.Context, iov [][]byte, off int64) (int, error) {
	return a.write(ctx, iov, off)
}

// write writes iov at off under a range lock on the blocks it touches:
// straight through when every piece is aligned, else gathered into a
// bounce buffer whose first and last block keep their old bytes.
func (a *alignedFile) write(ctx context.Context, iov [][]byte, off int64) (int, error) {
	total := iovLen(iov)
	if total == 0 {
		return 0, nil
	}
	start, end := a.cover(off, int64(total))
	unlock, err := a.rmw.Lock(ctx, start, end-start)
	if err != nil {
		return 0, err
	}
	defer unlock()
	if a.allOK(iov, off) {
		if len(iov) == 1 {
			return a.File.WriteAt(ctx, iov[0], off)
		}
		return a.File.WritevAt(ctx, iov, off)
	}
	buf, bp := a.bounce.Buffer(int(end - start))
	defer a.bounce.Release(bp)
	for _, blk := range []int64{start, end - a.align} {
		if blk >= off && blk+a.align <= off+int64(total) {
			continue // wholly overwritten
		}
		b := buf[blk-start : blk-start+a.align]
		n, err := a.File.ReadAt(ctx, b, blk)
		if err != nil && !errors.Is(err, io.EOF) {
			return 0, err
		}
		clear(b[n:])
	}
	at := buf[off-start:]
	for _, b := range iov {
		at = at[copy(at, b):]
	}
	if _, err := a.File.WriteAt(ctx, buf, start); err != nil {
		return 0, err
	}
	return total, nil
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
