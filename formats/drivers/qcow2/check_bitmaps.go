package qcow2

import (
	"context"
	"encoding/binary"
	"fmt"
)

// Persistent dirty bitmaps in a check, as QEMU's
// qcow2_check_bitmaps_refcounts counts them: the bitmap directory, each
// bitmap's table, and the clusters the tables name are references like
// any other. A directory that does not parse fails the check, as there.

// Bitmap directory entry and table entry fields (QEMU's qcow2-bitmap.c).
const (
	bmDirEntryLen     = 24
	bmTableReserved   = 0xff000000000001fe // BME_TABLE_ENTRY_RESERVED_MASK
	bmTableAllOnes    = 1                  // BME_TABLE_ENTRY_FLAG_ALL_ONES
	bmMaxTableEntries = 0x8000000          // BME_MAX_TABLE_SIZE
	bmMaxNameSize     = 1023               // BME_MAX_NAME_SIZE
	bmReservedFlags   = 0xfffffffc         // BME_RESERVED_FLAGS
	bmTypeDirty       = 1                  // BT_DIRTY_TRACKING_BITMAP
	bmMinGranularity  = 9
	bmMaxGranularity  = 31
)

// bitmapRefs counts the references of the bitmaps.
func (c *checker) bitmapRefs(ctx context.Context) error {
	if !c.h.hasBitmaps {
		return nil
	}
	size, off := int64(c.h.bitmaps.dirSize), int64(c.h.bitmaps.dirOffset)
	cs := c.h.clusterSize
	c.inc(off, size)
	dir := make([]byte, size)
	bad := func(format string, args ...any) error {
		c.report(&c.res.Corruptions, "ERROR: %s", fmt.Sprintf(format, args...))
		return fmt.Errorf("qcow2: %s: bitmap directory: %s", c.f.Name(), fmt.Sprintf(format, args...))
	}
	if err := c.readAt(ctx, dir, off); err != nil {
		return bad("%v", err)
	}
	be := binary.BigEndian
	type table struct{ off, n int64 }
	var tables []table
	for p := int64(0); p < size; {
		if p+bmDirEntryLen > size {
			return bad("broken bitmap directory")
		}
		e := dir[p:]
		toff, tn := int64(be.Uint64(e[0:])), int64(be.Uint32(e[8:]))
		flags, typ, gran := be.Uint32(e[12:]), e[16], e[17]
		nameLen, extraLen := int64(be.Uint16(e[18:])), int64(be.Uint32(e[20:]))
		if tn == 0 || toff <= 0 || toff%cs != 0 || tn > bmMaxTableEntries || gran > bmMaxGranularity ||
			gran < bmMinGranularity || flags&bmReservedFlags != 0 || nameLen > bmMaxNameSize || typ != bmTypeDirty || extraLen != 0 {
			return bad("bitmap directory entry at %#x is invalid", off+p)
		}
		p += (bmDirEntryLen + extraLen + nameLen + 7) &^ 7
		tables = append(tables, table{toff, tn})
	}
	for _, t := range tables {
		c.inc(t.off, t.n*8)
		entries, err := c.readTable(ctx, t.off, t.n)
		if err != nil {
			c.res.Corruptions++
			break
		}
		for _, e := range entries {
			o := int64(e & l2OffsetMask)
			if e&bmTableReserved != 0 || o != 0 && (e&bmTableAllOnes != 0 || o%cs != 0) {
				c.report(&c.res.Corruptions, "ERROR bitmap table entry %#x is invalid", e)
				continue
			}
			if o != 0 {
				c.inc(o, cs)
			}
		}
	}
	return nil
}
