package qcow2

import (
	"cmp"
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"sort"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
)

// Metadata overlap checks, as QEMU's qcow2_check_metadata_overlap does them
// in its default ("cached") mode. A corrupt image can make a data write land
// on metadata: a refcount too low lets allocation hand out the L1 table's
// cluster, an L2 entry can point at an L2 table or the refcount table, a
// compressed entry pointing into the header has the header's cluster freed
// (and punched out) when the entry is overwritten. So before a data write,
// an allocation, a metadata table's first change or a free lands, the host
// clusters are checked against what the image uses as metadata; on a hit
// the request fails (EIO), the image is marked corrupt in its header, so
// that later opens for writing are refused, writes are refused from then
// on, and one line names the structure.

// metaKind names a metadata structure.
type metaKind uint8

const (
	metaNone metaKind = iota
	metaHeader
	metaL1
	metaL2
	metaRefTable
	metaRefBlock
	metaSnapTable
	metaSnapL1
	metaBitmap
)

func (k metaKind) String() string {
	return [...]string{"nothing", "image header", "active L1 table", "active L2 table", "refcount table",
		"refcount block", "snapshot table", "inactive L1 table", "persistent dirty bitmap"}[k]
}

// metaRange is a run of host clusters [start, end) holding one structure.
type metaRange struct {
	start, end int64
	kind       metaKind
}

// metaUse counts how often a host cluster is used as an L2 table (by L1
// entries), as a refcount block (by refcount table entries) and by the
// persistent bitmaps (directory, tables, data; bitmapstore.go).
type metaUse struct{ l2, rb, bm int32 }

// metaMap is where the metadata lies, in host clusters. Guarded by q.meta:
// checks hold it shared, changes (under alloc too) exclusively.
type metaMap struct {
	// ranges holds the few contiguous structures that move: header, L1
	// table, refcount table, snapshot table.
	ranges []metaRange
	// snapL1 holds the snapshots' L1 tables (there may be 65536), sorted
	// by start, and snapL1End[i] the largest end among snapL1[:i+1], so
	// that a check is a binary search.
	snapL1    []metaRange
	snapL1End []int64
	// clusters holds the one-cluster structures: L2 tables, refcount
	// blocks.
	clusters map[int64]metaUse
}

// buildMetaMap records the metadata of an image opened for writing. The
// caller holds alloc, or no one else has the image yet.
func (q *Image) buildMetaMap() {
	w := q.w
	w.metaMap = newMetaMap(q.h.clusterSize, q.l1, w.l1Offset, w.rtable, w.rtOffset, ^uint64(q.h.clusterSize-1),
		int64(q.h.snapshotsOffset), q.snapTableBytes, q.snaps)
	// The table's clusters in the file, past its trimmed zeros.
	w.metaMap.setRange(metaRefTable, w.rtOffset, w.rtEntries*8, q.h.clusterSize)
}

// newMetaMap maps the metadata of an image: the header, the active L1
// table l1 at l1Off and the L2 tables it names, the refcount table rt at
// rtOff and the blocks its entries (masked by rtMask) name, the snapshot
// table of snapLen bytes at snapOff and the snapshots' L1 tables.
func newMetaMap(cs int64, l1 []uint64, l1Off int64, rt []uint64, rtOff int64, rtMask uint64, snapOff, snapLen int64, snaps []snapshotEntry) *metaMap {
	m := &metaMap{clusters: map[int64]metaUse{}}
	m.setRange(metaHeader, 0, cs, cs)
	m.setRange(metaL1, l1Off, int64(len(l1))*8, cs)
	m.setRange(metaRefTable, rtOff, int64(len(rt))*8, cs)
	if snapOff >= 0 {
		m.setRange(metaSnapTable, snapOff, snapLen, cs)
	}
	var snapL1 []metaRange
	for _, s := range snaps {
		if s.l1Size > 0 && s.l1Offset >= 0 && s.l1Offset <= math.MaxInt64-s.l1Size*8 {
			snapL1 = append(snapL1, metaRange{s.l1Offset / cs, (s.l1Offset + s.l1Size*8 + cs - 1) / cs, metaSnapL1})
		}
	}
	m.setSnapshotL1s(snapL1)
	for _, e := range l1 {
		if off := int64(e & l1OffsetMask); off != 0 {
			m.addL2(off/cs, 1)
		}
	}
	for _, e := range rt {
		if off := int64(e & rtMask); off != 0 {
			m.addRB(off/cs, 1)
		}
	}
	return m
}

// setRange replaces the range of kind (the one of its kind: header, L1,
// refcount table, snapshot table) with the clusters [off, off+n) touches.
func (m *metaMap) setRange(kind metaKind, off, n, cs int64) {
	for i, r := range m.ranges {
		if r.kind == kind {
			m.ranges = append(m.ranges[:i], m.ranges[i+1:]...)
			break
		}
	}
	if n > 0 {
		m.ranges = append(m.ranges, metaRange{off / cs, (off + n + cs - 1) / cs, kind})
	}
}

// setSnapshotL1s records the snapshots' L1 tables (in clusters).
func (m *metaMap) setSnapshotL1s(r []metaRange) {
	m.snapL1 = slices.SortedFunc(slices.Values(r), func(a, b metaRange) int { return cmp.Compare(a.start, b.start) })
	m.snapL1End = m.snapL1End[:0]
	end := int64(0)
	for _, r := range m.snapL1 {
		end = max(end, r.end)
		m.snapL1End = append(m.snapL1End, end)
	}
}

