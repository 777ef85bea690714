package qcow2

import (
	"context"
	"encoding/binary"
	"fmt"
	"maps"
	"math"
	"slices"
)

// The computed refcounts of a check, and the rebuild of the refcount
// structures from them (QEMU's rebuild_refcount_structure).

// imrtPage is how many clusters one page of computed refcounts covers.
const imrtPage = 4096

// imrt holds the computed refcounts (QEMU's in-memory refcount table) in
// pages allocated where something is referenced, so that a check holds
// memory for what the metadata references, not for the file's size: a
// sparse file of a terabyte with a few clusters in use costs a few pages.
// Counts of refcounts up to 16 bits take two bytes each, as in QEMU; wider
// ones four.
type imrt struct {
	narrow map[int64]*[imrtPage]uint16
	wide   map[int64]*[imrtPage]uint32
	max    uint64
}

func newIMRT(max uint64) *imrt {
	if max <= math.MaxUint16 {
		return &imrt{narrow: map[int64]*[imrtPage]uint16{}, max: max}
	}
	return &imrt{wide: map[int64]*[imrtPage]uint32{}, max: max}
}

func (m *imrt) get(k int64) uint64 {
	if m.narrow != nil {
		return pageGet(m.narrow, k)
	}
	return pageGet(m.wide, k)
}

// set stores v, which must not exceed max.
func (m *imrt) set(k int64, v uint64) {
	if m.narrow != nil {
		pageSet(m.narrow, k, v)
	} else {
		pageSet(m.wide, k, v)
	}
}

func pageGet[T uint16 | uint32](pages map[int64]*[imrtPage]T, k int64) uint64 {
	if p := pages[k/imrtPage]; p != nil {
		return uint64(p[k%imrtPage])
	}
	return 0
}

// pageSet stores v as cluster k's count; a page is made only for a count
// that is not zero.
func pageSet[T uint16 | uint32](pages map[int64]*[imrtPage]T, k int64, v uint64) {
	p := pages[k/imrtPage]
	if p == nil {
		if v == 0 {
			return
		}
		p = new([imrtPage]T)
		pages[k/imrtPage] = p
	}
	p[k%imrtPage] = T(v)
}

// inc counts one more reference to cluster k; false when its count is at
// the largest an entry holds (QEMU's "overflow").
func (m *imrt) inc(k int64) bool {
	v := m.get(k)
	if v >= m.max {
		return false
	}
	m.set(k, v+1)
	return true
}

// pageIndexes returns the indexes of the pages held.
func (m *imrt) pageIndexes() []int64 {
	if m.narrow != nil {
		return slices.Collect(maps.Keys(m.narrow))
	}
	return slices.Collect(maps.Keys(m.wide))
}

// hasPage says whether page pi is held.
func (m *imrt) hasPage(pi int64) bool {
	if m.narrow != nil {
		return m.narrow[pi] != nil
	}
	return m.wide[pi] != nil
}

// any says whether a cluster in [a, b) is referenced.
func (m *imrt) any(a, b int64) bool {
	for pi := a / imrtPage; a < b && pi <= (b-1)/imrtPage; pi++ {
		if !m.hasPage(pi) {
			continue
		}
		for k := max(a, pi*imrtPage); k < min(b, (pi+1)*imrtPage); k++ {
			if m.get(k) != 0 {
				return true
			}
		}
	}
	return false
}

// each calls f for every referenced cluster, in no order.
func (m *imrt) each(f func(k int64)) {
	for _, pi := range m.pageIndexes() {
		for k := pi * imrtPage; k < (pi+1)*imrtPage; k++ {
			if m.get(k) != 0 {
				f(k)
			}
		}
	}
}

// highest returns the highest referenced cluster, or -1.
func (m *imrt) highest() int64 {
	h := int64(-1)
	m.each(func(k int64) { h = max(h, k) })
	return h
}

// rebuildRefcounts writes new refcount blocks and a new refcount table,
// holding the computed refcounts, in fresh clusters past the end of the
// file and past every cluster referenced, makes them durable, and only
// then points the header at them (offset and size in one write, then a
// flush): killed at any point, the image has either its old refcount
// structures or the complete new ones. The old structures are leaked
// then, and freed by the leak repair that follows, as in QEMU. It returns
// the highest cluster in use.
// coverRefcounts sizes a new refcount structure written from cluster
// first on: need holds the refcount blocks (by index) the clusters in use
// need, and the new blocks and table must be covered by blocks too, so
// the set grows until it covers itself. It returns the table's entries
// and clusters, and the cluster after the structure.
func coverRefcounts(need map[int64]bool, first, cs, per int64) (entries, tableClusters, end int64) {
	for {
		nblocks := int64(len(need))
		top := int64(0)
		for i := range need {
			top = max(top, i)
		}
		entries = ((top+1)*8 + cs - 1) / cs * cs / 8
		tableClusters = entries * 8 / cs
		end = first + nblocks + tableClusters
		grown := false
		for k := first; k < end; k++ {
			if !need[k/per] {
				need[k/per], grown = true, true
			}
		}
		if !grown {
			return entries, tableClusters, end
		}
	}
}

