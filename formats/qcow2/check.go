package qcow2

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"slices"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
)

// Check and repair, as qemu-img check does them: the refcount of every
// cluster is computed from every reference the image holds (header, L1 and
// L2 tables and what they map, snapshots and their tables, the refcount
// table and blocks) and compared with the stored one. Stored above
// computed is a leak (space wasted, no harm); below is a corruption (a
// write could reuse a cluster in use). COPIED flags must say "refcount
// one" exactly where it is so.
//
// It reads the metadata itself rather than through an open Image, so that
// the images an Image refuses to write (marked corrupt, left dirty) can be
// checked and repaired.

// RepairLeaks and RepairAll are what Check may fix (qemu-img check -r).
const (
	RepairNone  = 0
	RepairLeaks = 1
	RepairAll   = 3 // leaks, refcounts too low, COPIED flags
)

// refcountTableMask is QEMU's REFT_OFFSET_MASK.
const refcountTableMask = 0xfffffffffffffe00

// checker is one check's state.
type checker struct {
	q   *Image
	res *formats.CheckResult
	// refs are the computed refcounts of the clusters inside the file;
	// beyond holds those of clusters referenced beyond its end.
	refs   []uint32
	beyond map[int64]uint32
	rt     []uint64
	// blocks caches refcount blocks read, changed ones marked dirty.
	blocks map[int64][]byte
	dirty  map[int64]bool
}

// Check checks the qcow2 image in f, repairing what repair allows (f must
// then be writable), and reports in qemu-img check's terms. As qemu-img
// does, a repair is followed by a second check, whose findings are the
// result, with the first one's fixed counts. A check that cannot finish
// returns an error.
func Check(ctx context.Context, f aio.File, repair int) (formats.CheckResult, error) {
	res, err := checkOnce(ctx, f, repair)
	if err != nil || res.LeaksFixed+res.CorruptionsFixed == 0 {
		return res, err
	}
	again, err := checkOnce(ctx, f, RepairNone)
	again.LeaksFixed, again.CorruptionsFixed = res.LeaksFixed, res.CorruptionsFixed
	again.Messages = append(res.Messages, again.Messages...)
	return again, err
}

func checkOnce(ctx context.Context, f aio.File, repair int) (formats.CheckResult, error) {
	res := formats.CheckResult{Filename: f.Name(), Format: "qcow2"}
	q, err := load(f, f.Name(), Options{})
	if err != nil {
		return res, err
	}
	if q.h.hasBitmaps {
		return res, fmt.Errorf("qcow2: %s: checking images with persistent dirty bitmaps is not supported (qemu-img check is)", f.Name())
	}
	cs := q.h.clusterSize
	c := &checker{q: q, res: &res, refs: make([]uint32, (q.fileSize+cs-1)/cs), beyond: map[int64]uint32{},
		blocks: map[int64][]byte{}, dirty: map[int64]bool{}}
	if c.rt, err = q.refcountTable(ctx); err != nil {
		return res, err
	}
	res.TotalClusters = (q.Size() + cs - 1) / cs

	c.inc(0, cs) // the header
	if err := c.l1(ctx, int64(q.h.l1Offset), int64(q.h.l1Size), true); err != nil {
		return res, err
	}
	for _, sn := range q.snaps {
		if err := c.l1(ctx, sn.l1Offset, sn.l1Size, false); err != nil {
			return res, err
		}
	}
	c.inc(int64(q.h.snapshotsOffset), q.snapTableBytes)
	c.inc(int64(q.h.refcountOffset), int64(q.h.refcountClusters)*cs)
	for i, e := range c.rt {
		off := int64(e & refcountTableMask)
		switch {
		case off%cs != 0:
			c.report(&res.Corruptions, "ERROR refcount block %d is not cluster aligned; refcount table entry corrupted", i)
		case off/cs >= int64(len(c.refs)):
			c.report(&res.Corruptions, "ERROR refcount block %d is outside image", i)
		case off != 0:
			c.inc(off, cs)
			if n := c.refs[off/cs]; n != 1 {
				c.report(&res.Corruptions, "ERROR refcount block %d refcount=%d", i, n)
			}
		}
	}

	// With -r all, COPIED flags that claim too much (judged by the
	// computed refcounts, the true ones) are cleared first, since that
	// only makes writes copy; then the refcounts are repaired; then, with
	// those durable, the flags are set right both ways. A crash between
	// steps leaves what a second repair fixes, never a cluster in use
	// with too low a refcount or a shared one marked COPIED.
	all := repair&RepairAll == RepairAll
	if all {
		if err := c.copiedFlags(ctx, clearExcess); err != nil {
			return res, err
		}
	}
	if err := c.compare(ctx, repair); err != nil {
		return res, err
	}
	mode := countOnly
	if all {
		mode = fixBoth
	}
	if err := c.copiedFlags(ctx, mode); err != nil {
		return res, err
	}
	if repair != RepairNone && res.CheckErrors == 0 && res.Corruptions == 0 && q.h.incompatible&(incDirty|incCorrupt) != 0 {
		// Repaired: the image is clean and consistent again.
		var b [8]byte
		binary.BigEndian.PutUint64(b[:], q.h.incompatible&^(incDirty|incCorrupt))
		if _, err := f.WriteAt(ctx, b[:], hdrIncompatible); err != nil {
			return res, fmt.Errorf("qcow2: clear the dirty and corrupt bits: %w", err)
		}
		if err := f.Fdatasync(ctx); err != nil {
			return res, fmt.Errorf("qcow2: clear the dirty and corrupt bits: %w", err)
		}
	}
	return res, nil
}

