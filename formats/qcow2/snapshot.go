package qcow2

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"

	"github.com/blockexport/blockexport/formats"
)

// maxSnapshots is QEMU's QCOW_MAX_SNAPSHOTS.
const maxSnapshots = 65536

// snapshots reads the snapshot table (for `info`; reads never use it).
func (q *Image) snapshots(ctx context.Context) ([]formats.Snapshot, error) {
	n := q.h.nbSnapshots
	if n == 0 {
		return nil, nil
	}
	if n > maxSnapshots {
		return nil, fmt.Errorf("%w: %d snapshots", ErrCorrupt, n)
	}
	off := int64(q.h.snapshotsOffset)
	if off%8 != 0 || off <= 0 || off >= q.fileSize {
		return nil, fmt.Errorf("%w: snapshot table at %#x", ErrCorrupt, off)
	}
	var list []formats.Snapshot
	be := binary.BigEndian
	for i := uint32(0); i < n; i++ {
		var hdr [40]byte
		if _, err := q.f.ReadAt(ctx, hdr[:], off); err != nil {
			return nil, fmt.Errorf("%w: snapshot %d at %#x: %v", ErrCorrupt, i, off, err)
		}
		idLen := int64(be.Uint16(hdr[12:]))
		nameLen := int64(be.Uint16(hdr[14:]))
		extraLen := int64(be.Uint32(hdr[36:]))
		if extraLen > 1024 {
			return nil, fmt.Errorf("%w: snapshot %d has %d bytes of extra data", ErrCorrupt, i, extraLen)
		}
		rest := make([]byte, extraLen+idLen+nameLen)
		if _, err := q.f.ReadAt(ctx, rest, off+40); err != nil && err != io.EOF {
			return nil, fmt.Errorf("%w: snapshot %d: %v", ErrCorrupt, i, err)
		}
		s := formats.Snapshot{
			DateSec:     be.Uint32(hdr[16:]),
			DateNsec:    be.Uint32(hdr[20:]),
			VMClockSec:  be.Uint64(hdr[24:]) / 1e9,
			VMClockNsec: be.Uint64(hdr[24:]) % 1e9,
			VMStateSize: uint64(be.Uint32(hdr[32:])),
			ID:          string(rest[extraLen : extraLen+idLen]),
			Name:        string(rest[extraLen+idLen:]),
		}
		extra := rest[:extraLen]
		if len(extra) >= 8 {
			s.VMStateSize = be.Uint64(extra[0:])
		}
		if len(extra) >= 24 {
			if ic := be.Uint64(extra[16:]); ic != ^uint64(0) {
				s.ICount = ic
			}
		}
		list = append(list, s)
		off += (40 + extraLen + idLen + nameLen + 7) &^ 7
		if off >= q.fileSize && i+1 < n {
			return nil, fmt.Errorf("%w: snapshot table runs past the end of the file", ErrCorrupt)
		}
	}
	return list, nil
}
