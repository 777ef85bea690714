package qcow2

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
)

// L1/L2 translation: virtual cluster -> what the cluster is and where.

const (
	l1OffsetMask = 0x00fffffffffffe00
	l2OffsetMask = 0x00fffffffffffe00
	l2Compressed = 1 << 62
	l2ZeroFlag   = 1 << 0
	// oflagCopied (L1 and L2 entries): the cluster's refcount is exactly
	// one, so it may be written in place. qemu-img check insists on it.
	oflagCopied = 1 << 63
)

type kind uint8

const (
	unallocated kind = iota // not in this layer: backing file, or zeroes
	zero                    // v3 zero cluster (host may be preallocated)
	data                    // stored at host
	compressed              // compressed data at host, compSize bytes
)

type mapping struct {
	kind     kind
	host     int64 // cluster start for data/zero; byte offset for compressed
	compSize int64
	entry    uint64 // the L2 entry as stored
}

// cachedL2 returns the L2 table at host offset off if it is in memory:
// pinned (changed, or being written back) or in the LRU. The caller holds
// q.meta (shared is enough).
func (q *Image) cachedL2(off int64) ([]uint64, bool) {
	if q.w != nil {
		if p, ok := q.w.l2pin[off]; ok {
			return p.t, true
		}
	}
	return q.l2cache.get(off)
}

// loadL2 reads and decodes the L2 table at host offset off from the file.
// It does not cache it.
func (q *Image) loadL2(ctx context.Context, off, fileSize int64) ([]uint64, error) {
	if off%q.h.clusterSize != 0 || off < q.h.clusterSize || off+q.h.clusterSize > fileSize {
		return nil, fmt.Errorf("%w: L2 table at %#x is misaligned or beyond the end of the file", ErrCorrupt, off)
	}
	buf := make([]byte, q.h.clusterSize)
	if _, err := q.f.ReadAt(ctx, buf, off); err != nil && err != io.EOF {
		return nil, fmt.Errorf("qcow2: L2 table at %#x: %w", off, err)
	}
	t := make([]uint64, q.h.l2Entries)
	for i := range t {
		t[i] = binary.BigEndian.Uint64(buf[i*8:])
	}
	return t, nil
}

// l2Span is the number of clusters one L2 table maps.
func (q *Image) l2Span() int64 { return q.h.l2Entries }

// lookup maps virtual cluster vc. When the whole L2 table is absent it says
// so (tableAbsent), so that scans can skip the table's span at once.
func (q *Image) lookup(ctx context.Context, vc int64) (m mapping, tableAbsent bool, err error) {
	l1i := vc / q.h.l2Entries
	q.meta.RLock()
	if l1i >= int64(len(q.l1)) {
		q.meta.RUnlock()
		return mapping{}, false, fmt.Errorf("%w: cluster %d beyond the L1 table", ErrCorrupt, vc)
	}
	l2off := int64(q.l1[l1i] & l1OffsetMask)
	fileSize := q.fileSize
	if l2off == 0 {
		q.meta.RUnlock()
		return mapping{kind: unallocated}, true, nil
	}
	t, ok := q.cachedL2(l2off)
	if ok {
		e := t[vc%q.h.l2Entries]
		q.meta.RUnlock()
		m, err := q.decode(vc, e, fileSize)
		return m, false, err
	}
	// The generation tells whether a table was written back while we
	// read: then what we read may be older than the write-back, and must
	// not be cached.
	gen := q.l2cache.gen()
	q.meta.RUnlock()
	t, err = q.loadL2(ctx, l2off, fileSize)
	if err != nil {
		return mapping{}, false, err
	}
	e := t[vc%q.h.l2Entries]
	q.l2cache.putIfGen(l2off, t, gen)
	m, err = q.decode(vc, e, fileSize)
	return m, false, err
}

// compressedEntry splits a compressed cluster's L2 entry into the byte
// offset of its data and the number of 512-byte sectors it spans.
func (q *Image) compressedEntry(e uint64) (host, sectors int64) {
	x := 62 - (q.h.clusterBits - 8)
	return int64(e & (1<<x - 1)), int64((e>>x)&(1<<(62-x)-1)) + 1
}

// decode interprets L2 entry e of virtual cluster vc.
func (q *Image) decode(vc int64, e uint64, fileSize int64) (mapping, error) {
	if e&l2Compressed != 0 {
		host, sectors := q.compressedEntry(e)
		size := sectors*512 - host%512
		if host <= 0 || host >= fileSize {
			return mapping{}, fmt.Errorf("%w: compressed cluster %d at %#x beyond the end of the file", ErrCorrupt, vc, host)
		}
		size = min(size, 2*q.h.clusterSize, fileSize-host)
		return mapping{kind: compressed, host: host, compSize: size, entry: e}, nil
	}
	host := int64(e & l2OffsetMask)
	if q.h.version >= 3 && e&l2ZeroFlag != 0 {
		return mapping{kind: zero, host: host, entry: e}, nil
	}
	if host == 0 {
		return mapping{kind: unallocated, entry: e}, nil
	}
	if host%q.h.clusterSize != 0 || host >= fileSize {
		return mapping{}, fmt.Errorf("%w: data cluster %d at %#x is misaligned or beyond the end of the file", ErrCorrupt, vc, host)
	}
	return mapping{kind: data, host: host, entry: e}, nil
}