// writeRefcountStructure writes, from cluster first on, the refcount
// blocks need names (in index order, counting c.imrt with per refcounts
// of bits bits a block), then a table of entries after them; it returns the table
// and its offset. Nothing names them until the caller's header write.
func (c *checker) writeRefcountStructure(ctx context.Context, need map[int64]bool, first, entries, per, bits int64) ([]uint64, int64, error) {
	cs := c.h.clusterSize
	table := make([]uint64, entries)
	for n, i := range slices.Sorted(maps.Keys(need)) {
		off := (first + int64(n)) * cs
		table[i] = uint64(off)
		b := make([]byte, cs)
		for j := range per {
			if v := c.imrt.get(i*per + j); v != 0 {
				setRefcount(b, j, bits, v)
			}
		}
		if err := c.writeMeta(ctx, b, off, metaNone, "refcount block", false); err != nil {
			return nil, 0, err
		}
	}
	tableOff := (first + int64(len(need))) * cs
	return table, tableOff, c.writeMeta(ctx, encodeTable(table), tableOff, metaNone, "refcount table", false)
}

func (c *checker) rebuildRefcounts(ctx context.Context) (int64, error) {
	cs, per := c.h.clusterSize, c.perBlock()
	c.res.Messages = append(c.res.Messages, "Rebuilding refcount structure")
	old := *c.res

	start := max(c.nb, c.imrt.highest()+1)
	need := map[int64]bool{}
	c.imrt.each(func(k int64) { need[k/per] = true })
	entries, tableClusters, end := coverRefcounts(need, start, cs, per)
	if entries*8 > maxRefTableBytes || end > maxCheckClusters {
		c.res.CheckErrors++
		return 0, fmt.Errorf("qcow2: %s: the rebuilt refcount table would need %d clusters past cluster %d; too large", c.f.Name(), tableClusters, start)
	}
	for k := start; k < end; k++ {
		c.imrt.set(k, 1)
	}
	c.meta = c.metadata()
	table, tableOff, err := c.writeRefcountStructure(ctx, need, start, entries, per, int64(1)<<c.h.refcountOrder)
	if err != nil {
		return 0, err
	}
	if err := c.f.Fdatasync(ctx); err != nil {
		c.res.CheckErrors++
		return 0, fmt.Errorf("qcow2: write the rebuilt refcount structures: %w", err)
	}
	// The switch: refcount_table_offset and refcount_table_clusters are
	// adjacent in the header, one 12-byte write within one sector.
	var hdr [12]byte
	binary.BigEndian.PutUint64(hdr[0:], uint64(tableOff))
	binary.BigEndian.PutUint32(hdr[8:], uint32(tableClusters))
	if _, err := c.f.WriteAt(ctx, hdr[:], hdrRefcountOffset); err != nil {
		c.res.CheckErrors++
		return 0, fmt.Errorf("qcow2: set the rebuilt refcount table: %w", err)
	}
	if err := c.f.Fdatasync(ctx); err != nil {
		c.res.CheckErrors++
		return 0, fmt.Errorf("qcow2: set the rebuilt refcount table: %w", err)
	}
	c.h.refcountOffset, c.h.refcountClusters = uint64(tableOff), uint32(tableClusters)
	c.rt, c.rtOff = table, tableOff
	c.blocks = map[int64][]byte{}
	c.meta = nil
	c.fileLen = max(c.fileLen, end*cs)
	c.nb = (c.fileLen + cs - 1) / cs

	// The references again, with the new structures; the old ones are
	// leaks now, which -r all repairs (QEMU counts what that pass finds
	// apart: only leaks it could not fix are reported).
	c.res.Corruptions, c.res.Leaks = 0, 0
	c.res.AllocatedClusters, c.res.FragmentedClusters, c.res.CompressedClusters = 0, 0, 0
	c.rebuild = false
	if err := c.calculate(ctx, RepairNone); err != nil {
		return 0, err
	}
	saved := *c.res
	c.res.Corruptions, c.res.Leaks, c.res.CheckErrors, c.res.LeaksFixed, c.res.CorruptionsFixed = 0, 0, 0, 0, 0
	highest, err := c.compare(ctx, RepairLeaks)
	if err != nil {
		return 0, err
	}
	if c.rebuild {
		c.res.Messages = append(c.res.Messages, "ERROR rebuilt refcount structure is still broken")
	}
	fresh := c.res.Leaks
	msgs := c.res.Messages
	*c.res = saved
	c.res.Messages = msgs
	if c.res.Corruptions < old.Corruptions {
		c.res.CorruptionsFixed += old.Corruptions - c.res.Corruptions
	}
	if c.res.Leaks < old.Leaks {
		c.res.LeaksFixed += old.Leaks - c.res.Leaks
	}
	c.res.Leaks += fresh
	return highest, nil
}