func (c *checker) report(counter *int64, format string, args ...any) {
	*counter++
	c.res.Messages = append(c.res.Messages, fmt.Sprintf(format, args...))
}

// inc counts one more reference to every cluster [off, off+n) touches.
func (c *checker) inc(off, n int64) {
	if n <= 0 {
		return
	}
	cs := c.q.h.clusterSize
	for k := off / cs; k <= (off+n-1)/cs; k++ {
		v := c.computed(k)
		if v == uint64(^uint32(0)) {
			c.report(&c.res.Corruptions, "ERROR: overflow cluster offset=%#x", k*cs)
			continue
		}
		if k < int64(len(c.refs)) {
			c.refs[k]++
		} else {
			c.beyond[k]++
		}
	}
}

// computed is the computed refcount of cluster k.
func (c *checker) computed(k int64) uint64 {
	if k < int64(len(c.refs)) {
		return uint64(c.refs[k])
	}
	return uint64(c.beyond[k])
}

// readTable reads n big-endian entries at off; what lies past the end of
// the file reads as zeroes, as QEMU reads it.
func (c *checker) readTable(ctx context.Context, off, n int64) ([]uint64, error) {
	raw := make([]byte, n*8)
	if _, err := c.q.f.ReadAt(ctx, raw, off); err != nil && err != io.EOF {
		return nil, fmt.Errorf("qcow2: table at %#x: %w", off, err)
	}
	t := make([]uint64, n)
	for i := range t {
		t[i] = binary.BigEndian.Uint64(raw[i*8:])
	}
	return t, nil
}

