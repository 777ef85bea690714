// Package raw is the raw format: the image is the host file (or block
// device) byte for byte. Allocation comes from the host: SEEK_DATA/SEEK_HOLE
// for extents, st_blocks for the allocated size, punch-hole for discard.
//
// With Direct (--cache none) the host file is O_DIRECT behind
// [aio.Aligned] (the registry opens it so): aligned requests go straight
// to the device (a payload that is merely misaligned in memory is copied,
// never read first), and only the partial blocks at the ends of an
// unaligned write are read-modify-written.
package raw

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/coroutines"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/driver"
	"github.com/blockexport/blockexport/formats/internal/hostfile"
)

// Options say how to use a raw image file.
type Options struct {
	Writable bool
	// Direct: the file is O_DIRECT, behind aio.Aligned.
	Direct bool
}

// Lock is what an open of a raw file locks (see aio.Lock): it shares
// writes with other users, as QEMU's raw driver does, unless it is a
// backing file, whose content must not change under its overlay.
func Lock(writable, backing bool) aio.Lock {
	l := aio.Lock{Perm: aio.PermConsistentRead}
	if writable {
		l.Perm |= aio.PermWrite | aio.PermResize
	}
	if backing {
		l.Unshared = aio.PermWrite | aio.PermResize
	}
	return l
}

// Image is an open raw image.
type Image struct {
	f        aio.File
	writable bool
	noFlush  atomic.Bool // SetNoFlush: Flush issues no fdatasync
	blockDev bool
	size     atomic.Int64

	// writes counts the changes completed (wrote); flushed is what it was
	// when the newest flush that synced began. Equal, Flush has nothing to
	// make durable and issues no fdatasync, as QEMU skips the flush of a
	// node whose write generation has not moved (blockdev-del of a node
	// only read).
	writes, flushed atomic.Uint64

	// Only with Direct: the host's block size, and a lock that keeps a
	// resize out of an unaligned write near the end (see WriteAt).
	align int
	tail  coroutines.RangeLock
}

// New makes the raw image of f, which it owns from now on (Close closes
// it; so does a failed New).
func New(_ context.Context, f aio.File, o Options) (*Image, error) {
	img := &Image{f: f, writable: o.Writable, align: 1}
	if !aio.HasFd(f) {
		// A remote object (read-only, no host file to stat or seek).
		size, err := aio.FileSize(f)
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("raw: %w", err)
		}
		img.size.Store(size)
		return img, nil
	}
	var st unix.Stat_t
	if err := unix.Fstat(f.Fd(), &st); err != nil {
		f.Close()
		return nil, fmt.Errorf("raw: stat %s: %w", f.Name(), err)
	}
	img.blockDev = st.Mode&unix.S_IFMT == unix.S_IFBLK // else regular: aio.Open takes nothing else
	size, err := unix.Seek(f.Fd(), 0, io.SeekEnd)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("raw: size of %s: %w", f.Name(), err)
	}
	img.size.Store(size)
	if o.Direct {
		img.align = aio.LogicalBlockSize(f.Fd())
	}
	return img, nil
}

func (r *Image) Size() int64 { return r.size.Load() }

// ReadAt reads p at off; bytes past the host file's end read as zeroes
// (the file may have shrunk under us).
func (r *Image) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	n, err := r.f.ReadAt(ctx, p, off)
	if errors.Is(err, io.EOF) {
		clear(p[n:])
		return len(p), nil
	}
	if err != nil {
		return n, fmt.Errorf("raw: read %d bytes at %d: %w", len(p), off, err)
	}
	return n, nil
}

// CanLend: when the file lends (a remote object's cache).
func (r *Image) CanLend() bool {
	l, ok := r.f.(formats.CacheLender)
	return ok && l.CanLend()
}

// LendAt lends the file's bytes where the file can (a remote object's
// cache: formats.CacheLender); ok false otherwise.
func (r *Image) LendAt(ctx context.Context, off, n int64, maxBufs int) ([][]byte, func(), bool, error) {
	l, ok := r.f.(formats.CacheLender)
	if !ok {
		return nil, nil, false, nil
	}
	bufs, release, ok, err := l.LendAt(ctx, off, n, maxBufs)
	if err != nil {
		return nil, nil, true, fmt.Errorf("raw: read %d bytes at %d: %w", n, off, err)
	}
	return bufs, release, ok, nil
}