func (m *metaMap) addL2(c int64, d int32) {
	u := m.clusters[c]
	u.l2 += d
	m.put(c, u)
}

func (m *metaMap) addRB(c int64, d int32) {
	u := m.clusters[c]
	u.rb += d
	m.put(c, u)
}

func (m *metaMap) addBitmap(c int64, d int32) {
	u := m.clusters[c]
	u.bm += d
	m.put(c, u)
}

func (m *metaMap) put(c int64, u metaUse) {
	if u.l2 <= 0 && u.rb <= 0 && u.bm <= 0 {
		delete(m.clusters, c)
		return
	}
	m.clusters[c] = u
}

// overlap returns the first structure other than allow found in host
// clusters [a, b), or metaNone.
func (m *metaMap) overlap(a, b int64, allow metaKind) metaKind {
	for _, r := range m.ranges {
		if r.kind != allow && a < r.end && r.start < b {
			return r.kind
		}
	}
	// The last snapshot L1 table starting before b, and whether any up to
	// it reaches past a.
	if i := sort.Search(len(m.snapL1), func(i int) bool { return m.snapL1[i].start >= b }) - 1; i >= 0 && m.snapL1End[i] > a {
		return metaSnapL1
	}
	if len(m.clusters) == 0 {
		return metaNone
	}
	check := func(u metaUse) metaKind {
		switch {
		case u.l2 > 0 && allow != metaL2:
			return metaL2
		case u.rb > 0 && allow != metaRefBlock:
			return metaRefBlock
		case u.bm > 0 && allow != metaBitmap:
			return metaBitmap
		}
		return metaNone
	}
	if b-a <= int64(len(m.clusters)) {
		for c := a; c < b; c++ {
			if u, ok := m.clusters[c]; ok {
				if k := check(u); k != metaNone {
					return k
				}
			}
		}
		return metaNone
	}
	for c, u := range m.clusters {
		if c >= a && c < b {
			if k := check(u); k != metaNone {
				return k
			}
		}
	}
	return metaNone
}

// checkWrite refuses a write of n bytes at host offset host that would
// land on metadata other than allow (metaNone for data). what names the
// write for the log. The caller holds alloc or nothing; not meta.
func (q *Image) checkWrite(ctx context.Context, host, n int64, allow metaKind, what string) error {
	q.meta.RLock()
	oe := q.checkWriteLocked(host, n, allow)
	q.meta.RUnlock()
	if oe != nil {
		return q.refuse(ctx, oe, what)
	}
	return nil
}

// overlapError is a refused write, before it is reported.
type overlapError struct {
	kind    metaKind
	host, n int64
}

func (e *overlapError) Error() string {
	return fmt.Sprintf("%d bytes at host %#x overlap the %s", e.n, e.host, e.kind)
}

// checkWriteLocked is checkWrite for a caller that holds meta; what it
// finds goes to refuse once meta is released.
func (q *Image) checkWriteLocked(host, n int64, allow metaKind) *overlapError {
	m := q.w.metaMap
	cs := q.h.clusterSize
	if k := m.overlap(host/cs, (host+n+cs-1)/cs, allow); k != metaNone {
		return &overlapError{kind: k, host: host, n: n}
	}
	return nil
}

// refuse reports a write that would have landed on metadata: the image is
// marked corrupt, and the error (ErrCorrupt, EIO to clients) names what
// was hit.
func (q *Image) refuse(ctx context.Context, oe *overlapError, what string) error {
	msg := fmt.Sprintf("preventing invalid write on metadata: %s of %s", what, oe)
	q.markCorrupt(ctx, msg)
	return fmt.Errorf("%w: %s", ErrCorrupt, msg)
}

// checkWritable refuses op on an image opened read-only, or marked corrupt
// since it was opened.
func (q *Image) checkWritable(op string) error {
	switch {
	case q.w == nil:
		return fmt.Errorf("qcow2: %s: %w", op, formats.ErrReadOnly)
	case q.corrupt.Load():
		return fmt.Errorf("%w: %s refused: the image was marked corrupt (a write would have landed on its metadata); check it with qemu-img check", ErrCorrupt, op)
	}
	return nil
}

// markCorrupt sets the corrupt bit in the header (version 3 has one; a
// version 2 image is refused writes for the rest of this session only, as
// in QEMU), logs one line, and refuses writes from now on.
func (q *Image) markCorrupt(ctx context.Context, msg string) {
	if !q.corrupt.CompareAndSwap(false, true) {
		return
	}
	if q.log != nil {
		q.log.Error("qcow2: marking image as corrupt: "+msg+"; further writes are refused", "image", q.path)
	}
	if q.h.version < 3 {
		return
	}
	if err := writeHeaderField(ctx, q.f, hdrIncompatible, q.h.incompatible|incCorrupt); err != nil {
		q.logWarn("could not set the corrupt bit", err)
	}
}

// writeHeaderField writes v as the 8-byte header field at off, then makes
// it durable.
func writeHeaderField(ctx context.Context, f aio.File, off int64, v uint64) error {
	if _, err := f.WriteAt(ctx, binary.BigEndian.AppendUint64(nil, v), off); err != nil {
		return err
	}
	return f.Fdatasync(ctx)
}