// l1 counts an L1 table, its L2 tables and the clusters they map; active
// (the image's own table, not a snapshot's) also counts the allocation
// figures.
func (c *checker) l1(ctx context.Context, off, size int64, active bool) error {
	q, cs := c.q, c.q.h.clusterSize
	c.inc(off, size*8)
	l1, err := c.readTable(ctx, off, size)
	if err != nil {
		return err
	}
	for _, e := range l1 {
		l2off := int64(e & l1OffsetMask)
		if l2off == 0 {
			continue
		}
		c.inc(l2off, cs)
		if l2off%cs != 0 {
			c.report(&c.res.Corruptions, "ERROR l2_offset=%x: Table is not cluster aligned; L1 entry corrupted", l2off)
			continue
		}
		l2, err := c.readTable(ctx, l2off, q.h.l2Entries)
		if err != nil {
			return err
		}
		var next int64 // where a contiguous cluster would lie
		for _, e := range l2 {
			switch {
			case e&l2Compressed != 0:
				if e&oflagCopied != 0 {
					c.report(&c.res.Corruptions, "ERROR: cluster %d: copied flag must never be set for compressed clusters", int64(e&^oflagCopied)>>q.h.clusterBits)
				}
				host, sectors := q.compressedEntry(e &^ oflagCopied)
				c.inc(host&^511, sectors*512)
				if active {
					c.res.AllocatedClusters++
					c.res.CompressedClusters++
					c.res.FragmentedClusters++ // by nature, as QEMU counts them
				}
			case e&l2OffsetMask != 0: // data, or zero with a preallocated cluster
				host := int64(e & l2OffsetMask)
				if host%cs != 0 {
					c.report(&c.res.Corruptions, "ERROR offset=%x: Data cluster is not properly aligned; L2 entry corrupted.", host)
					continue
				}
				if active {
					c.res.AllocatedClusters++
					if next != 0 && host != next {
						c.res.FragmentedClusters++
					}
					next = host + cs
				}
				c.inc(host, cs)
			}
		}
	}
	return nil
}

// stored returns the refcount block covering cluster k (nil: none) and
// k's index in it.
func (c *checker) stored(ctx context.Context, k int64) ([]byte, int64, int64, error) {
	q := c.q
	per := q.h.clusterSize * 8 >> q.h.refcountOrder
	i := k / per
	if i >= int64(len(c.rt)) {
		return nil, 0, 0, nil
	}
	off := int64(c.rt[i] & refcountTableMask)
	if off == 0 {
		return nil, 0, 0, nil
	}
	if off%q.h.clusterSize != 0 || off+q.h.clusterSize > q.fileSize {
		return nil, 0, 0, fmt.Errorf("refcount block %d at %#x is misaligned or outside the image", i, off)
	}
	b, ok := c.blocks[off]
	if !ok {
		raw, err := q.refcountBlock(ctx, off)
		if err != nil {
			return nil, 0, 0, err
		}
		b = slices.Clone(raw)
		c.blocks[off] = b
	}
	return b, off, k % per, nil
}

func (c *checker) refcount(ctx context.Context, k int64) (uint64, error) {
	b, _, j, err := c.stored(ctx, k)
	if err != nil || b == nil {
		return 0, err
	}
	return getRefcount(b, j, 1<<c.q.h.refcountOrder), nil
}

