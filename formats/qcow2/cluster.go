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
}

// l2Table returns the decoded L2 table at host offset off, from the cache
// or the file.
func (q *Image) l2Table(ctx context.Context, off int64) ([]uint64, error) {
	if t, ok := q.l2cache.get(off); ok {
		return t, nil
	}
	if off%q.h.clusterSize != 0 || off < q.h.clusterSize || off+q.h.clusterSize > q.fileSize {
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
	q.l2cache.put(off, t)
	return t, nil
}

// l2Span is the number of clusters one L2 table maps.
func (q *Image) l2Span() int64 { return q.h.l2Entries }

// lookup maps virtual cluster vc. When the whole L2 table is absent it says
// so (tableAbsent), so that scans can skip the table's span at once.
func (q *Image) lookup(ctx context.Context, vc int64) (m mapping, tableAbsent bool, err error) {
	l1i := vc / q.h.l2Entries
	if l1i >= int64(len(q.l1)) {
		return mapping{}, false, fmt.Errorf("%w: cluster %d beyond the L1 table", ErrCorrupt, vc)
	}
	l2off := int64(q.l1[l1i] & l1OffsetMask)
	if l2off == 0 {
		return mapping{kind: unallocated}, true, nil
	}
	t, err := q.l2Table(ctx, l2off)
	if err != nil {
		return mapping{}, false, err
	}
	e := t[vc%q.h.l2Entries]
	if e&l2Compressed != 0 {
		x := 62 - (q.h.clusterBits - 8)
		host := int64(e & (1<<x - 1))
		sectors := int64((e>>x)&(1<<(62-x)-1)) + 1
		size := sectors*512 - host%512
		if host <= 0 || host >= q.fileSize {
			return mapping{}, false, fmt.Errorf("%w: compressed cluster %d at %#x beyond the end of the file", ErrCorrupt, vc, host)
		}
		size = min(size, 2*q.h.clusterSize, q.fileSize-host)
		return mapping{kind: compressed, host: host, compSize: size}, false, nil
	}
	host := int64(e & l2OffsetMask)
	if q.h.version >= 3 && e&l2ZeroFlag != 0 {
		return mapping{kind: zero, host: host}, false, nil
	}
	if host == 0 {
		return mapping{kind: unallocated}, false, nil
	}
	if host%q.h.clusterSize != 0 || host >= q.fileSize {
		return mapping{}, false, fmt.Errorf("%w: data cluster %d at %#x is misaligned or beyond the end of the file", ErrCorrupt, vc, host)
	}
	return mapping{kind: data, host: host}, false, nil
}
