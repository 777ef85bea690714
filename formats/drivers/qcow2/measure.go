package qcow2

import (
	"context"
	"errors"
)

// The size arithmetic of `qemu-img measure -O qcow2` (qcow2_measure in
// QEMU 7.2), so that a target sized from our answer fits what qemu-img
// convert writes, and a script comparing the two sees the same numbers.

// MeasureTarget is the qcow2 image to be created.
type MeasureTarget struct {
	ClusterSize  int64
	RefcountBits int64
	ExtendedL2   bool
}

// ErrMeasureTooLarge is qemu's "the image size is too large" refusal: the
// L1 table would pass QEMU's limit.
var ErrMeasureTooLarge = errors.New("The image size is too large (try using a larger cluster size)")

// CheckMeasureSize refuses a virtual size whose L1 table would pass
// QEMU's limit, as qcow2_measure does before it looks at the source.
func (t MeasureTarget) CheckMeasureSize(virtual int64) error {
	cs := t.ClusterSize
	l2e := t.l2EntrySize()
	v := measureRoundUp(virtual, cs)
	clusters := uint64(v) / uint64(cs)
	per := uint64(cs / l2e)
	l2Tables := (clusters + per - 1) / per
	if l2Tables*8 > maxL1Bytes {
		return ErrMeasureTooLarge
	}
	return nil
}

func (t MeasureTarget) l2EntrySize() int64 {
	if t.ExtendedL2 {
		return 16
	}
	return 8
}

// FullyAllocated is the file size of a fully preallocated image of virtual
// bytes (qcow2_calc_prealloc_size): header, L1, L2, refcount metadata and
// every data cluster.
func (t MeasureTarget) FullyAllocated(virtual int64) int64 {
	cs := t.ClusterSize
	l2e := t.l2EntrySize()
	aligned := measureRoundUp(virtual, cs)
	meta := cs // the header
	nl2e := measureRoundUp(aligned/cs, cs/l2e)
	meta += nl2e * l2e
	nl1e := measureRoundUp(nl2e*l2e/cs, cs/8)
	meta += nl1e * 8
	meta += refcountMetadataSize((meta+aligned)/cs, cs, t.RefcountBits)
	return meta + aligned
}

// refcountMetadataSize is the refcount table and blocks that count
// clusters host clusters and themselves: the fixed point QEMU's
// qcow2_refcount_metadata_size finds.
func refcountMetadataSize(clusters, cs, refcountBits int64) int64 {
	perTable := cs / 8
	perBlock := cs * 8 / refcountBits
	var table, blocks, n, last int64
	for {
		last = n
		blocks = measureCeilDiv(clusters+table+blocks, perBlock)
		table = measureCeilDiv(blocks, perTable)
		n = clusters + blocks + table
		if n == last {
			break
		}
	}
	return (blocks + table) * cs
}

// BitmapsSize is the space the persistent bitmaps of src take in a qcow2
// target of cluster size cs, every bitmap counted as fully allocated (as
// qcow2_get_persistent_dirty_bitmap_size).
func BitmapsSize(bitmaps []BitmapInfo, virtual, cs int64) int64 {
	var size, dir int64
	for _, b := range bitmaps {
		bits := measureCeilDiv(virtual, b.Granularity)
		clusters := measureCeilDiv(measureCeilDiv(bits, 8), cs)
		size += clusters * cs
		size += measureRoundUp(clusters*8, cs)
		dir += measureRoundUp(24+int64(len(b.Name)), 8)
	}
	return size + measureRoundUp(dir, cs)
}

// PersistentBitmaps lists the image's persistent dirty bitmaps; ok is
// false for an image that cannot hold any (qcow2 v2), as QEMU's
// bdrv_supports_persistent_dirty_bitmap says.
func (q *Image) PersistentBitmaps(ctx context.Context) (bitmaps []BitmapInfo, ok bool, err error) {
	if q.h.version < 3 {
		return nil, false, nil
	}
	b, err := q.bitmapInfo(ctx)
	return b, true, err
}

func measureCeilDiv(a, b int64) int64 { return (a + b - 1) / b }

func measureRoundUp(a, b int64) int64 { return measureCeilDiv(a, b) * b }