// compare compares stored and computed refcounts, fixing what repair
// allows, and finds the end of the image.
func (c *checker) compare(ctx context.Context, repair int) error {
	q, cs := c.q, c.q.h.clusterSize
	bits := int64(1) << q.h.refcountOrder
	keys := make([]int64, 0, len(c.beyond))
	for k := range c.beyond {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	highest := int64(0)
	check := func(k int64) {
		have, err := c.refcount(ctx, k)
		if err != nil {
			c.report(&c.res.CheckErrors, "Can't get refcount for cluster %d: %v", k, err)
			return
		}
		want := c.computed(k)
		if have > 0 || want > 0 {
			highest = k
		}
		if have == want {
			return
		}
		fix := have > want && repair&RepairLeaks != 0 || have < want && repair&RepairAll == RepairAll
		word := "Leaked"
		switch {
		case fix:
			word = "Repairing"
		case have < want:
			word = "ERROR"
		}
		c.res.Messages = append(c.res.Messages, fmt.Sprintf("%s cluster %d refcount=%d reference=%d", word, k, have, want))
		if fix {
			b, off, j, _ := c.stored(ctx, k)
			if b != nil && want <= 1<<bits-1 {
				setRefcount(b, j, bits, want)
				c.dirty[off] = true
				if have > want {
					c.res.LeaksFixed++
				} else {
					c.res.CorruptionsFixed++
				}
				return
			}
			c.res.Messages = append(c.res.Messages, fmt.Sprintf("ERROR cluster %d: no refcount block covers it; qemu-img check -r all rebuilds the refcount structure", k))
		}
		if have < want {
			c.res.Corruptions++
		} else {
			c.res.Leaks++
		}
	}
	for k := range int64(len(c.refs)) {
		check(k)
	}
	for _, k := range keys {
		check(k)
	}
	c.res.ImageEndOffset = (highest + 1) * cs
	return c.writeBlocks(ctx)
}

// writeBlocks writes the changed refcount blocks and makes them durable.
func (c *checker) writeBlocks(ctx context.Context) error {
	if len(c.dirty) == 0 {
		return nil
	}
	offs := make([]int64, 0, len(c.dirty))
	for off := range c.dirty {
		offs = append(offs, off)
	}
	slices.Sort(offs)
	for _, off := range offs {
		if _, err := c.q.f.WriteAt(ctx, c.blocks[off], off); err != nil {
			return fmt.Errorf("qcow2: write refcount block at %#x: %w", off, err)
		}
	}
	clear(c.dirty)
	if err := c.q.f.Fdatasync(ctx); err != nil {
		return fmt.Errorf("qcow2: write refcount blocks: %w", err)
	}
	return nil
}

// What copiedFlags does with a wrong COPIED flag.
const (
	countOnly   = iota // count it as a corruption
	clearExcess        // clear it where the computed refcount is not one
	fixBoth            // set it right by the stored (repaired) refcount
)

// copiedFlags checks the COPIED flags of the active L1 and L2 tables: set
// exactly where the refcount is one.
func (c *checker) copiedFlags(ctx context.Context, mode int) error {
	q, cs := c.q, c.q.h.clusterSize
	l1, err := c.readTable(ctx, int64(q.h.l1Offset), int64(q.h.l1Size))
	if err != nil {
		return err
	}
	// judge returns the entry with its flag as it should be, and whether
	// that changed it.
	judge := func(e uint64, host int64, what string) (uint64, bool) {
		var rc uint64
		var err error
		if mode == clearExcess {
			rc = c.computed(host / cs)
		} else {
			rc, err = c.refcount(ctx, host/cs)
		}
		if err != nil || (rc == 1) == (e&oflagCopied != 0) {
			return e, false // (a refcount that cannot be read: compare said so)
		}
		switch {
		case mode == fixBoth, mode == clearExcess && e&oflagCopied != 0:
			c.res.Messages = append(c.res.Messages, fmt.Sprintf("Repairing OFLAG_COPIED %s: entry=%x refcount=%d", what, e, rc))
			c.res.CorruptionsFixed++
			return e ^ oflagCopied, true
		case mode == countOnly:
			c.report(&c.res.Corruptions, "ERROR OFLAG_COPIED %s: entry=%x refcount=%d", what, e, rc)
		}
		return e, false
	}
	l1Dirty := false
	for i, e := range l1 {
		l2off := int64(e & l1OffsetMask)
		if l2off == 0 || l2off%cs != 0 {
			continue
		}
		if ne, changed := judge(e, l2off, fmt.Sprintf("L2 cluster (l1_index=%d)", i)); changed {
			l1[i], l1Dirty = ne, true
		}
		l2, err := c.readTable(ctx, l2off, q.h.l2Entries)
		if err != nil {
			return err
		}
		l2Dirty := false
		for j, e := range l2 {
			host := int64(e & l2OffsetMask)
			if e&l2Compressed != 0 || host == 0 || host%cs != 0 {
				continue
			}
			if ne, changed := judge(e, host, "data cluster"); changed {
				l2[j], l2Dirty = ne, true
			}
		}
		if l2Dirty {
			if _, err := q.f.WriteAt(ctx, encodeTable(l2), l2off); err != nil {
				return fmt.Errorf("qcow2: write L2 table at %#x: %w", l2off, err)
			}
		}
	}
	if l1Dirty {
		if _, err := q.f.WriteAt(ctx, encodeTable(l1), int64(q.h.l1Offset)); err != nil {
			return fmt.Errorf("qcow2: write the L1 table: %w", err)
		}
	}
	if mode != countOnly {
		if err := q.f.Fdatasync(ctx); err != nil {
			return fmt.Errorf("qcow2: repair COPIED flags: %w", err)
		}
	}
	return nil
}
