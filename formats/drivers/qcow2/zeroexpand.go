package qcow2

import (
	"context"
	"fmt"
	"slices"

	"github.com/blockexport/blockexport/aio"
)

// Zero clusters turned into what version 2 can hold, as QEMU's
// qcow2_expand_zero_clusters does before a downgrade, in every L2 table
// (the active one's and the snapshots'): a zero cluster with a host
// cluster of its own gets zeroes written there and loses the flag; one
// without becomes unallocated where no backing file shows through, and a
// fresh cluster of zeroes where one does. Fresh clusters come with a new
// refcount structure (refcountorder.go) that counts them before any L2
// entry names them, so that killed at any point, the image is consistent
// (fresh clusters not yet linked leak) and every entry reads zeroes.

// zeroEntry is one L2 entry with the zero flag.
type zeroEntry struct {
	l2off int64
	i     int
	host  int64 // 0: none, or one that must not be written (shared with data)
	fresh bool  // gets a fresh cluster
}

// l2Tables lists the L2 tables c's active and snapshot L1 tables name,
// once each, in the order first named.
func (c *checker) l2Tables(ctx context.Context) ([]int64, error) {
	cs := c.h.clusterSize
	seen := map[int64]bool{}
	var out []int64
	add := func(l1 []uint64) error {
		for _, e := range l1 {
			off := int64(e & l1OffsetMask)
			if off == 0 || seen[off] {
				continue
			}
			if off%cs != 0 || off > c.fileLen-cs {
				return fmt.Errorf("%w: L2 table at %#x is misaligned or past the end of the file", ErrCorrupt, off)
			}
			seen[off] = true
			out = append(out, off)
		}
		return nil
	}
	if err := add(c.l1); err != nil {
		return nil, err
	}
	// Each snapshot's L1 table is checked before it is read: a damaged
	// table cannot make this read more than the file holds.
	read := map[[2]int64]bool{}
	for _, sn := range c.snaps {
		if sn.l1Offset%cs != 0 || sn.l1Size < 0 || sn.l1Size > maxL1Bytes/8 || sn.l1Offset < 0 || sn.l1Offset > c.fileLen-sn.l1Size*8 {
			return nil, fmt.Errorf("%w: snapshot %s's L1 table at %#x (%d entries) is misaligned, too large or past the end of the file", ErrCorrupt, sn.ID, sn.l1Offset, sn.l1Size)
		}
		if read[[2]int64{sn.l1Offset, sn.l1Size}] {
			continue
		}
		read[[2]int64{sn.l1Offset, sn.l1Size}] = true
		l1, err := c.readTable(ctx, sn.l1Offset, sn.l1Size)
		if err != nil {
			return nil, fmt.Errorf("qcow2: snapshot %s's L1 table: %w", sn.ID, err)
		}
		if err := add(l1); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// hasCompressedClusters says whether any L2 table maps a compressed
// cluster.
func hasCompressedClusters(ctx context.Context, f aio.File) (bool, error) {
	c, err := imageTables(ctx, f)
	if err != nil {
		return false, err
	}
	tables, err := c.l2Tables(ctx)
	if err != nil {
		return false, err
	}
	for _, off := range tables {
		t, err := c.readTable(ctx, off, c.h.l2Entries)
		if err != nil {
			return false, err
		}
		if slices.ContainsFunc(t, func(e uint64) bool { return e&l2Compressed != 0 }) {
			return true, nil
		}
	}
	return false, nil
}

// expandZeroClusters turns f's zero clusters into data or unallocated
// clusters.
func expandZeroClusters(ctx context.Context, f aio.File) error {
	c, err := imageTables(ctx, f)
	if err != nil {
		return err
	}
	cs := c.h.clusterSize
	tables, err := c.l2Tables(ctx)
	if err != nil {
		return err
	}
	data := map[int64]bool{} // host clusters mapped as data somewhere
	var zeros []zeroEntry
	for _, off := range tables {
		t, err := c.readTable(ctx, off, c.h.l2Entries)
		if err != nil {
			return err
		}
		for i, e := range t {
			host := int64(e & l1OffsetMask)
			switch {
			case e&l2Compressed != 0:
			case e&l2ZeroFlag == 0:
				if host != 0 {
					data[host] = true
				}
			default:
				zeros = append(zeros, zeroEntry{l2off: off, i: i, host: host})
			}
		}
	}
	if len(zeros) == 0 {
		return nil
	}
	if err := c.count(ctx); err != nil {
		return err
	}
	backed := c.h.backingFile != ""
	var reserved []uint64
	dropped := false
	for i := range zeros {
		z := &zeros[i]
		if z.host != 0 && !data[z.host] {
			continue // zeroes written in place
		}
		users := c.imrt.get(z.l2off / cs) // the L1 tables naming the L2 table
		if z.host != 0 {
			// A host cluster that also holds data elsewhere (a zeroed
			// cluster QEMU kept while a snapshot shares it) is left to
			// that data: this entry lets go of it, and its refcount
			// drops once no entry here names it.
			z.host, dropped = 0, true
		}
		if backed {
			z.fresh = true
			reserved = append(reserved, users)
		}
	}
	var first int64
	if len(reserved) > 0 {
		if first, err = c.switchRefcounts(ctx, c.h.refcountOrder, reserved); err != nil {
			return err
		}
	}
	c.meta = c.metadata()
	zero := make([]byte, cs)
	for _, z := range zeros {
		if z.host != 0 {
			if err := c.writeMeta(ctx, zero, z.host, metaNone, "zeroed cluster", false); err != nil {
				return err
			}
		}
	}
	if err := c.f.Fdatasync(ctx); err != nil {
		return fmt.Errorf("qcow2: write zeroes over zero clusters: %w", err)
	}
	// The L2 tables, each rewritten whole (in place: nothing else moves).
	n := 0
	for k := 0; k < len(zeros); {
		off := zeros[k].l2off
		t, err := c.readTable(ctx, off, c.h.l2Entries)
		if err != nil {
			return err
		}
		for ; k < len(zeros) && zeros[k].l2off == off; k++ {
			z := zeros[k]
			switch {
			case z.fresh:
				e := uint64(first + int64(n)*cs)
				if reserved[n] == 1 {
					e |= oflagCopied
				}
				n++
				t[z.i] = e
			case z.host != 0:
				t[z.i] &^= l2ZeroFlag
			default:
				t[z.i] = 0
			}
		}
		if err := c.writeMeta(ctx, encodeTable(t), off, metaL2, "L2 table", false); err != nil {
			return err
		}
	}
	if err := c.f.Fdatasync(ctx); err != nil {
		return fmt.Errorf("qcow2: write the expanded L2 tables: %w", err)
	}
	if !dropped {
		return nil
	}
	// The clusters let go of leak until the refcounts are counted again.
	if c, err = countedImage(ctx, f); err != nil {
		return err
	}
	_, err = c.switchRefcounts(ctx, c.h.refcountOrder, nil)
	return err
}
