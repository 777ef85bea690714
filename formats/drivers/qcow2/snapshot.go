package qcow2

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"

	"github.com/blockexport/blockexport/formats"
)

// The snapshot table, bounded as QEMU bounds it: a crafted table can claim
// 65536 entries with 64 KiB names each, and must not make us hold gigabytes.
const (
	// maxSnapshots is QEMU's QCOW_MAX_SNAPSHOTS.
	maxSnapshots = 65536
	// maxSnapshotTableBytes is QEMU's QCOW_MAX_SNAPSHOTS_SIZE.
	maxSnapshotTableBytes = 64 << 20
	// maxSnapshotExtra is QEMU's QCOW_MAX_SNAPSHOT_EXTRA_DATA.
	maxSnapshotExtra  = 1024
	snapshotHeaderLen = 40
)

// snapshotEntry is one entry of the snapshot table: what `info` shows, and
// the snapshot's L1 table, which writes must never land on.
type snapshotEntry struct {
	formats.Snapshot
	l1Offset int64
	l1Size   int64
	// extra is the entry's extra data as stored (vm_state_size_large,
	// disk_size, icount and what a later QEMU adds), kept when the table
	// is rewritten.
	extra []byte
}

// readSnapshots reads and validates the snapshot table. It returns the
// entries and the table's length in the file.
func (q *Image) readSnapshots(ctx context.Context) ([]snapshotEntry, int64, error) {
	n := q.h.nbSnapshots
	if n == 0 {
		return nil, 0, nil
	}
	start := int64(q.h.snapshotsOffset)
	if start%8 != 0 || start <= 0 || start >= q.fileSize {
		return nil, 0, fmt.Errorf("%w: snapshot table at %#x", ErrCorrupt, start)
	}
	var list []snapshotEntry
	be := binary.BigEndian
	off, tableEnd := start, start
	for i := range n {
		var hdr [snapshotHeaderLen]byte
		if _, err := q.f.ReadAt(ctx, hdr[:], off); err != nil {
			return nil, 0, fmt.Errorf("%w: snapshot %d at %#x: %v", ErrCorrupt, i, off, err)
		}
		idLen := int64(be.Uint16(hdr[12:]))
		nameLen := int64(be.Uint16(hdr[14:]))
		extraLen := int64(be.Uint32(hdr[36:]))
		if extraLen > maxSnapshotExtra {
			return nil, 0, fmt.Errorf("%w: snapshot %d has %d bytes of extra data (at most %d)", ErrCorrupt, i, extraLen, maxSnapshotExtra)
		}
		// Entries start 8-aligned; the last one need not be padded.
		end := off + snapshotHeaderLen + extraLen + idLen + nameLen
		if end-start > maxSnapshotTableBytes {
			return nil, 0, fmt.Errorf("%w: snapshot table is too big (over %d MiB)", ErrCorrupt, maxSnapshotTableBytes>>20)
		}
		if end > q.fileSize {
			return nil, 0, fmt.Errorf("%w: snapshot table runs past the end of the file", ErrCorrupt)
		}
		rest := make([]byte, extraLen+idLen+nameLen)
		if _, err := q.f.ReadAt(ctx, rest, off+snapshotHeaderLen); err != nil && err != io.EOF {
			return nil, 0, fmt.Errorf("%w: snapshot %d: %v", ErrCorrupt, i, err)
		}
		e := snapshotEntry{
			Snapshot: formats.Snapshot{
				DateSec:     be.Uint32(hdr[16:]),
				DateNsec:    be.Uint32(hdr[20:]),
				VMClockSec:  be.Uint64(hdr[24:]) / 1e9,
				VMClockNsec: be.Uint64(hdr[24:]) % 1e9,
				VMStateSize: uint64(be.Uint32(hdr[32:])),
				ID:          string(rest[extraLen : extraLen+idLen]),
				Name:        string(rest[extraLen+idLen:]),
			},
			l1Offset: int64(be.Uint64(hdr[0:])),
			l1Size:   int64(be.Uint32(hdr[8:])),
		}
		extra := rest[:extraLen]
		e.extra = extra
		if len(extra) >= 8 {
			e.VMStateSize = be.Uint64(extra[0:])
		}
		if len(extra) >= 24 {
			if ic := be.Uint64(extra[16:]); ic != ^uint64(0) {
				e.ICount = &ic
			}
		}
		list = append(list, e)
		tableEnd = end
		off = (end + 7) &^ 7
	}
	return list, tableEnd - start, nil
}

// snapshotList is the snapshots as `info` shows them.
func (q *Image) snapshotList() []formats.Snapshot {
	if len(q.snaps) == 0 {
		return nil
	}
	list := make([]formats.Snapshot, len(q.snaps))
	for i, s := range q.snaps {
		list[i] = s.Snapshot
	}
	return list
}
