package qcow2

import (
	"context"
	"fmt"
	"io"
	"slices"
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
	return q.l2cache.Get(off)
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
	return decodeTable(buf), nil
}

// l2Entry is the one step of every L1/L2 walk (reads, writes, block
// status): the L2 entry of virtual cluster vc as memory knows it. With no
// L2 table for vc (L1 entry zero) the entry is 0, unallocated, and
// tableAbsent says so; a table that exists but is not in memory comes back
// as l2off with cached false, for the caller to load or give up on. The
// caller holds q.meta (shared is enough).
func (q *Image) l2Entry(vc int64) (e uint64, l2off int64, cached, tableAbsent bool, err error) {
	l1i := vc / q.h.l2Entries
	if l1i >= int64(len(q.l1)) {
		return 0, 0, false, false, fmt.Errorf("%w: cluster %d beyond the L1 table", ErrCorrupt, vc)
	}
	l2off = int64(q.l1[l1i] & l1OffsetMask)
	if l2off == 0 {
		return 0, 0, true, true, nil
	}
	t, ok := q.cachedL2(l2off)
	if !ok {
		return 0, l2off, false, false, nil
	}
	return t[vc%q.h.l2Entries], l2off, true, false, nil
}

// lookup maps virtual cluster vc, reading its L2 table (into the cache)
// when it is not in memory. When the whole L2 table is absent it says so
// (tableAbsent), so that scans can skip the table's span at once.
func (q *Image) lookup(ctx context.Context, vc int64) (m mapping, tableAbsent bool, err error) {
	q.meta.RLock()
	e, l2off, cached, tableAbsent, err := q.l2Entry(vc)
	fileSize := q.fileSize
	if err != nil || cached {
		q.meta.RUnlock()
		if err != nil {
			return mapping{}, false, err
		}
		m, err := q.decode(vc, e, fileSize)
		return m, tableAbsent, err
	}
	// The generation tells whether a table was written back while we
	// read: then what we read may be older than the write-back, and must
	// not be cached.
	gen := q.l2cache.Gen()
	q.meta.RUnlock()
	t, err := q.loadL2(ctx, l2off, fileSize)
	if err != nil {
		return mapping{}, false, err
	}
	e = t[vc%q.h.l2Entries]
	q.l2cache.PutIfGen(l2off, t, gen)
	// The entry is decoded against the file's end as it is now, not as
	// it was before the read: a write may have allocated a cluster past
	// that end and written the table back meanwhile, and the table read
	// then holds an entry the older end calls corrupt (TestRaceAttack).
	// The end only grows, and a cluster is
	// allocated (the end moved past it) before any table names it.
	q.meta.RLock()
	fileSize = q.fileSize
	q.meta.RUnlock()
	m, err = q.decode(vc, e, fileSize)
	return m, false, err
}

// scanCachedL2 passes the mappings of virtual clusters vc, vc+1, ... to
// the end of vc's L2 table to take, while take accepts them, when that
// table is in memory (ok false, nothing passed, otherwise). It returns how
// many were taken, and stopped when take refused one. The table is read
// under one hold of q.meta, as a lookup reads one entry.
func (q *Image) scanCachedL2(vc int64, take func(mapping) bool) (taken int64, stopped, ok bool, err error) {
	q.meta.RLock()
	defer q.meta.RUnlock()
	l1i := vc / q.h.l2Entries
	if l1i >= int64(len(q.l1)) {
		return 0, false, false, nil // lookup reports it
	}
	l2off := int64(q.l1[l1i] & l1OffsetMask)
	if l2off == 0 {
		return 0, false, false, nil
	}
	t, ok := q.cachedL2(l2off)
	if !ok {
		return 0, false, false, nil
	}
	for i := vc % q.h.l2Entries; i < q.h.l2Entries; i++ {
		m, err := q.decode(vc+taken, t[i], q.fileSize)
		if err != nil {
			return taken, false, true, err
		}
		if !take(m) {
			return taken, true, true, nil
		}
		taken++
	}
	return taken, false, true, nil
}

