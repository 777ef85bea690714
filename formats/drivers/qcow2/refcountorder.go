package qcow2

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
)

// A new refcount structure for amend: the refcount width changed
// (refcount_bits, QEMU's qcow2_change_refcount_order) or clusters
// reserved for the zero clusters a downgrade expands. The refcounts are
// the ones check computes from the references, so an image whose stored
// refcounts leak comes out exact. The new table and blocks go past the end
// of the file and are made durable before one header write (within the
// first sector) points at them with the new width: killed at any point,
// the image has its old structure or the complete new one. The new one
// counts the old table and blocks as free, so that nothing leaks either
// way; only reserved clusters not yet linked can leak.

// errRefcountsInconsistent refuses to rewrite refcounts that do not
// match the references (check -r all repairs them first).
var errRefcountsInconsistent = errors.New("the image's refcounts are inconsistent; repair it with check -r all first")

// refcountWidthError is QEMU's refusal to narrow the refcounts below a
// count in use.
type refcountWidthError struct {
	bits  int64
	off   int64
	count uint64
}

func (e *refcountWidthError) Error() string {
	return fmt.Sprintf("Cannot decrease refcount entry width to %d bits: Cluster at offset %#x has a refcount of %d", e.bits, e.off, e.count)
}

// imageTables reads f's header, refcount table, active L1 table and
// snapshot table as check does, counting nothing.
func imageTables(ctx context.Context, f aio.File) (*checker, error) {
	res := formats.CheckResult{Filename: f.Name(), Format: "qcow2"}
	c := &checker{f: f, res: &res, blocks: map[int64][]byte{}, dirty: map[int64]bool{}}
	if err := c.load(ctx); err != nil {
		return nil, err
	}
	if err := c.readSnapshotTable(ctx); err != nil {
		return nil, err
	}
	cs := c.h.clusterSize
	c.nb = (c.fileLen + cs - 1) / cs
	if c.nb > maxCheckClusters {
		return nil, fmt.Errorf("qcow2: %s: %w", f.Name(), errFileTooLarge)
	}
	return c, nil
}

// countedImage is a check of f's references, without repairs: the
// computed refcounts (imrt) of every cluster.
func countedImage(ctx context.Context, f aio.File) (*checker, error) {
	c, err := imageTables(ctx, f)
	if err != nil {
		return nil, err
	}
	return c, c.count(ctx)
}

// count computes the refcounts from the references. Refcounts that fall
// short of the references are refused; leaks are not (the computed
// counts drop them).
func (c *checker) count(ctx context.Context) error {
	if err := c.calculate(ctx, RepairNone); err != nil {
		return err
	}
	if _, err := c.compare(ctx, RepairNone); err != nil {
		return err
	}
	if c.res.Corruptions > 0 || c.res.CheckErrors > 0 || c.rebuild {
		return fmt.Errorf("qcow2: %s: %w", c.f.Name(), errRefcountsInconsistent)
	}
	return nil
}

// switchRefcounts writes a refcount structure of 2^order-bit entries
// holding c's computed refcounts, plus len(reserved) clusters past the end
// of the file with the counts reserved gives, and points the header at
// it. It returns the first reserved cluster's offset (they read as zeroes:
// nothing is written there).
func (c *checker) switchRefcounts(ctx context.Context, order uint32, reserved []uint64) (int64, error) {
	cs := c.h.clusterSize
	bits := int64(1) << order
	per := cs * 8 / bits
	newMax := ^uint64(0)
	if bits < 64 {
		newMax = 1<<bits - 1
	}
	// The old table and blocks are free in the new structure.
	for k := c.rtOff / cs; k < (c.rtOff+int64(len(c.rt))*8+cs-1)/cs; k++ {
		c.imrt.set(k, 0)
	}
	for _, e := range c.rt {
		if off := int64(e & refcountTableMask); off != 0 {
			c.imrt.set(off/cs, 0)
		}
	}
	var over []int64
	c.imrt.each(func(k int64) {
		if c.imrt.get(k) > newMax {
			over = append(over, k)
		}
	})
	if len(over) > 0 {
		k := slices.Min(over)
		return 0, &refcountWidthError{bits: bits, off: k * cs, count: c.imrt.get(k)}
	}
	start := max(c.nb, c.imrt.highest()+1)
	for i, v := range reserved {
		c.imrt.set(start+int64(i), v)
	}
	first := start + int64(len(reserved))
	need := map[int64]bool{}
	c.imrt.each(func(k int64) {
		if c.imrt.get(k) != 0 {
			need[k/per] = true
		}
	})
	entries, tableClusters, end := coverRefcounts(need, first, cs, per)
	if entries*8 > maxRefTableBytes || end > maxCheckClusters {
		return 0, fmt.Errorf("qcow2: %s: the new refcount table would need %d clusters; too large", c.f.Name(), tableClusters)
	}
	for k := first; k < end; k++ {
		c.imrt.set(k, 1)
	}
	c.meta = c.metadata()
	table, tableOff, err := c.writeRefcountStructure(ctx, need, first, entries, per, bits)
	if err != nil {
		return 0, err
	}
	if err := c.f.Fdatasync(ctx); err != nil {
		return 0, fmt.Errorf("qcow2: write the new refcount structure: %w", err)
	}
	// The switch: table offset and size, and (version 3) the width, in
	// one write within the first sector. The fields between them are
	// written back as the file has them now.
	var hdr [hdrHeaderLength - hdrRefcountOffset]byte
	if _, err := c.f.ReadAt(ctx, hdr[:], hdrRefcountOffset); err != nil {
		return 0, fmt.Errorf("qcow2: read the header: %w", err)
	}
	n := 12
	binary.BigEndian.PutUint64(hdr[0:], uint64(tableOff))
	binary.BigEndian.PutUint32(hdr[8:], uint32(tableClusters))
	if c.h.version >= 3 {
		binary.BigEndian.PutUint32(hdr[hdrRefcountOrder-hdrRefcountOffset:], order)
		n = len(hdr)
	} else if order != 4 {
		return 0, fmt.Errorf("qcow2: refcount order %d in a version 2 image (amend bug)", order)
	}
	if _, err := c.f.WriteAt(ctx, hdr[:n], hdrRefcountOffset); err != nil {
		return 0, fmt.Errorf("qcow2: point the header at the new refcount table: %w", err)
	}
	if err := c.f.Fdatasync(ctx); err != nil {
		return 0, fmt.Errorf("qcow2: point the header at the new refcount table: %w", err)
	}
	c.h.refcountOffset, c.h.refcountClusters, c.h.refcountOrder = uint64(tableOff), uint32(tableClusters), order
	c.rt, c.rtOff = table, tableOff
	c.meta = nil
	return start * cs, nil
}

// changeRefcountOrder rewrites f's refcounts 2^order bits wide.
func changeRefcountOrder(ctx context.Context, f aio.File, order uint32) error {
	c, err := countedImage(ctx, f)
	if err != nil {
		return err
	}
	if c.h.refcountOrder == order {
		return nil
	}
	_, err = c.switchRefcounts(ctx, order, nil)
	return err
}
