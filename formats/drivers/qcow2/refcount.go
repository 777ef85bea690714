package qcow2

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/aio"
)

// Refcounts: entries (getRefcount, setRefcount), blocks (refcountBlock
// loads a clean one into the cache; refBlock finds the one covering a
// cluster, changed ones pinned first), and the table. A writable image
// keeps them (getRef, setRef, pinBlock; alloc.go allocates and frees with
// them). Read-only images ask them one question, the one QEMU asks on the
// first block status: was the image preallocated with metadata (clusters
// referenced but never written, so the host file has holes there)? Then,
// and only then, block status asks the host file which data clusters read
// as zeroes, as qemu-img map does.

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

// refcountBlock returns the refcount block at off as the file has it,
// through the cache of clean blocks.
func (q *Image) refcountBlock(ctx context.Context, off int64) ([]byte, error) {
	if off%q.h.clusterSize != 0 || off+q.h.clusterSize > q.fileSize {
		return nil, fmt.Errorf("%w: refcount block at %#x is misaligned or beyond the end of the file", ErrCorrupt, off)
	}
	if b, ok := q.rcache.Get(off); ok {
		return b, nil
	}
	b := make([]byte, q.h.clusterSize)
	if _, err := q.f.ReadAt(ctx, b, off); err != nil && err != io.EOF {
		return nil, fmt.Errorf("qcow2: refcount block at %#x: %w", off, err)
	}
	q.rcache.Put(off, b)
	return b, nil
}

// refcountTable reads the refcount table, whose place and size
// parseHeader checked.
func (q *Image) refcountTable(ctx context.Context) ([]uint64, error) {
	n := int64(q.h.refcountClusters) * q.h.clusterSize
	off := int64(q.h.refcountOffset)
	if n == 0 {
		return nil, nil
	}
	raw := make([]byte, n)
	if _, err := q.f.ReadAt(ctx, raw, off); err != nil && err != io.EOF {
		return nil, fmt.Errorf("qcow2: refcount table at %#x: %w", off, err)
	}
	return decodeTable(raw), nil
}

// isPreallocated says whether the image was preallocated with metadata,
// finding out on the first call.
func (q *Image) isPreallocated(ctx context.Context) bool {
	q.preallocOnce.Do(func() {
		v, err := q.detectMetadataPreallocation(ctx)
		if err != nil {
			q.logWarn("metadata preallocation check failed; data clusters are reported as data", err)
		}
		q.preallocated = v
	})
	return q.preallocated
}

// detectMetadataPreallocation is QEMU's heuristic: more referenced clusters
// than the file really allocates (by a ninth, or two clusters) means
// preallocated metadata. It walks the refcount table, not the file: absent
// and all-zero refcount blocks are skipped whole, so a huge sparse file
// costs no more than its table (bounded at 8 MiB), and the count stops at
// the threshold.
func (q *Image) detectMetadataPreallocation(ctx context.Context) (bool, error) {
	if !aio.HasFd(q.f) {
		return false, nil // a remote object: nothing to compare with
	}
	var st unix.Stat_t
	if err := unix.Fstat(q.f.Fd(), &st); err != nil {
		return false, fmt.Errorf("qcow2: stat: %w", err)
	}
	cs := q.h.clusterSize
	real := st.Blocks * 512 / cs
	threshold := max(real*10/9, real+2)
	var rt []uint64
	if q.w != nil {
		// A writable image's refcounts live in its write state.
		q.w.alloc.Lock()
		defer q.w.alloc.Unlock()
		rt = q.w.rtable
	} else {
		var err error
		if rt, err = q.refcountTable(ctx); err != nil {
			return false, err
		}
	}
	q.meta.RLock()
	end := (q.fileSize + cs - 1) / cs
	q.meta.RUnlock()
	bits := int64(1) << q.h.refcountOrder
	perBlock := cs * 8 / bits
	zero := make([]byte, cs)
	count := int64(0)
	for i, e := range rt {
		first := int64(i) * perBlock
		if first >= end {
			break
		}
		boff := int64(e &^ uint64(cs-1))
		if boff == 0 {
			continue
		}
		b, err := q.blockAt(ctx, boff)
		if err != nil {
			return false, err
		}
		if bytes.Equal(b, zero) {
			continue
		}
		for j := range min(perBlock, end-first) {
			if getRefcount(b, j, bits) != 0 {
				if count++; count >= threshold {
					return true, nil
				}
			}
		}
	}
	return false, nil
}

// refBlock returns the refcount block covering host cluster c (a changed
// one, else clean from the cache or the file), or nil when none exists.
// The caller holds alloc.
func (q *Image) refBlock(ctx context.Context, c int64) ([]byte, int64, error) {
	w := q.w
	i := c / w.perBlock
	if i >= int64(len(w.rtable)) {
		return nil, 0, nil
	}
	off := int64(w.rtable[i] &^ uint64(q.h.clusterSize-1))
	if off == 0 {
		return nil, 0, nil
	}
	b, err := q.blockAt(ctx, off)
	return b, off, err
}

// blockAt returns the refcount block at off: a changed one of a writable
// image (the caller then holds alloc), else clean from the cache or the
// file.
func (q *Image) blockAt(ctx context.Context, off int64) ([]byte, error) {
	if q.w != nil {
		if p, ok := q.w.rbpin[off]; ok {
			return p.b, nil
		}
	}
	return q.refcountBlock(ctx, off)
}

// getRef returns the refcount of host cluster c. The caller holds alloc.
func (q *Image) getRef(ctx context.Context, c int64) (uint64, error) {
	b, _, err := q.refBlock(ctx, c)
	if err != nil || b == nil {
		return 0, err
	}
	return getRefcount(b, c%q.w.perBlock, q.w.bits), nil
}

// setRef sets the refcount of host cluster c, whose block must exist. The
// caller holds alloc.
func (q *Image) setRef(ctx context.Context, c int64, v uint64) error {
	w := q.w
	b, off, err := q.refBlock(ctx, c)
	if err != nil {
		return err
	}
	if b == nil {
		return fmt.Errorf("qcow2: refcount of cluster %d: no refcount block (allocator bug)", c)
	}
	if v > w.maxRef {
		return fmt.Errorf("%w: refcount of cluster %#x overflows %d bits", ErrCorrupt, c*q.h.clusterSize, w.bits)
	}
	if err := q.pinBlock(ctx, off, b); err != nil {
		return err
	}
	setRefcount(b, c%w.perBlock, w.bits, v)
	return nil
}

// pinBlock marks refcount block b at off changed, keeping it out of the
// LRU until it is written. A block pinned for the first time is checked
// against the other metadata: its write-back must not land on them. The
// caller holds alloc.
func (q *Image) pinBlock(ctx context.Context, off int64, b []byte) error {
	w := q.w
	p, ok := w.rbpin[off]
	if !ok {
		if err := q.checkWrite(ctx, off, q.h.clusterSize, metaRefBlock, "refcount block update"); err != nil {
			return err
		}
		p = &pinnedBlock{b: b}
		w.rbpin[off] = p
	}
	if !p.dirty {
		p.dirty = true
		w.dirtyRB.Add(1)
	}
	return nil
}
