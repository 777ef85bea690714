package qcow2

import (
	"context"
	"fmt"
)

// LoadSnapshot makes the read-only image read as its internal snapshot
// does, as QEMU's qcow2_snapshot_load_tmp (qemu-nbd -l, qemu-img convert
// -l): the snapshot's L1 table replaces the image's, and the size stays
// the image's (clusters past the snapshot's L1 table read as
// unallocated). The snapshot is the one whose ID is id and name is name;
// an empty one matches any. Call it before the first request.
func (q *Image) LoadSnapshot(ctx context.Context, id, name string) error {
	if q.w != nil {
		return fmt.Errorf("qcow2: a snapshot is served read-only: %w", ErrUnsupported)
	}
	var sn *snapshotEntry
	for i := range q.snaps {
		s := &q.snaps[i]
		if (id == "" || s.ID == id) && (name == "" || s.Name == name) {
			sn = s
			break
		}
	}
	if sn == nil || (id == "" && name == "") {
		return ErrSnapshotNotFound
	}
	cs := q.h.clusterSize
	q.meta.RLock()
	fileSize := q.fileSize
	q.meta.RUnlock()
	switch {
	case sn.l1Size < 0 || sn.l1Size*8 > maxL1Bytes:
		return fmt.Errorf("%w: snapshot %q: L1 table of %d entries is too large", ErrCorrupt, sn.Name, sn.l1Size)
	case sn.l1Offset%cs != 0:
		return fmt.Errorf("%w: snapshot %q: L1 table offset %#x is not cluster-aligned", ErrCorrupt, sn.Name, sn.l1Offset)
	case sn.l1Offset < 0 || sn.l1Offset > fileSize || sn.l1Size*8 > fileSize-sn.l1Offset:
		return fmt.Errorf("%w: snapshot %q: L1 table at %#x (%d entries) lies beyond the end of the file", ErrCorrupt, sn.Name, sn.l1Offset, sn.l1Size)
	}
	raw := make([]byte, sn.l1Size*8)
	if _, err := q.f.ReadAt(ctx, raw, sn.l1Offset); err != nil {
		return fmt.Errorf("qcow2: snapshot %q: read its L1 table at %#x: %w", sn.Name, sn.l1Offset, err)
	}
	l1 := decodeTable(raw)
	// A snapshot taken before a grow maps less than the disk: the rest is
	// unallocated, as in QEMU.
	perL1 := cs * q.h.l2Entries
	if need := (q.Size() + perL1 - 1) / perL1; int64(len(l1)) < need {
		l1 = append(l1, make([]uint64, need-int64(len(l1)))...)
	}
	q.meta.Lock()
	q.l1 = l1
	q.meta.Unlock()
	return nil
}
