package qcow2

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
)

// Persistent dirty bitmaps as an export reads them (qemu-nbd -B NAME,
// the NBD meta context qemu:dirty-bitmap:NAME).

// ErrBitmapNotFound: the image has no persistent bitmap of that name.
var ErrBitmapNotFound = errors.New("bitmap not found")

// ErrBitmapInconsistent: the bitmap is marked in use by no one (a crash,
// or a writer that did not store it): it may have missed writes.
var ErrBitmapInconsistent = errors.New("bitmap is inconsistent")

// bitmapError words a refusal as qemu-nbd does, and is its sentinel.
type bitmapError struct {
	msg  string
	kind error
}

func (e bitmapError) Error() string { return e.msg }
func (e bitmapError) Unwrap() error { return e.kind }

// DirtyBitmap is one persistent bitmap, read for an export. Of a bitmap
// this open keeps enabled (a writable image), it is the live copy: the
// export's own writes show in it, as in qemu-nbd -B on a writable export.
type DirtyBitmap struct {
	bits *liveBitmap
	size int64
}

// DirtyBitmap finds the bitmap name, refusing a missing one and one in
// use (inconsistent) with qemu-nbd's words.
func (q *Image) DirtyBitmap(ctx context.Context, name string) (*DirtyBitmap, error) {
	if q.w != nil && q.w.bitmaps != nil {
		s := q.w.bitmaps
		for i := range s.entries {
			if s.entries[i].name != name {
				continue
			}
			for _, l := range s.live {
				if l.entry == i {
					return &DirtyBitmap{bits: l, size: q.Size()}, nil
				}
			}
			return q.storedBitmap(ctx, i, &s.entries[i], s.tables[i])
		}
		return nil, bitmapError{fmt.Sprintf("Bitmap '%s' is not found", name), ErrBitmapNotFound}
	}
	if !q.h.hasBitmaps {
		return nil, bitmapError{fmt.Sprintf("Bitmap '%s' is not found", name), ErrBitmapNotFound}
	}
	_, entries, err := q.readBitmapDirectory(ctx)
	if err != nil {
		return nil, err
	}
	for i := range entries {
		if entries[i].name != name {
			continue
		}
		q.meta.RLock()
		fileSize := q.fileSize
		q.meta.RUnlock()
		t, err := q.readBitmapTable(ctx, &entries[i], fileSize)
		if err != nil {
			return nil, err
		}
		return q.storedBitmap(ctx, i, &entries[i], t)
	}
	return nil, bitmapError{fmt.Sprintf("Bitmap '%s' is not found", name), ErrBitmapNotFound}
}

// storedBitmap reads the bitmap b as stored, refusing it in use.
func (q *Image) storedBitmap(ctx context.Context, i int, b *bitmapEntry, table []uint64) (*DirtyBitmap, error) {
	if b.flags&bmFlagInUse != 0 {
		return nil, bitmapError{fmt.Sprintf("Bitmap '%s' is inconsistent and cannot be used", b.name), ErrBitmapInconsistent}
	}
	if need := (bitmapBits(q.Size(), b.granBits) + 63) / 64 * 8; need > maxLiveBitmapBytes {
		return nil, fmt.Errorf("%w: bitmap %q would take %d bytes of memory (at most %d)", ErrUnsupported, b.name, need, maxLiveBitmapBytes)
	}
	l, err := q.loadBitmap(ctx, i, b, table)
	if err != nil {
		return nil, err
	}
	return &DirtyBitmap{bits: l, size: q.Size()}, nil
}

// Granularity is the bytes one bit covers.
func (d *DirtyBitmap) Granularity() int64 { return int64(1) << d.bits.granBits }

// Extent is the run that starts at off, cut at off+n and at the disk's
// end, of blocks all dirty or all clean. off must be below the size.
func (d *DirtyBitmap) Extent(off, n int64) (length int64, dirty bool) {
	end := min(off+n, d.size)
	if off >= end {
		return 0, false
	}
	g := d.bits.granBits
	b := uint64(off) >> g
	last := uint64(end-1) >> g // the last block the run may reach
	dirty = d.bit(b)
	// Scan word by word for the first block that differs.
	for b <= last {
		w := d.bits.words[b/64].Load()
		if !dirty {
			w = ^w
		}
		w >>= b % 64 // ones: blocks like the first
		if w == ^uint64(0)>>(b%64) {
			b += 64 - b%64
			continue
		}
		b += uint64(bits.TrailingZeros64(^w))
		break
	}
	stop := min(int64(b)<<g, end)
	if b > last {
		stop = end
	}
	return stop - off, dirty
}

func (d *DirtyBitmap) bit(b uint64) bool {
	return d.bits.words[b/64].Load()>>(b%64)&1 != 0
}
