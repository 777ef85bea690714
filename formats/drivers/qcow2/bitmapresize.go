package qcow2

import (
	"context"
	"encoding/binary"
	"fmt"
	"sync/atomic"

	"github.com/blockexport/blockexport/formats"
)

// Resizing an image that has persistent dirty bitmaps, as QEMU 7.2 does
// (qcow2_truncate_bitmaps_check, bdrv_dirty_bitmap_truncate): every bitmap
// must be in memory and consistent; each then takes the new size, its
// bits past a new, smaller end dropped and a grown part clean (a resize is
// no guest write), and is stored at the new size at close.
//
// A bitmap table must fit the image's size exactly for QEMU to load a
// bitmap that is not in use, and the size and the bitmap directory cannot
// change in one write. So before the size changes, every bitmap is marked
// in use on disk (the enabled ones are already, since the open): a crash
// between the resize and the close leaves them in use, inconsistent,
// which every tool refuses to trust, never a directory QEMU cannot open.
// The clean close stores them all, the in-use flags cleared.

// BitmapInconsistentError is QEMU's refusal to resize an image with a bitmap
// that was in use at open (it missed writes, so it cannot be resized).
type BitmapInconsistentError struct{ Name string }

func (e *BitmapInconsistentError) Error() string {
	return fmt.Sprintf("Bitmap '%s' is inconsistent and cannot be used\nTry block-dirty-bitmap-remove to delete this bitmap from disk", e.Name)
}

// bitmapsResizable says whether the bitmaps allow a resize: the first
// bitmap, in directory order, in use at open refuses it, as in QEMU.
func (q *Image) bitmapsResizable() error {
	if q.w == nil || q.w.bitmaps == nil {
		return nil
	}
	s := q.w.bitmaps
	if q.editBitmaps {
		// The edit holds no bitmap in memory; it never resizes.
		return fmt.Errorf("qcow2: resize an image opened to edit its bitmaps: %w", formats.ErrNotSupported)
	}
	loaded := make(map[int]bool, len(s.live))
	for _, b := range s.live {
		loaded[b.entry] = true
	}
	for i, e := range s.entries {
		if e.flags&bmFlagInUse != 0 && !loaded[i] {
			return &BitmapInconsistentError{Name: e.name}
		}
	}
	return nil
}

// BitmapsLostError says that a resize left every bitmap in use, as QEMU
// 7.2 does when one no longer fits QEMU's limits at the new size: its
// store at close refuses them all, and the resize itself succeeds.
type BitmapsLostError struct{ Name string }

func (e *BitmapsLostError) Error() string {
	return fmt.Sprintf("Bitmap '%s' doesn't satisfy the constraints: Too much space will be occupied by the bitmap. Use larger granularity", e.Name)
}

// BitmapsLost is the bitmaps a resize gave up, left in use (nil: none).
func (q *Image) BitmapsLost() error {
	if q.w == nil || q.w.bitmaps == nil || q.w.bitmaps.lost == nil {
		return nil
	}
	return q.w.bitmaps.lost
}

// tooLargeAt names the bitmap QEMU finds first (it walks them last to
// first) that its limits refuse at size bytes, or "".
func (s *bitmapSet) tooLargeAt(size, cs int64) string {
	for i := len(s.entries) - 1; i >= 0; i-- {
		n := bitmapBytes(size, s.entries[i].granBits)
		if n > bmMaxPhysBytes || n > uint64(bmMaxTableEntries)*uint64(cs) {
			return s.entries[i].name
		}
	}
	return ""
}

// holdAllBitmaps loads the bitmaps that are not in memory yet (the
// disabled ones; a writer leaves them on disk until a resize) and marks
// them in use in the directory, durably, so that the resize may change
// every bitmap's size. The enabled ones are in memory and in use since
// the open. size is the size to come: the memory bound holds for it.
func (q *Image) holdAllBitmaps(ctx context.Context, size int64) error {
	s := q.w.bitmaps
	loaded := make(map[int]bool, len(s.live))
	memory := uint64(0)
	for _, b := range s.live {
		loaded[b.entry] = true
	}
	lost := s.tooLargeAt(size, q.h.clusterSize)
	for _, e := range s.entries {
		memory += (bitmapBits(max(size, q.Size()), e.granBits) + 63) / 64 * 8
	}
	if memory > maxLiveBitmapBytes && lost == "" {
		return fmt.Errorf("qcow2: resize: %w: the dirty bitmaps would take %d bytes of memory (at most %d)", ErrUnsupported, memory, maxLiveBitmapBytes)
	}
	var held []*liveBitmap
	var marks []int // entries to mark in use
	for i := range s.entries {
		if loaded[i] {
			continue
		}
		marks = append(marks, i)
		if lost != "" {
			continue // never stored again: no need of its bits
		}
		b, err := q.loadBitmap(ctx, i, &s.entries[i], s.tables[i])
		if err != nil {
			return err
		}
		b.disabled = true
		held = append(held, b)
	}
	if len(marks) > 0 {
		if err := q.markBitmapsInUse(ctx, marks); err != nil {
			return err
		}
	}
	// Under users: writers read live as they mark.
	q.w.users.Lock()
	if lost != "" {
		// QEMU's store at close refuses every bitmap when one is too
		// large: all stay in use, and the resize goes on.
		s.live, s.lost = nil, &BitmapsLostError{Name: lost}
	} else {
		// Only now: storeBitmaps stores every bitmap of live, and may do
		// so only for one marked in use on disk.
		s.live = append(s.live, held...)
	}
	q.w.users.Unlock()
	return nil
}

// markBitmapsInUse sets the in-use flag of the entries marks in the
// directory, in place, durably.
func (q *Image) markBitmapsInUse(ctx context.Context, marks []int) error {
	s := q.w.bitmaps
	dir, _, err := q.readBitmapDirectory(ctx)
	if err != nil {
		return err
	}
	for _, i := range marks {
		e := &s.entries[i]
		e.flags |= bmFlagInUse
		binary.BigEndian.PutUint32(dir[e.pos+12:], e.flags)
	}
	if _, err := q.f.WriteAt(ctx, dir, s.dirOff); err != nil {
		return fmt.Errorf("qcow2: mark bitmaps in use in the directory at %#x: %w", s.dirOff, err)
	}
	if err := q.f.Fdatasync(ctx); err != nil {
		return fmt.Errorf("qcow2: mark bitmaps in use: %w", err)
	}
	return nil
}

// resizeBitmaps gives every bitmap in memory the bits of size bytes: the
// ones past a smaller end dropped, a grown part clean. No write marks a
// bitmap meanwhile (they mark under users).
func (q *Image) resizeBitmaps(size int64) {
	s := q.w.bitmaps
	if s == nil {
		return
	}
	q.w.users.Lock()
	defer q.w.users.Unlock()
	for _, b := range s.live {
		b.resize(size)
	}
}

// resize is resizeBitmaps for one bitmap; the caller keeps markers out.
func (b *liveBitmap) resize(size int64) {
	nbits := bitmapBits(size, b.granBits)
	words := make([]atomic.Uint64, (nbits+63)/64)
	for i := range min(len(words), len(b.words)) {
		words[i].Store(b.words[i].Load())
	}
	if r := nbits % 64; r != 0 {
		last := &words[len(words)-1]
		last.Store(last.Load() & (1<<r - 1)) // no bits past the new end
	}
	b.words, b.nbits = words, nbits
}