func (r *Image) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	defer r.wrote()
	if !r.writable {
		return 0, formats.ErrReadOnly
	}
	a := int64(r.align)
	if a == 1 || (off%a == 0 && int64(len(p))%a == 0) {
		return r.write(ctx, p, off)
	}
	// An unaligned O_DIRECT write covers whole blocks: when the image ends
	// inside the last one, the host file grows by the padding, and is cut
	// back to the size read here. A resize in between would be undone, so
	// Resize takes every range of this lock.
	start, end := r.cover(off, int64(len(p)))
	unlock, err := r.tail.Lock(ctx, start, end-start)
	if err != nil {
		return 0, err
	}
	defer unlock()
	size := r.size.Load()
	if _, err := r.write(ctx, p, off); err != nil {
		return 0, err
	}
	if keep := max(size, off+int64(len(p))); end > keep && !r.blockDev {
		if err := unix.Ftruncate(r.f.Fd(), keep); err != nil {
			return 0, fmt.Errorf("raw: trim bounce padding at %d: %w", keep, err)
		}
	}
	return len(p), nil
}

func (r *Image) write(ctx context.Context, p []byte, off int64) (int, error) {
	n, err := r.f.WriteAt(ctx, p, off)
	if err != nil {
		return n, fmt.Errorf("raw: write %d bytes at %d: %w", len(p), off, err)
	}
	return n, nil
}

// cover widens [off, off+n) to the host alignment.
func (r *Image) cover(off, n int64) (start, end int64) {
	a := int64(r.align)
	start = off / a * a
	end = (off + n + a - 1) / a * a
	return start, end
}

// WriteZeroes zeroes [off, off+n): a punched hole when mayUnmap allows it,
// else an allocated zero range, else written zeroes.
func (r *Image) WriteZeroes(ctx context.Context, off, n int64, mayUnmap bool) error {
	defer r.wrote()
	if !r.writable {
		return formats.ErrReadOnly
	}
	if n <= 0 {
		return nil
	}
	if !r.blockDev && r.align == 1 {
		if mayUnmap {
			if err := r.f.Fallocate(ctx, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n); err == nil {
				return nil
			} else if !notSupported(err) {
				return fmt.Errorf("raw: punch hole [%d, +%d): %w", off, n, err)
			}
		}
		if err := r.f.Fallocate(ctx, unix.FALLOC_FL_ZERO_RANGE|unix.FALLOC_FL_KEEP_SIZE, off, n); err == nil {
			return nil
		} else if !notSupported(err) {
			return fmt.Errorf("raw: zero range [%d, +%d): %w", off, n, err)
		}
	}
	return formats.WriteZeroBuffers(ctx, r.WriteAt, off, n, max(r.align, 4096))
}

func notSupported(err error) bool {
	return errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EINVAL)
}

// Discard punches a hole where the host can; elsewhere it does nothing,
// which discard allows.
func (r *Image) Discard(ctx context.Context, off, n int64) error {
	defer r.wrote()
	if !r.writable {
		return formats.ErrReadOnly
	}
	if r.blockDev || n <= 0 {
		return nil
	}
	err := r.f.Fallocate(ctx, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n)
	if err != nil && !notSupported(err) {
		return fmt.Errorf("raw: discard [%d, +%d): %w", off, n, err)
	}
	return nil
}

// SetNoFlush makes Flush a no-op, as QEMU's cache=unsafe (qemu-img
// convert's default for its target): written data stays in the page
// cache, safe from a killed process but not from a crash of the host.
func (r *Image) SetNoFlush(on bool) { r.noFlush.Store(on) }

func (r *Image) Flush(ctx context.Context) error {
	if !r.writable || r.noFlush.Load() {
		return nil
	}
	w := r.writes.Load()
	if w == r.flushed.Load() {
		return nil
	}
	if err := r.f.Fdatasync(ctx); err != nil {
		return fmt.Errorf("raw: flush: %w", err)
	}
	// Keep the newest: a flush that began later may have finished first.
	for f := r.flushed.Load(); f < w && !r.flushed.CompareAndSwap(f, w); f = r.flushed.Load() {
	}
	return nil
}

// wrote notes a change completed (or failed part way), for the next
// Flush to make durable: one atomic add.
func (r *Image) wrote() { r.writes.Add(1) }

func (r *Image) Resize(ctx context.Context, size int64) error {
	defer r.wrote()
	if !r.writable {
		return formats.ErrReadOnly
	}
	if r.blockDev {
		return fmt.Errorf("raw: resize a block device: %w", formats.ErrNotSupported)
	}
	if size < 0 {
		return fmt.Errorf("raw: resize to %d: %w", size, formats.ErrOutOfRange)
	}
	if r.align != 1 {
		// An unaligned O_DIRECT write trims its padding back to the size
		// it read under its range lock; a resize between that read and
		// the trim would be undone. Take every range.
		unlock, err := r.tail.Lock(ctx, 0, math.MaxInt64)
		if err != nil {
			return err
		}
		defer unlock()
	}
	if err := unix.Ftruncate(r.f.Fd(), size); err != nil {
		return fmt.Errorf("raw: resize to %d: %w", size, err)
	}
	r.size.Store(size)
	return nil
}

