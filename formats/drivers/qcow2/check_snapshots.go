package qcow2

import (
	"context"
	"encoding/binary"
	"fmt"
	"maps"
	"slices"
)

// snapRaw is one snapshot table entry as read: its fixed header and its
// extra data.
type snapRaw struct {
	hdr   [snapshotHeaderLen]byte
	extra []byte
}

// rewriteSnapshotTable writes the snapshot table anew, each entry with the
// extra data version 3 requires (QEMU's qcow2_check_fix_snapshot_table, by
// qcow2_write_snapshots): the new table goes to fresh clusters past the
// end of the file, whose refcounts are set and made durable first; then
// the header's count and offset change in one write; then the old table's
// clusters are freed. Killed at any point, the image has the old table or
// the new one, and at worst leaks.
func (c *checker) rewriteSnapshotTable(ctx context.Context) error {
	cs, be := c.h.clusterSize, binary.BigEndian
	var buf []byte
	for i, r := range c.snapRaw {
		for len(buf)%8 != 0 {
			buf = append(buf, 0)
		}
		hdr, extra := r.hdr, r.extra
		if len(extra) < 16 {
			e := make([]byte, 16)
			copy(e, extra)
			if len(extra) < 8 {
				be.PutUint64(e[0:], uint64(be.Uint32(hdr[32:]))) // the VM state size
			}
			be.PutUint64(e[8:], c.h.size) // the disk size, as QEMU assumes it
			extra = e
		}
		be.PutUint32(hdr[36:], uint32(len(extra)))
		buf = append(buf, hdr[:]...)
		buf = append(buf, extra...)
		buf = append(buf, c.snaps[i].ID...)
		buf = append(buf, c.snaps[i].Name...)
	}
	n := (int64(len(buf)) + cs - 1) / cs
	start := max(c.nb, c.imrt.highest()+1)
	fail := func(format string, args ...any) error {
		msg := fmt.Sprintf(format, args...)
		c.report(&c.res.CheckErrors, "ERROR failed to update snapshot table: %s", msg)
		return fmt.Errorf("qcow2: %s: update the snapshot table: %s", c.f.Name(), msg)
	}
	bits := int64(1) << c.h.refcountOrder
	for k := start; k < start+n; k++ {
		b, off, j, err := c.stored(ctx, k)
		if err != nil || b == nil {
			return fail("no refcount block covers cluster %d for the new table", k)
		}
		setRefcount(b, j, bits, 1)
		c.dirty[off] = true
	}
	if err := c.flushBlocks(ctx); err != nil {
		return err
	}
	tableOff := start * cs
	padded := make([]byte, n*cs)
	copy(padded, buf)
	if err := c.writeMeta(ctx, padded, tableOff, metaNone, "snapshot table", true); err != nil {
		return err
	}
	var ptr [12]byte
	be.PutUint32(ptr[0:], uint32(len(c.snapRaw)))
	be.PutUint64(ptr[4:], uint64(tableOff))
	if _, err := c.f.WriteAt(ctx, ptr[:], hdrNbSnapshots); err != nil {
		return fail("%v", err)
	}
	if err := c.f.Fdatasync(ctx); err != nil {
		return fail("%v", err)
	}
	oldOff, oldLen := c.snapOff, c.snapLen
	c.snapOff, c.snapLen, c.meta = tableOff, int64(len(buf)), nil
	c.fileLen = max(c.fileLen, (start+n)*cs)
	c.nb = (c.fileLen + cs - 1) / cs
	// Free the old table where it had refcounts (one past the end of the
	// file had none).
	if oldLen > 0 && oldOff >= 0 && oldOff <= maxIOOffset-oldLen {
		for k := oldOff / cs; k <= (oldOff+oldLen-1)/cs; k++ {
			b, off, j, err := c.stored(ctx, k)
			if err != nil || b == nil {
				continue
			}
			if v := getRefcount(b, j, bits); v > 0 {
				setRefcount(b, j, bits, v-1)
				c.dirty[off] = true
			}
		}
		if err := c.flushBlocks(ctx); err != nil {
			return err
		}
	}
	c.res.CorruptionsFixed += c.snapCorruptions
	c.res.Corruptions -= c.snapCorruptions
	return nil
}

// flushBlocks writes the changed refcount blocks, each after its overlap
// check, and makes them durable.
func (c *checker) flushBlocks(ctx context.Context) error {
	if len(c.dirty) == 0 {
		return nil
	}
	for _, off := range slices.Sorted(maps.Keys(c.dirty)) {
		if err := c.writeMeta(ctx, c.blocks[off], off, metaRefBlock, "refcount block", false); err != nil {
			return err
		}
	}
	if err := c.f.Fdatasync(ctx); err != nil {
		c.res.CheckErrors++
		return fmt.Errorf("qcow2: write refcount blocks: %w", err)
	}
	clear(c.dirty)
	return nil
}
