package qcow2

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
)

// Refcounts. Read-only images ask them one question, the one QEMU asks at
// open: was the image preallocated with metadata (clusters referenced but
// never written, so the host file has holes there)? Then, and only then,
// block status asks the host file which data clusters read as zeroes, as
// qemu-img map does. Writable images keep them: see alloc.go.

// refcount returns the refcount of host cluster c.
func (q *Image) refcount(ctx context.Context, rt []uint64, c int64) (uint64, error) {
	bits := int64(1) << q.h.refcountOrder
	perBlock := q.h.clusterSize * 8 / bits
	i := c / perBlock
	if i >= int64(len(rt)) {
		return 0, nil
	}
	boff := int64(rt[i] &^ uint64(q.h.clusterSize-1))
	if boff == 0 {
		return 0, nil
	}
	block, err := q.refcountBlock(ctx, boff)
	if err != nil {
		return 0, err
	}
	return getRefcount(block, c%perBlock, bits), nil
}

// getRefcount reads entry j of a refcount block of bits-wide entries.
func getRefcount(block []byte, j, bits int64) uint64 {
	switch bits {
	case 64:
		return binary.BigEndian.Uint64(block[j*8:])
	case 32:
		return uint64(binary.BigEndian.Uint32(block[j*4:]))
	case 16:
		return uint64(binary.BigEndian.Uint16(block[j*2:]))
	case 8:
		return uint64(block[j])
	}
	// 1, 2 or 4 bits: packed LSB first.
	bit := j * bits
	return uint64(block[bit/8]>>(bit%8)) & (1<<bits - 1)
}

// setRefcount stores v (which must fit) as entry j.
func setRefcount(block []byte, j, bits int64, v uint64) {
	switch bits {
	case 64:
		binary.BigEndian.PutUint64(block[j*8:], v)
	case 32:
		binary.BigEndian.PutUint32(block[j*4:], uint32(v))
	case 16:
		binary.BigEndian.PutUint16(block[j*2:], uint16(v))
	case 8:
		block[j] = uint8(v)
	default:
		bit := j * bits
		mask := byte(1<<bits-1) << (bit % 8)
		block[bit/8] = block[bit/8]&^mask | byte(v)<<(bit%8)&mask
	}
}

func (q *Image) refcountBlock(ctx context.Context, off int64) ([]byte, error) {
	if off%q.h.clusterSize != 0 || off+q.h.clusterSize > q.fileSize {
		return nil, fmt.Errorf("%w: refcount block at %#x is misaligned or beyond the end of the file", ErrCorrupt, off)
	}
	if b, ok := q.rcache.get(off); ok {
		return b, nil
	}
	b := make([]byte, q.h.clusterSize)
	if _, err := q.f.ReadAt(ctx, b, off); err != nil && err != io.EOF {
		return nil, fmt.Errorf("qcow2: refcount block at %#x: %w", off, err)
	}
	q.rcache.put(off, b)
	return b, nil
}

// refcountTable reads the refcount table.
func (q *Image) refcountTable(ctx context.Context) ([]uint64, error) {
	n := int64(q.h.refcountClusters) * q.h.clusterSize
	off := int64(q.h.refcountOffset)
	if n == 0 {
		return nil, nil
	}
	if off%q.h.clusterSize != 0 || off < 0 || n > q.fileSize || off > q.fileSize-n || n > maxL1Bytes*8 {
		return nil, fmt.Errorf("%w: refcount table at %#x (%d clusters) lies beyond the end of the file", ErrCorrupt, off, q.h.refcountClusters)
	}
	raw := make([]byte, n)
	if _, err := q.f.ReadAt(ctx, raw, off); err != nil && err != io.EOF {
		return nil, fmt.Errorf("qcow2: refcount table at %#x: %w", off, err)
	}
	rt := make([]uint64, n/8)
	for i := range rt {
		rt[i] = binary.BigEndian.Uint64(raw[i*8:])
	}
	return rt, nil
}

// detectMetadataPreallocation is QEMU's heuristic: more referenced clusters
// than the file really allocates (by a ninth, or two clusters) means
// preallocated metadata.
func (q *Image) detectMetadataPreallocation(ctx context.Context, allocated int64) (bool, error) {
	rt, err := q.refcountTable(ctx)
	if err != nil {
		return false, err
	}
	real := allocated / q.h.clusterSize
	threshold := max(real*10/9, real+2)
	end := (q.fileSize + q.h.clusterSize - 1) / q.h.clusterSize
	count := int64(0)
	for c := int64(0); c < end && count < threshold; c++ {
		rc, err := q.refcount(ctx, rt, c)
		if err != nil {
			return false, err
		}
		if rc != 0 {
			count++
		}
	}
	return count >= threshold, nil
}
