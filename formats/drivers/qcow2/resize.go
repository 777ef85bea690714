package qcow2

import (
	"context"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/formats"
)

// Resize changes the virtual size. Sizes are kept a multiple of 512 bytes
// (QEMU reads the size in sectors, so it would drop a partial one): a
// request for another size is rounded up. Growing extends the L1 table when
// it must; where a backing file is longer than the old size, the new part
// is zeroed so that it does not show the backing file through. Shrinking
// drops the clusters past the new end. The new size is durable on return.
func (q *Image) Resize(ctx context.Context, size int64) error {
	defer q.wrote()
	if err := q.checkWritable("resize"); err != nil {
		return err
	}
	if size < 0 {
		return fmt.Errorf("qcow2: resize to %d: %w", size, unix.EINVAL)
	}
	if err := q.bitmapsResizable(); err != nil {
		return err
	}
	size = (size + 511) &^ 511
	if size > maxVirtualSize {
		return fmt.Errorf("qcow2: resize to %d: %w", size, unix.EFBIG)
	}
	old := q.Size()
	if size == old {
		return nil
	}
	if q.w.bitmaps != nil {
		if err := q.holdAllBitmaps(ctx, size); err != nil {
			return err
		}
	}
	var err error
	if size > old {
		err = q.grow(ctx, old, size)
	} else {
		err = q.shrink(ctx, old, size)
	}
	if err != nil {
		return err
	}
	return q.Flush(ctx)
}

func (q *Image) grow(ctx context.Context, old, size int64) error {
	w := q.w
	w.alloc.Lock()
	err := q.ensureL1(ctx, size)
	if err == nil {
		q.end.Store(size)
	}
	w.alloc.Unlock()
	if err != nil {
		return err
	}
	if q.backing != nil && q.backing.Size() > old {
		// The new part must read as zeroes, not as the backing file, and
		// must before anyone sees the new size: a writer that found the
		// image long enough would otherwise have its data zeroed after
		// its write returned.
		w.users.RLock()
		err = q.zeroRange(ctx, old, min(size, q.backing.Size())-old, opZeroUnmap)
		w.users.RUnlock()
		if err != nil {
			q.end.Store(old) // what was zeroed lies past the end; a later grow zeroes it again
			return err
		}
	}
	// Nothing fails from here: the bitmaps take the new size with it.
	q.resizeBitmaps(size)
	w.alloc.Lock()
	q.size.Store(size)
	w.sizeDirty = true
	w.alloc.Unlock()
	return nil
}

func (q *Image) shrink(ctx context.Context, old, size int64) error {
	w := q.w
	cs := q.h.clusterSize
	w.users.RLock()
	// The kept part of the new last cluster loses nothing; the rest of it
	// must read as zeroes should the image grow again.
	err := q.zeroPartial(ctx, size, min(old, (size+cs-1)/cs*cs)-size)
	if err == nil {
		a, b := (size+cs-1)/cs, (old+cs-1)/cs
		if a < b {
			_, err = q.setClusters(ctx, a, b, old, opDiscardAll)
		}
	}
	w.users.RUnlock()
	if err != nil {
		return err
	}
	w.alloc.Lock()
	q.size.Store(size)
	q.end.Store(size)
	w.sizeDirty = true
	w.alloc.Unlock()
	// After the size: a write that passed the old size check marks bits
	// that go here with the data past the end.
	q.resizeBitmaps(size)
	return nil
}

// ensureL1 grows the L1 table to map size bytes. The new table goes to
// new clusters and is pointed at by the header at the next write-back; the
// old one is freed after that. The caller holds alloc.
func (q *Image) ensureL1(ctx context.Context, size int64) error {
	w := q.w
	cs := q.h.clusterSize
	perEntry := cs * q.h.l2Entries
	need := (size + perEntry - 1) / perEntry
	have := int64(len(q.l1))
	if need <= have {
		return nil
	}
	if need*8 > maxL1Bytes {
		return fmt.Errorf("qcow2: resize to %d: the L1 table would exceed %d bytes: %w", size, maxL1Bytes, unix.EFBIG)
	}
	// Grow by half again, as QEMU does, so that growing in small steps
	// does not move the table each time.
	n := max(have, 1)
	for n < need {
		n = (n*3 + 1) / 2
	}
	n = min(n, maxL1Bytes/8)
	host, err := q.allocClusters(ctx, (n*8+cs-1)/cs)
	if err != nil {
		return err
	}
	l1 := make([]uint64, n)
	copy(l1, q.l1)
	if have > 0 && w.l1Offset != 0 {
		q.freeRangeLater(w.l1Offset, have*8) // once the header points at l1
	}
	q.meta.Lock()
	q.l1 = l1
	w.metaMap.setRange(metaL1, host, n*8, cs)
	q.meta.Unlock()
	w.l1Offset = host
	w.l1Moved = true
	w.l1Lo, w.l1Hi = 0, int(n)
	return nil
}

var _ formats.Image = (*Image)(nil)

// Preallocate writes zeroes as data clusters over [off, off+n), as a
// resize with preallocation allocates the grown part. It is no guest
// write: the dirty bitmaps are not marked, as QEMU's preallocation inside
// qcow2_co_truncate marks none.
func (q *Image) Preallocate(ctx context.Context, off, n int64) error {
	defer q.wrote()
	if err := q.checkWritable("preallocate"); err != nil {
		return err
	}
	if off < 0 || n < 0 || off+n > q.Size() {
		return fmt.Errorf("qcow2: preallocate [%d, +%d): %w", off, n, formats.ErrOutOfRange)
	}
	zero := make([]byte, min(n, 1<<20))
	for pos := off; pos < off+n; pos += int64(len(zero)) {
		p := zero[:min(int64(len(zero)), off+n-pos)]
		q.w.users.RLock()
		err := q.write(ctx, p, pos)
		q.w.users.RUnlock()
		if err != nil {
			return fmt.Errorf("qcow2: preallocate at %d: %w", pos, err)
		}
		if err := q.boundWriteBack(ctx); err != nil {
			return err
		}
	}
	return nil
}
