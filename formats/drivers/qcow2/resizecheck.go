package qcow2

import "errors"

// ErrResizeV2Snapshots is QEMU 7.2's refusal to resize a version 2 image
// that has internal snapshots: a v2 snapshot table has no field for the
// snapshot's own size, so the snapshot would take the new size.
var ErrResizeV2Snapshots = errors.New("Can't resize a v2 image which has snapshots")

// ResizeAllowed says whether the image may change its virtual size at
// all, as qcow2_co_truncate decides before it looks at the new size: not a
// v2 image with snapshots, nor one with a bitmap in use at open.
func (q *Image) ResizeAllowed() error {
	if q.h.nbSnapshots > 0 && q.h.version < 3 {
		return ErrResizeV2Snapshots
	}
	return q.bitmapsResizable()
}
