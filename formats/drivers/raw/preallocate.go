package raw

import (
	"context"
	"fmt"

	"github.com/blockexport/blockexport/formats"
)

// GrowPreallocated grows the image to size with the new part allocated on
// the host, as QEMU's file driver does for `qemu-img resize
// --preallocation`: falloc reserves it with fallocate(2) (which also
// extends the file), full writes zeroes over it. The new size is durable
// on return.
func (r *Image) GrowPreallocated(ctx context.Context, size int64, full bool) error {
	defer r.wrote()
	if !r.writable {
		return formats.ErrReadOnly
	}
	old := r.size.Load()
	if size <= old {
		return fmt.Errorf("raw: preallocate from %d to %d: %w", old, size, formats.ErrOutOfRange)
	}
	if !full {
		if r.blockDev {
			return fmt.Errorf("raw: resize a block device: %w", formats.ErrNotSupported)
		}
		if err := r.f.Fallocate(ctx, 0, old, size-old); err != nil {
			return fmt.Errorf("raw: preallocate [%d, %d): %w", old, size, err)
		}
		r.size.Store(size)
		return r.Flush(ctx)
	}
	if err := r.Resize(ctx, size); err != nil {
		return err
	}
	zero := make([]byte, min(size-old, 1<<20))
	for off := old; off < size; off += int64(len(zero)) {
		n := min(int64(len(zero)), size-off)
		if _, err := r.f.WriteAt(ctx, zero[:n], off); err != nil {
			return fmt.Errorf("raw: preallocate at %d: %w", off, err)
		}
	}
	return r.Flush(ctx)
}
