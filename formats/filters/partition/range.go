package partition

import (
	"context"
	"fmt"

	"github.com/blockexport/blockexport/formats"
)

// Range is a byte range of another image (a partition) served as an image
// of its own. Every request is checked against the range before it reaches
// the disk; its size is fixed (the table's). What else the disk offers
// passes on (formats.Filter), moved to the range's offsets; a flush
// flushes the whole disk.
type Range struct {
	formats.Filter
	start, size int64
	name        string
}

// NewRange serves [start, start+size) of img. The range must lie inside
// the image. Closing the range does not close img, which the caller owns
// (a disk may have several ranges open).
func NewRange(img formats.Image, start, size int64, name string) (*Range, error) {
	if start < 0 || size < 0 || size > img.Size() || start > img.Size()-size {
		return nil, fmt.Errorf("partition %s: bytes %d+%d are not inside the image (%d bytes): %w", name, start, size, img.Size(), formats.ErrOutOfRange)
	}
	return &Range{Filter: formats.Filter{Image: img}, start: start, size: size, name: name}, nil
}

// check refuses a request that leaves the range; off and n are the
// range's own.
func (r *Range) check(op string, off, n int64) error {
	if off < 0 || n < 0 || off > r.size || n > r.size-off {
		return fmt.Errorf("partition %s: %s of %d bytes at %d (size %d): %w", r.name, op, n, off, r.size, formats.ErrOutOfRange)
	}
	return nil
}

func (r *Range) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	if err := r.check("read", off, int64(len(p))); err != nil {
		return 0, err
	}
	return r.Image.ReadAt(ctx, p, r.start+off)
}

func (r *Range) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	if err := r.check("write", off, int64(len(p))); err != nil {
		return 0, err
	}
	return r.Image.WriteAt(ctx, p, r.start+off)
}

func (r *Range) WriteZeroes(ctx context.Context, off, n int64, mayUnmap bool) error {
	if err := r.check("write-zeroes", off, n); err != nil {
		return err
	}
	return r.Image.WriteZeroes(ctx, r.start+off, n, mayUnmap)
}

func (r *Range) Discard(ctx context.Context, off, n int64) error {
	if err := r.check("discard", off, n); err != nil {
		return err
	}
	return r.Image.Discard(ctx, r.start+off, n)
}

func (r *Range) Size() int64 { return r.size }

// Resize is refused: the partition's size is the table's.
func (r *Range) Resize(_ context.Context, size int64) error {
	if size == r.size {
		return nil
	}
	return fmt.Errorf("partition %s: a partition's size is set by the partition table: %w", r.name, formats.ErrNotSupported)
}

// Extent is the disk's extent at the same bytes, cut at the range's end
// and moved to the range's offsets.
func (r *Range) Extent(ctx context.Context, off, n int64) (formats.Extent, error) {
	if off < 0 || off >= r.size {
		return formats.Extent{}, fmt.Errorf("partition %s: extent at %d (size %d): %w", r.name, off, r.size, formats.ErrOutOfRange)
	}
	n = min(n, r.size-off)
	e, err := r.Image.Extent(ctx, r.start+off, n)
	if err != nil {
		return e, err
	}
	if e.Start != r.start+off || e.Length <= 0 {
		return formats.Extent{}, fmt.Errorf("partition %s: the disk described bytes %d+%d when asked for %d", r.name, e.Start, e.Length, r.start+off)
	}
	e.Start = off
	e.Length = min(e.Length, n)
	return e, nil
}

// AllocatedSize is unknown: the disk's host allocation is not the
// partition's (st_blocks then says the size).
func (r *Range) AllocatedSize(context.Context) (int64, error) { return -1, nil }

// Backing is nil: the disk's backing image answers at the disk's offsets,
// not the partition's, so a range offers none rather than a wrong one.
func (r *Range) Backing() formats.Image { return nil }

func (r *Range) TryReadAt(p []byte, off int64) bool {
	if r.check("read", off, int64(len(p))) != nil {
		return false // ReadAt says why
	}
	return r.Image.TryReadAt(p, r.start+off)
}

// TryLendAt lends the disk's bytes of the partition (formats.PageLender).
func (r *Range) TryLendAt(off, n int64, v [][]byte) ([][]byte, bool) {
	if r.check("read", off, n) != nil {
		return v, false
	}
	return r.Filter.TryLendAt(r.start+off, n, v)
}

// LendAt lends the disk's bytes of the partition (formats.CacheLender).
func (r *Range) LendAt(ctx context.Context, off, n int64, max int) ([][]byte, func(), bool, error) {
	if r.check("read", off, n) != nil {
		return nil, nil, false, nil // ReadAt says why
	}
	return r.Filter.LendAt(ctx, r.start+off, n, max)
}

func (r *Range) TryWriteAt(p []byte, off int64) (bool, error) {
	if err := r.check("write", off, int64(len(p))); err != nil {
		return true, err
	}
	return r.Image.TryWriteAt(p, r.start+off)
}

// Info is the disk's, sized as the partition.
func (r *Range) Info() formats.Info {
	i := r.Image.Info()
	i.VirtualSize = r.size
	i.ActualSize = -1
	return i
}

// Close releases nothing: the disk is the caller's.
func (r *Range) Close() error { return nil }

// FixedDisk is the disk served beside its partitions: its size is fixed,
// because the partitions are ranges read from its table at this size (a
// shrink would cut them, a growth strand a GPT's backup header). The
// rest, optional capabilities included, is the disk's (formats.Filter).
type FixedDisk struct{ formats.Filter }

// Resize is refused but for the size the disk has.
func (d FixedDisk) Resize(_ context.Context, size int64) error {
	if size == d.Size() {
		return nil
	}
	return fmt.Errorf("the disk's size is fixed while its partitions are served (--partitions): %w", formats.ErrNotSupported)
}
