package main

import (
	"context"
	"slices"

	"github.com/blockexport/blockexport/export/engine"
	"github.com/blockexport/blockexport/export/nbd"
	"github.com/blockexport/blockexport/formats"
)

// nbdMetaContexts are the meta contexts qemu-nbd's -A and -B offer:
// qemu:allocation-depth, then qemu:dirty-bitmap:NAME for each bitmap, in
// the order given. A bitmap the image lacks, or one in use, is refused in
// qemu-nbd's words.
func nbdMetaContexts(ctx context.Context, img formats.Image, depth bool, bitmaps []string) ([]nbd.MetaContext, error) {
	var metas []nbd.MetaContext
	if depth {
		metas = append(metas, nbd.MetaContext{Name: "qemu:allocation-depth", Extent: allocationDepth(img)})
	}
	// qemu-nbd offers the bitmaps in the reverse of their order on its
	// command line (it prepends each -B to its list).
	reversed := slices.Clone(bitmaps)
	slices.Reverse(reversed)
	bms, err := engine.DirtyBitmapContexts(ctx, img, reversed)
	if err != nil {
		return nil, err
	}
	metas = append(metas, bms...)
	return metas, nil
}

// allocationDepth answers qemu:allocation-depth as qemu-nbd -A: 0 where no
// layer of the chain allocates the bytes, 1 where the image itself does,
// 2 its backing file, and so on.
func allocationDepth(img formats.Image) func(ctx context.Context, off, n int64) (int64, uint32, error) {
	return func(ctx context.Context, off, n int64) (int64, uint32, error) {
		e, err := img.Extent(ctx, off, n)
		if err != nil {
			return 0, 0, err
		}
		if e.Present {
			return e.Length, uint32(e.Depth) + 1, nil
		}
		// Unallocated in the whole chain reads 0, unless the walk stopped
		// at a layer whose backing file ends before off: QEMU counts the
		// zeroes past a short backing file's end as that file's.
		if b := backingAt(img, e.Depth); b != nil && off >= b.Size() {
			return e.Length, uint32(e.Depth) + 2, nil
		}
		return e.Length, 0, nil
	}
}

// backingAt is the backing file of the layer depth levels below img, or
// nil.
func backingAt(img formats.Image, depth int) formats.Image {
	for i := 0; i <= depth && img != nil; i++ {
		l, ok := img.(formats.Layered)
		if !ok {
			return nil
		}
		img = l.Backing()
	}
	return img
}