// Extent asks the host for the data/hole boundary at off.
func (r *Image) Extent(_ context.Context, off, n int64) (formats.Extent, error) {
	size := r.size.Load()
	if off < 0 || off >= size {
		return formats.Extent{}, fmt.Errorf("raw: extent at %d: %w", off, formats.ErrOutOfRange)
	}
	n = min(n, size-off)
	if !aio.HasFd(r.f) {
		return r.dataExtent(off, n), nil // a remote object: all data, as qemu-img maps one
	}
	k, zero := hostfile.Run(r.f.Fd(), off, n)
	if zero {
		return r.hole(off, k), nil
	}
	return r.dataExtent(off, k), nil
}

// Raw bytes always lie at their own offset in the file; a hole is present
// (the file answers for it) and reads as zeroes, as qemu-img map shows it.
func (r *Image) hole(off, n int64) formats.Extent {
	return formats.Extent{Start: off, Length: n, Zero: true, Present: true, Offset: off, HasOffset: true, File: r.f.Name()}
}

func (r *Image) dataExtent(off, n int64) formats.Extent {
	return formats.Extent{Start: off, Length: n, Data: true, Present: true, Offset: off, HasOffset: true, File: r.f.Name()}
}

func (r *Image) AllocatedSize(context.Context) (int64, error) {
	if !aio.HasFd(r.f) {
		return 0, errNoAllocation
	}
	if r.blockDev {
		return r.size.Load(), nil
	}
	a, err := hostfile.Allocated(r.f.Fd())
	if err != nil {
		return 0, fmt.Errorf("raw: stat: %w", err)
	}
	return a, nil
}

// errNoAllocation: a file without a descriptor (a remote object) has no
// host allocation to report (qemu-img's "disk size: unavailable").
var errNoAllocation = errors.New("no host allocation to report")

func (r *Image) Info() formats.Info {
	actual, err := r.AllocatedSize(context.Background())
	if err != nil {
		actual = -1
	}
	return formats.Info{Format: "raw", Filename: r.f.Name(), VirtualSize: r.size.Load(), ActualSize: actual, RequestAlignment: r.align,
		Remote: !aio.HasFd(r.f)}
}

func (r *Image) Close() error { return r.f.Close() }

// TryReadAt serves p from the page cache; with O_DIRECT there is no cache
// to hit, and aio says so without a system call.
func (r *Image) TryReadAt(p []byte, off int64) bool { return r.f.TryReadAt(p, off) }

// TryLendAt lends the file's own pages (formats.PageLender).
func (r *Image) TryLendAt(off, n int64, v [][]byte) ([][]byte, bool) {
	if off < 0 || n <= 0 || off+n > r.Size() {
		return v, false
	}
	return formats.LendFile(r.f, v, off, n)
}

// TryWriteAt: a buffered write lands in the page cache; an O_DIRECT one, or
// one to a block device, waits for the device.
func (r *Image) TryWriteAt(p []byte, off int64) (bool, error) {
	if !r.writable || r.blockDev {
		return false, nil // WriteAt reports read-only
	}
	done, err := r.f.TryWriteAt(p, off)
	if done {
		r.wrote()
	}
	if err != nil {
		err = fmt.Errorf("raw: write %d bytes at %d: %w", len(p), off, err)
	}
	return done, err
}

// Features: zeroing a buffered regular file is a fallocate, not a write.
func (r *Image) Features() formats.Features {
	return formats.Features{FastZero: r.align == 1 && !r.blockDev && aio.HasFd(r.f), MayStall: !aio.HasFd(r.f)}
}

// Create makes a new raw image of o.Size bytes at path, sparse. It
// refuses to replace an existing file unless o.Force is set, and what a
// raw file cannot record (a backing file, a cluster size).
func Create(path string, o driver.CreateOptions) error {
	size := o.Size
	switch {
	case o.BackingFile != "" || o.ClusterSize != 0:
		return driver.BadOption("raw", "a backing file and a cluster size are qcow2 options")
	case size < 0:
		return fmt.Errorf("raw: size %d is negative", size)
	}
	if p, ok := o.Keys["preallocation"]; ok && p != "off" {
		return driver.BadOption("raw", "Parameter 'preallocation' value '%s' is not supported here (only preallocation=off)", p)
	}
	if err := o.UnknownKeys("raw", "preallocation"); err != nil {
		return err
	}
	f, err := driver.CreateFile("raw", path, o.Force)
	if err != nil {
		return err
	}
	err = f.Truncate(size)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("raw: create %s: %w", path, err)
	}
	return nil
}