// tryLookup is lookup for callers that must not wait: ok false when the L2
// table is not in memory, q.meta is held by a writer, or the entry is
// corrupt (the caller's slow path then reports it).
func (q *Image) tryLookup(vc int64) (m mapping, ok bool) {
	if !q.meta.TryRLock() {
		return mapping{}, false
	}
	e, _, cached, _, err := q.l2Entry(vc)
	fileSize := q.fileSize
	q.meta.RUnlock()
	if err != nil || !cached {
		return mapping{}, false
	}
	m, err = q.decode(vc, e, fileSize)
	return m, err == nil
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
		// The compressed bytes may run past the end of the file: QEMU's
		// block layer reads zeroes there and inflates them, and so do we
		// (compressedCluster). The format bounds size by two clusters.
		size = min(size, 2*q.h.clusterSize)
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

// l2ForWrite returns the pinned L2 table that maps virtual cluster vc,
// allocating an empty one if there is none. The caller holds alloc.
func (q *Image) l2ForWrite(ctx context.Context, vc int64) (*pinnedL2, error) {
	l1i := vc / q.h.l2Entries
	if l1i >= int64(len(q.l1)) {
		return nil, fmt.Errorf("%w: cluster %d beyond the L1 table", ErrCorrupt, vc)
	}
	e := q.l1[l1i]
	off := int64(e & l1OffsetMask)
	if off == 0 {
		return q.newL2(ctx, l1i, make([]uint64, q.h.l2Entries))
	}
	if e&oflagCopied == 0 {
		return q.unshareL2(ctx, l1i, off)
	}
	if p, ok := q.w.l2pin[off]; ok {
		return p, nil
	}
	t, err := q.l2ForAlloc(ctx, off)
	if err != nil {
		return nil, err
	}
	return q.pinL2(ctx, off, t)
}

// l2ForAlloc returns the L2 table at off as it stands: pinned, cached, or
// read from the file (not cached: the caller pins it or only reads it).
// The caller holds alloc, so the table cannot change meanwhile.
func (q *Image) l2ForAlloc(ctx context.Context, off int64) ([]uint64, error) {
	if p, ok := q.w.l2pin[off]; ok {
		return p.t, nil
	}
	if t, ok := q.l2cache.Get(off); ok {
		return t, nil
	}
	return q.loadL2(ctx, off, q.fileSize)
}

// pinL2 pins table t at off (unchanged so far) for a writer, once it is
// sure that writing the table back lands on no other metadata. The caller
// holds alloc.
func (q *Image) pinL2(ctx context.Context, off int64, t []uint64) (*pinnedL2, error) {
	if err := q.checkWrite(ctx, off, q.h.clusterSize, metaL2, "L2 table update"); err != nil {
		return nil, err
	}
	p := &pinnedL2{t: t}
	q.meta.Lock()
	q.w.l2pin[off] = p
	q.meta.Unlock()
	return p, nil
}

// newL2 puts table t in a new cluster and points L1 entry l1i at it; the
// table is written back before the L1 entry. The caller holds alloc.
func (q *Image) newL2(ctx context.Context, l1i int64, t []uint64) (*pinnedL2, error) {
	host, err := q.allocClusters(ctx, 1)
	if err != nil {
		return nil, err
	}
	p := &pinnedL2{t: t, dirty: true}
	q.w.dirtyL2.Add(1)
	cs := q.h.clusterSize
	q.meta.Lock()
	q.w.l2pin[host] = p
	if old := int64(q.l1[l1i] & l1OffsetMask); old != 0 {
		q.w.metaMap.addL2(old/cs, -1)
	}
	q.l1[l1i] = uint64(host) | oflagCopied
	q.w.metaMap.addL2(host/cs, 1)
	q.meta.Unlock()
	q.l1Changed(int(l1i))
	return p, nil
}

// unshareL2 makes the L2 table at off, which L1 entry l1i points at without
// the COPIED flag, one this image may change. Shared with a snapshot
// (refcount above one), it is copied to a new cluster, the L1 entry points
// at the copy, and the old table loses this reference once that is durable;
// the data clusters stay shared, and writes copy them in turn. With
// refcount one the flag was merely missing: it is set. The caller holds
// alloc.
func (q *Image) unshareL2(ctx context.Context, l1i, off int64) (*pinnedL2, error) {
	rc, err := q.getRef(ctx, off/q.h.clusterSize)
	if err != nil {
		return nil, err
	}
	if rc == 0 {
		return nil, fmt.Errorf("%w: L2 table at %#x has refcount zero", ErrCorrupt, off)
	}
	t, err := q.l2ForAlloc(ctx, off)
	if err != nil {
		return nil, err
	}
	if rc == 1 {
		p, err := q.pinL2(ctx, off, t)
		if err != nil {
			return nil, err
		}
		q.meta.Lock()
		q.l1[l1i] |= oflagCopied
		q.meta.Unlock()
		q.l1Changed(int(l1i))
		return p, nil
	}
	p, err := q.newL2(ctx, l1i, slices.Clone(t))
	if err != nil {
		return nil, err
	}
	q.freeRangeLater(off, 1)
	return p, nil
}

// setL2 stores L2 entry e for virtual cluster vc. The caller holds alloc.
func (q *Image) setL2(ctx context.Context, vc int64, e uint64) error {
	p, err := q.l2ForWrite(ctx, vc)
	if err != nil {
		return err
	}
	q.meta.Lock()
	p.t[vc%q.h.l2Entries] = e
	q.meta.Unlock()
	if !p.dirty {
		p.dirty = true
		q.w.dirtyL2.Add(1)
	}
	return nil
}

// l1Changed marks L1 entry i for write-back. The caller holds alloc.
func (q *Image) l1Changed(i int) {
	w := q.w
	if w.l1Hi == 0 {
		w.l1Lo, w.l1Hi = i, i+1
		return
	}
	w.l1Lo, w.l1Hi = min(w.l1Lo, i), max(w.l1Hi, i+1)
}
