package qcow2

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/driver"
)

// Check and repair as qemu-img check (QEMU 7.2's qcow2_check_refcounts and
// its helpers) does them, so that the counts, exit status and repairs are
// QEMU's (docs/formats.md, Checks). Stored refcount above computed is a
// leak; below, a corruption (a write could reuse a cluster in use).
//
// A refcount table that cannot be trusted is rebuilt under -r all in fresh
// clusters at the end of the file, the header switched to them in one
// write once they are durable; -r leaks refuses such an image untouched:
// fixing leaks through a table that points into guest data would write
// refcounts over that data.
//
// It reads the metadata itself rather than through an open Image, so that
// the images an Image refuses (corrupt, dirty, tables past the end of the
// file, a broken snapshot table) can be checked and repaired. What lies
// past the end of the file reads as zeroes, as in QEMU.

// RepairLeaks and RepairAll are what Check may fix (qemu-img check -r).
const (
	RepairNone  = driver.RepairNone
	RepairLeaks = driver.RepairLeaks
	RepairAll   = driver.RepairAll // leaks, refcounts too low, COPIED flags, rebuilds
)

// Masks of QEMU's qcow2.h.
const (
	refcountTableMask = 0xfffffffffffffe00 // REFT_OFFSET_MASK
	reftReserved      = 0x1ff              // REFT_RESERVED_MASK
	l1Reserved        = 0x7f000000000001ff // L1E_RESERVED_MASK
	l2StdReserved     = 0x3f000000000001fe // L2E_STD_RESERVED_MASK
)

// maxCheckClusters is QEMU's bound on the clusters a check covers (INT_MAX):
// a larger file is refused ("File too large") before anything is held.
const maxCheckClusters = math.MaxInt32

// ErrNeedRebuild is a repair refused because only a rebuild of the
// refcount structures (check -r all) can fix the image.
var ErrNeedRebuild = errors.New("need to rebuild refcount structures; repair with check -r all")

// errFileTooLarge is QEMU's EFBIG: more clusters than a check handles.
var errFileTooLarge = errors.New("file too large")

// Check checks the qcow2 image in f, repairing what repair allows (f must
// then be writable), and reports in qemu-img check's terms. As qemu-img
// does, a repair is followed by a second check, whose findings are the
// result, with the first one's fixed counts. A check that cannot finish
// returns an error (qemu-img's "Check failed"). f is closed.
func Check(ctx context.Context, f aio.File, _ driver.Options, repair int) (formats.CheckResult, error) {
	defer f.Close()
	res, err := checkOnce(ctx, f, repair)
	if err != nil || res.LeaksFixed+res.CorruptionsFixed == 0 {
		return res, err
	}
	again, err := checkOnce(ctx, f, RepairNone)
	again.LeaksFixed, again.CorruptionsFixed = res.LeaksFixed, res.CorruptionsFixed
	again.Messages = append(res.Messages, again.Messages...)
	return again, err
}

// checker is one check's state.
type checker struct {
	f      aio.File
	q      *Image // header and helpers only; nothing is opened
	h      *header
	res    *formats.CheckResult
	repair int

	fileLen int64
	nb      int64 // clusters the file covers: the range compared
	rt      []uint64
	rtOff   int64
	l1      []uint64
	snaps   []snapshotEntry
	snapOff int64
	snapLen int64
	// snapRaw is each snapshot entry as read; snapCorruptions counts the
	// entries that must be rewritten (QEMU's snapshot check result).
	snapRaw         []snapRaw
	snapCorruptions int64

	imrt    *imrt
	rebuild bool
	// preCleared holds, by file offset, the L1 and L2 entries whose
	// COPIED flag -r all cleared before raising refcounts, as they were:
	// the flag pass judges and counts them as found.
	preCleared map[int64]uint64
	// blocks caches the stored refcount blocks read (at most
	// blockCacheBytes of clean ones); dirty marks those changed and not
	// yet written.
	blocks map[int64][]byte
	dirty  map[int64]bool
	meta   *metaMap // for the overlap checks of repairs; nil: stale
}

func checkOnce(ctx context.Context, f aio.File, repair int) (formats.CheckResult, error) {
	res := formats.CheckResult{Filename: f.Name(), Format: "qcow2"}
	c := &checker{f: f, res: &res, repair: repair, blocks: map[int64][]byte{}, dirty: map[int64]bool{}}
	if err := c.load(ctx); err != nil {
		return res, err
	}
	if err := c.readSnapshotTable(ctx); err != nil {
		return res, err
	}
	cs := c.h.clusterSize
	c.nb = (c.fileLen + cs - 1) / cs
	if c.nb > maxCheckClusters {
		res.CheckErrors++
		return res, fmt.Errorf("qcow2: %s: %w (%d clusters; qemu-img checks at most %d)", f.Name(), errFileTooLarge, c.nb, maxCheckClusters)
	}
	res.TotalClusters = (int64(c.h.size) + cs - 1) / cs
	if err := c.calculate(ctx, repair); err != nil {
		return res, err
	}
	pre := res // the counts before compare; its messages are not kept
	highest, err := c.compare(ctx, RepairNone)
	if err != nil {
		return res, err
	}

	all := repair&RepairAll == RepairAll
	if all && (c.rebuild || res.Corruptions > 0) {
		if err := c.clearExcessCopied(ctx); err != nil {
			return res, err
		}
	}
	switch {
	case c.rebuild && all:
		if highest, err = c.rebuildRefcounts(ctx); err != nil {
			return res, err
		}
	case repair != RepairNone:
		if c.rebuild {
			res.CheckErrors++
			res.Messages = append(res.Messages, "ERROR need to rebuild refcount structures")
			return res, fmt.Errorf("qcow2: %s: %w", f.Name(), ErrNeedRebuild)
		}
		if res.Leaks != 0 || res.Corruptions != 0 {
			pre.Messages = res.Messages
			res = pre
			if highest, err = c.compare(ctx, repair); err != nil {
				return res, err
			}
		}
	}
	if err := c.copiedFlags(ctx, repair); err != nil {
		return res, err
	}
	res.ImageEndOffset = (highest + 1) * cs
	if c.snapCorruptions > 0 {
		res.Corruptions += c.snapCorruptions
		if all {
			if err := c.rewriteSnapshotTable(ctx); err != nil {
				return res, err
			}
		}
	}
	if repair != RepairNone && res.CheckErrors == 0 && res.Corruptions == 0 && c.h.incompatible&(incDirty|incCorrupt) != 0 {
		// Repaired: the image is clean and consistent again.
		if err := writeHeaderField(ctx, f, hdrIncompatible, c.h.incompatible&^(incDirty|incCorrupt)); err != nil {
			return res, fmt.Errorf("qcow2: clear the dirty and corrupt bits: %w", err)
		}
	}
	return res, nil
}

// load reads the header, the refcount table and the active L1 table, with
// the checks QEMU's open makes (alignment, size limits) and none that
// would keep a damaged image from its check: tables past the end of the
// file read as zeroes.
func (c *checker) load(ctx context.Context) error {
	fileLen, head, err := readHead(ctx, c.f)
	if err != nil {
		return err
	}
	c.fileLen = fileLen
	// The snapshot table is the check's to read and judge, as in QEMU's
	// check mode, not the header parser's: it is taken out of the copy.
	parsed := slices.Clone(head)
	if len(parsed) >= hdrSnapshotsOffset+8 {
		clear(parsed[hdrNbSnapshots : hdrSnapshotsOffset+8])
	}
	h, err := parseHeader(parsed, math.MaxInt64)
	if err != nil {
		return fmt.Errorf("%s: %w", c.f.Name(), err)
	}
	be := binary.BigEndian
	h.nbSnapshots = be.Uint32(head[hdrNbSnapshots:])
	h.snapshotsOffset = be.Uint64(head[hdrSnapshotsOffset:])
	c.h = h
	c.q = &Image{f: c.f, path: c.f.Name(), h: h, fileSize: c.fileLen}
	c.rtOff = int64(h.refcountOffset)
	if c.rt, err = c.readTable(ctx, c.rtOff, int64(h.refcountClusters)*h.clusterSize/8); err != nil {
		return err
	}
	c.l1, err = c.readTable(ctx, int64(h.l1Offset), int64(h.l1Size))
	return err
}

// readSnapshotTable reads the snapshot table as QEMU's check does: a
// pointer that is misaligned, out of range or names too many snapshots
// fails the check; entries past the end of the file read as zeroes.
func (c *checker) readSnapshotTable(ctx context.Context) error {
	n := int64(c.h.nbSnapshots)
	off := c.h.snapshotsOffset
	c.snapOff = int64(off)
	if n == 0 {
		return nil
	}
	fail := func(format string, args ...any) error {
		c.res.CheckErrors++
		msg := fmt.Sprintf(format, args...)
		c.res.Messages = append(c.res.Messages, "ERROR "+msg)
		return fmt.Errorf("qcow2: %s: %s", c.f.Name(), msg)
	}
	if n > maxSnapshots {
		return fail("snapshot table too large (%d snapshots, at most %d); qemu-img check -r all drops the overhanging ones, this check refuses", n, maxSnapshots)
	}
	if uint64(math.MaxInt64)-uint64(n*snapshotHeaderLen) < off || int64(off)%c.h.clusterSize != 0 {
		return fail("snapshot table offset invalid (%#x)", off)
	}
	be := binary.BigEndian
	pos, length := int64(off), int64(0)
	for i := range n {
		pos = (pos + 7) &^ 7
		length = (length + 7) &^ 7
		var hdr [snapshotHeaderLen]byte
		if err := c.readAt(ctx, hdr[:], pos); err != nil {
			return fail("failed to read the snapshot table: %v", err)
		}
		idLen := int64(be.Uint16(hdr[12:]))
		nameLen := int64(be.Uint16(hdr[14:]))
		extraLen := int64(be.Uint32(hdr[36:]))
		keep := extraLen // the extra data kept
		if extraLen > maxSnapshotExtra {
			if c.repair&RepairAll != RepairAll {
				return fail("failed to read the snapshot table: too much extra metadata in snapshot table entry %d (qemu-img check -r all discards it)", i)
			}
			// As QEMU: the excess is dropped, the table rewritten.
			c.res.Messages = append(c.res.Messages, fmt.Sprintf("Discarding too much extra metadata in snapshot table entry %d (%d > %d)", i, extraLen, maxSnapshotExtra))
			c.snapCorruptions++
			keep = maxSnapshotExtra
		}
		extra := make([]byte, keep)
		names := make([]byte, idLen+nameLen)
		if err := c.readAt(ctx, extra, pos+snapshotHeaderLen); err != nil {
			return fail("failed to read the snapshot table: %v", err)
		}
		if err := c.readAt(ctx, names, pos+snapshotHeaderLen+extraLen); err != nil {
			return fail("failed to read the snapshot table: %v", err)
		}
		pos += snapshotHeaderLen + extraLen + idLen + nameLen
		length += snapshotHeaderLen + keep + idLen + nameLen
		if length > maxSnapshotTableBytes || pos-int64(off) > math.MaxInt32 {
			return fail("failed to read the snapshot table: snapshot table is too big")
		}
		if c.h.version >= 3 && extraLen < 16 {
			// Version 3 entries carry at least the VM state size and
			// the disk size as extra data.
			c.res.Messages = append(c.res.Messages, fmt.Sprintf("%s snapshot table entry %d is incomplete", findingWord(c.repair&RepairAll == RepairAll), i))
			c.snapCorruptions++
		}
		c.snapRaw = append(c.snapRaw, snapRaw{hdr: hdr, extra: extra})
		c.snaps = append(c.snaps, snapshotEntry{
			Snapshot: formats.Snapshot{ID: string(names[:idLen]), Name: string(names[idLen:])},
			l1Offset: int64(be.Uint64(hdr[0:])),
			l1Size:   int64(be.Uint32(hdr[8:])),
		})
	}
	c.snapLen = pos - int64(off)
	return nil
}

// maxIOOffset is QEMU's BDRV_MAX_LENGTH: a request ending beyond it fails
// (EIO) rather than reading zeroes.
const maxIOOffset = math.MaxInt64 - (1<<30 - 1)

// errIO is a read QEMU's block layer refuses.
var errIO = errors.New("input/output error")

// readAt reads p at off; what lies past the end of the file reads as
// zeroes, as in QEMU, and a range past what any file can hold fails.
func (c *checker) readAt(ctx context.Context, p []byte, off int64) error {
	clear(p)
	if off < 0 || off > maxIOOffset-int64(len(p)) {
		return fmt.Errorf("qcow2: read %d bytes at %#x: %w", len(p), uint64(off), errIO)
	}
	if off >= c.fileLen {
		return nil
	}
	if _, err := c.f.ReadAt(ctx, p, off); err != nil && err != io.EOF {
		return fmt.Errorf("qcow2: read %d bytes at %#x: %w", len(p), off, err)
	}
	return nil
}

// readTable reads n big-endian entries at off.
func (c *checker) readTable(ctx context.Context, off, n int64) ([]uint64, error) {
	raw := make([]byte, n*8)
	if err := c.readAt(ctx, raw, off); err != nil {
		return nil, err
	}
	return decodeTable(raw), nil
}

// findingWord starts a finding's message as qemu-img does: "Repairing"
// when this check repairs it, "ERROR" when not.
func findingWord(repairs bool) string {
	if repairs {
		return "Repairing"
	}
	return "ERROR"
}

func (c *checker) report(counter *int64, format string, args ...any) {
	*counter++
	c.res.Messages = append(c.res.Messages, fmt.Sprintf(format, args...))
}

// calculate computes the refcounts of every cluster from the references
// (QEMU's calculate_refcounts), finding what must be rebuilt.
func (c *checker) calculate(ctx context.Context, repair int) error {
	c.imrt = newIMRT(c.refcountMax())
	cs := c.h.clusterSize
	c.inc(0, cs) // the header
	if err := c.l1Refs(ctx, int64(c.h.l1Offset), int64(c.h.l1Size), true, repair); err != nil {
		return err
	}
	for _, sn := range c.snaps {
		if uint64(sn.l1Offset)%uint64(cs) != 0 {
			c.report(&c.res.Corruptions, "ERROR snapshot %s (%s) l1_offset=%#x: L1 table is not cluster aligned; snapshot table entry corrupted", sn.ID, sn.Name, uint64(sn.l1Offset))
			continue
		}
		if sn.l1Size > maxL1Bytes/8 {
			c.report(&c.res.Corruptions, "ERROR snapshot %s (%s) l1_size=%#x: L1 table is too large; snapshot table entry corrupted", sn.ID, sn.Name, sn.l1Size)
			continue
		}
		if err := c.l1Refs(ctx, sn.l1Offset, sn.l1Size, false, repair); err != nil {
			return err
		}
	}
	c.inc(c.snapOff, c.snapLen)
	c.inc(c.rtOff, int64(len(c.rt))*8)
	if err := c.bitmapRefs(ctx); err != nil {
		return err
	}
	return c.refblocks(repair)
}

// refcountMax is the largest refcount an entry holds.
func (c *checker) refcountMax() uint64 {
	bits := uint64(1) << c.h.refcountOrder
	if bits >= 32 {
		return math.MaxUint32 // the computed counts are 32-bit; no image comes near
	}
	return 1<<bits - 1
}

// inc counts one more reference to every cluster [off, off+n) touches
// (QEMU's qcow2_inc_refcounts_imrt): a range ending a cluster or more past
// the end of the file is a corruption and counts nothing.
func (c *checker) inc(off, n int64) {
	if n <= 0 {
		return
	}
	cs := c.h.clusterSize
	if off < 0 || off > math.MaxInt64-n || off+n-c.fileLen >= cs {
		c.report(&c.res.Corruptions, "ERROR: counting reference for region exceeding the end of the file by one cluster or more: offset %#x size %#x", uint64(off), n)
		return
	}
	for k := off / cs; k <= (off+n-1)/cs; k++ {
		if !c.imrt.inc(k) {
			c.report(&c.res.Corruptions, "ERROR: overflow cluster offset=%#x", k*cs)
		}
	}
}

// l1Refs counts an L1 table, its L2 tables and the clusters they map
// (QEMU's check_refcounts_l1); active (the image's own table, not a
// snapshot's) also counts the allocation figures.
func (c *checker) l1Refs(ctx context.Context, off, size int64, active bool, repair int) error {
	if size == 0 {
		return nil
	}
	cs := c.h.clusterSize
	c.inc(off, size*8)
	l1, err := c.readTable(ctx, off, size)
	if err != nil {
		c.report(&c.res.CheckErrors, "ERROR: I/O error in check_refcounts_l1")
		return err
	}
	for _, e := range l1 {
		if e == 0 {
			continue
		}
		if e&l1Reserved != 0 {
			c.report(&c.res.Corruptions, "ERROR found L1 entry with reserved bits set: %x", e)
		}
		l2off := int64(e & l1OffsetMask)
		c.inc(l2off, cs)
		if l2off%cs != 0 {
			c.report(&c.res.Corruptions, "ERROR l2_offset=%x: Table is not cluster aligned; L1 entry corrupted", l2off)
		}
		if err := c.l2Refs(ctx, l2off, active, repair); err != nil {
			return err
		}
	}
	return nil
}

// l2Refs is QEMU's check_refcounts_l2.
func (c *checker) l2Refs(ctx context.Context, l2off int64, active bool, repair int) error {
	q, cs := c.q, c.h.clusterSize
	l2, err := c.readTable(ctx, l2off, c.h.l2Entries)
	if err != nil {
		c.report(&c.res.CheckErrors, "ERROR: I/O error in check_refcounts_l2")
		return err
	}
	var next int64 // where a contiguous cluster would lie
	for i, e := range l2 {
		if e&l2Compressed == 0 && e&l2StdReserved != 0 {
			c.report(&c.res.Corruptions, "ERROR found l2 entry with reserved bits set: %x", e)
		}
		switch {
		case e&l2Compressed != 0:
			if e&oflagCopied != 0 {
				host, _ := q.compressedEntry(e &^ oflagCopied)
				c.report(&c.res.Corruptions, "ERROR: coffset=%#x: copied flag must never be set for compressed clusters", host)
				e &^= oflagCopied
			}
			host, sectors := q.compressedEntry(e)
			c.inc(host, sectors*512-host%512)
			if active {
				c.res.AllocatedClusters++
				c.res.CompressedClusters++
				c.res.FragmentedClusters++ // by nature, as QEMU counts them
			}
		case e&l2OffsetMask != 0: // data, or zero with a preallocated cluster
			host := int64(e & l2OffsetMask)
			if host%cs != 0 {
				c.res.Corruptions++
				if e&l2ZeroFlag == 0 {
					c.res.Messages = append(c.res.Messages, fmt.Sprintf("ERROR offset=%x: Data cluster is not properly aligned; L2 entry corrupted.", host))
				} else {
					c.res.Messages = append(c.res.Messages, fmt.Sprintf("%s offset=%x: Preallocated cluster is not properly aligned; L2 entry corrupted.", findingWord(repair&RepairAll == RepairAll), host))
					if repair&RepairAll == RepairAll {
						// A zero cluster whose preallocation is broken
						// becomes a plain zero cluster: it reads the same.
						allow := metaL2
						if !active {
							allow = metaNone // an inactive L2 table is not in the map
						}
						if err := c.writeMeta(ctx, binary.BigEndian.AppendUint64(nil, l2ZeroFlag), l2off+int64(i)*8, allow, "L2 entry", true); err != nil {
							return err
						}
						c.res.Corruptions--
						c.res.CorruptionsFixed++
						continue
					}
				}
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
	return nil
}

// refblocks checks the refcount table's entries and counts the blocks
// (QEMU's check_refblocks).
func (c *checker) refblocks(repair int) error {
	cs := c.h.clusterSize
	all := repair&RepairAll == RepairAll
	for i, e := range c.rt {
		off := e & refcountTableMask
		if e&reftReserved != 0 {
			c.report(&c.res.Corruptions, "ERROR refcount table entry %d has reserved bits set", i)
			c.rebuild = true
			continue
		}
		if off%uint64(cs) != 0 {
			c.report(&c.res.Corruptions, "ERROR refcount block %d is not cluster aligned; refcount table entry corrupted", i)
			c.rebuild = true
			continue
		}
		k := off / uint64(cs)
		if k >= uint64(c.nb) {
			c.res.Corruptions++
			c.res.Messages = append(c.res.Messages, fmt.Sprintf("%s refcount block %d is outside image", findingWord(all), i))
			if !all {
				continue
			}
			// QEMU grows the file to hold the block, which then reads
			// as zeroes (the refcounts in it are then rebuilt); a block
			// past any file size means a rebuild.
			if off > math.MaxInt64-uint64(cs) || off+uint64(cs) > uint64(maxCheckClusters)*uint64(cs) {
				c.res.Messages = append(c.res.Messages, "ERROR could not resize image: Invalid argument")
				c.rebuild = true
				continue
			}
			if err := unix.Ftruncate(c.f.Fd(), int64(off)+cs); err != nil {
				c.res.Messages = append(c.res.Messages, fmt.Sprintf("ERROR could not resize image: %v", err))
				c.rebuild = true
				continue
			}
			c.fileLen = int64(off) + cs
			c.nb = c.fileLen / cs
			c.res.Corruptions--
			c.res.CorruptionsFixed++
			c.inc(int64(off), cs)
			continue
		}
		if off != 0 {
			c.inc(int64(off), cs)
			if n := c.imrt.get(int64(k)); n != 1 {
				c.report(&c.res.Corruptions, "ERROR refcount block %d refcount=%d", i, n)
				c.rebuild = true
			}
		}
	}
	return nil
}

// stored returns the stored refcount block covering cluster k (nil: none)
// and k's index in it; an error for a block that cannot be read (QEMU's
// qcow2_get_refcount fails on a misaligned one).
func (c *checker) stored(ctx context.Context, k int64) ([]byte, int64, int64, error) {
	per := c.perBlock()
	i := k / per
	if i >= int64(len(c.rt)) {
		return nil, 0, 0, nil
	}
	off := c.rt[i] & refcountTableMask
	if off == 0 {
		return nil, 0, 0, nil
	}
	if off%uint64(c.h.clusterSize) != 0 {
		return nil, 0, 0, fmt.Errorf("refblock offset %#x unaligned (reftable index: %#x)", off, i)
	}
	b, ok := c.blocks[int64(off)]
	if !ok {
		if int64(len(c.blocks))*c.h.clusterSize >= blockCacheBytes {
			for k := range c.blocks {
				if !c.dirty[k] {
					delete(c.blocks, k)
				}
			}
		}
		b = make([]byte, c.h.clusterSize)
		if err := c.readAt(ctx, b, int64(off)); err != nil {
			return nil, 0, 0, err
		}
		c.blocks[int64(off)] = b
	}
	return b, int64(off), k % per, nil
}

// blockCacheBytes bounds the clean refcount blocks a check keeps: memory
// follows the computed refcounts, not the number of blocks.
const blockCacheBytes = 32 << 20

func (c *checker) perBlock() int64 { return c.h.clusterSize * 8 >> c.h.refcountOrder }

func (c *checker) refcount(ctx context.Context, k int64) (uint64, error) {
	b, _, j, err := c.stored(ctx, k)
	if err != nil || b == nil {
		return 0, err
	}
	return getRefcount(b, j, 1<<c.h.refcountOrder), nil
}

// compare compares stored and computed refcounts (QEMU's
// compare_refcounts), fixing what repair allows: it counts, finds what
// needs a rebuild, and returns the highest cluster in use.
func (c *checker) compare(ctx context.Context, repair int) (int64, error) {
	highest := int64(0)
	per := c.perBlock()
	bits := int64(1) << c.h.refcountOrder
	for first := int64(0); first < c.nb; first += per {
		last := min(first+per, c.nb)
		// A range with no block and nothing referenced is all zeroes on
		// both sides: skipped whole, so a sparse file costs its table.
		i := first / per
		if (i >= int64(len(c.rt)) || c.rt[i]&refcountTableMask == 0) && !c.imrt.any(first, last) {
			continue
		}
		for k := first; k < last; k++ {
			have, err := c.refcount(ctx, k)
			if err != nil {
				c.report(&c.res.CheckErrors, "Can't get refcount for cluster %d: %v", k, err)
				continue
			}
			want := c.imrt.get(k)
			if have > 0 || want > 0 {
				highest = k
			}
			if have == want {
				continue
			}
			var fixed *int64
			switch {
			case have == 0:
				c.rebuild = true
			case have > want && repair&RepairLeaks != 0:
				fixed = &c.res.LeaksFixed
			case have < want && repair&RepairAll == RepairAll:
				fixed = &c.res.CorruptionsFixed
			}
			word := "Leaked"
			switch {
			case fixed != nil:
				word = "Repairing"
			case have < want:
				word = "ERROR"
			}
			c.res.Messages = append(c.res.Messages, fmt.Sprintf("%s cluster %d refcount=%d reference=%d", word, k, have, want))
			if fixed != nil {
				// (have is not zero: the block exists and was read.)
				b, off, j, _ := c.stored(ctx, k)
				setRefcount(b, j, bits, want)
				c.dirty[off] = true
				*fixed++
				continue
			}
			if have < want {
				c.res.Corruptions++
			} else {
				c.res.Leaks++
			}
		}
	}
	return highest, c.flushBlocks(ctx)
}

// writeMeta writes metadata b at off, after the overlap check (allow: the
// kind being written), durably if sync.
func (c *checker) writeMeta(ctx context.Context, b []byte, off int64, allow metaKind, what string, sync bool) error {
	if name := c.overlaps(off, int64(len(b)), allow); name != "" {
		c.report(&c.res.CheckErrors, "ERROR: Could not write %s; metadata overlap check failed: %d bytes at %#x overlap the %s", what, len(b), off, name)
		return fmt.Errorf("%w: preventing invalid write on metadata: %s of %d bytes at %#x would overlap the %s", ErrCorrupt, what, len(b), off, name)
	}
	if _, err := c.f.WriteAt(ctx, b, off); err != nil {
		c.res.CheckErrors++
		return fmt.Errorf("qcow2: write %s at %#x: %w", what, off, err)
	}
	if !sync {
		return nil
	}
	if err := c.f.Fdatasync(ctx); err != nil {
		c.res.CheckErrors++
		return fmt.Errorf("qcow2: write %s at %#x: %w", what, off, err)
	}
	return nil
}

// overlaps names the metadata other than allow that n bytes at off would
// land on ("": none): QEMU's default overlap checks, the bitmap directory
// included.
func (c *checker) overlaps(off, n int64, allow metaKind) string {
	if c.meta == nil {
		c.meta = c.metadata()
	}
	cs := c.h.clusterSize
	first, end := off/cs, (off+n+cs-1)/cs
	dirOff, dirSize := int64(c.h.bitmaps.dirOffset), int64(c.h.bitmaps.dirSize)
	switch {
	case off < cs:
		return metaHeader.String()
	case c.h.hasBitmaps && dirSize > 0 && first < (dirOff+dirSize+cs-1)/cs && dirOff/cs < end:
		return "bitmap directory"
	}
	if k := c.meta.overlap(first, end, allow); k != metaNone {
		return k.String()
	}
	return ""
}

// metadata maps the image's metadata for the overlap checks, as QEMU's
// default checks see it (inactive L2 tables are not in it, as there).
func (c *checker) metadata() *metaMap {
	return newMetaMap(c.h.clusterSize, c.l1, int64(c.h.l1Offset), c.rt, c.rtOff, refcountTableMask, c.snapOff, c.snapLen, c.snaps)
}

// copiedFlags checks the COPIED flags of the active L1 and L2 tables: set
// exactly where the stored refcount is one (QEMU's check_oflag_copied).
// -r all repairs them; -r leaks too, where the refcounts are now right.
func (c *checker) copiedFlags(ctx context.Context, repair int) error {
	cs := c.h.clusterSize
	fix := repair&RepairAll == RepairAll ||
		repair&RepairLeaks != 0 && c.res.CheckErrors == 0 && c.res.Corruptions == 0 && c.res.Leaks == 0
	word := findingWord(fix)
	// want is entry e with its flag as refcount rc says.
	want := func(e, rc uint64) uint64 {
		if rc == 1 {
			return e | oflagCopied
		}
		return e &^ oflagCopied
	}
	for i, cur := range c.l1 {
		l2off := int64(cur & l1OffsetMask)
		if l2off == 0 {
			continue
		}
		at := int64(c.h.l1Offset) + int64(i)*8
		e := c.original(at, cur)
		rc, err := c.refcount(ctx, l2off/cs)
		if err != nil {
			continue // compare has said so
		}
		ne := want(e, rc)
		if ne != e {
			c.report(&c.res.Corruptions, "%s OFLAG_COPIED L2 cluster: l1_index=%d l1_entry=%x refcount=%d", word, i, e, rc)
		}
		if fix && ne != cur {
			if err := c.writeMeta(ctx, binary.BigEndian.AppendUint64(nil, ne), at, metaL1, "L1 entry", true); err != nil {
				return err
			}
			c.l1[i] = ne
		}
		if fix && ne != e {
			c.res.Corruptions--
			c.res.CorruptionsFixed++
		}
		l2, err := c.readTable(ctx, l2off, c.h.l2Entries)
		if err != nil {
			c.report(&c.res.CheckErrors, "ERROR: Could not read L2 table: %v", err)
			return err
		}
		fixed, changed := int64(0), false
		for j, cur := range l2 {
			e := c.original(l2off+int64(j)*8, cur)
			host := int64(e & l2OffsetMask)
			if e&l2Compressed != 0 || host == 0 {
				continue
			}
			rc, err := c.refcount(ctx, host/cs)
			if err != nil {
				continue
			}
			ne := want(e, rc)
			if ne != e {
				c.report(&c.res.Corruptions, "%s OFLAG_COPIED data cluster: l2_entry=%x refcount=%d", word, e, rc)
				if fix {
					fixed++
				}
			}
			if fix && ne != cur {
				l2[j], changed = ne, true
			}
		}
		if changed {
			if err := c.writeMeta(ctx, encodeTable(l2), l2off, metaL2, "L2 table", true); err != nil {
				return err
			}
		}
		c.res.Corruptions -= fixed
		c.res.CorruptionsFixed += fixed
	}
	return nil
}

// original is the entry at file offset at as the check found it (cur is
// what the file holds now).
func (c *checker) original(at int64, cur uint64) uint64 {
	if e, ok := c.preCleared[at]; ok {
		return e
	}
	return cur
}

// clearExcessCopied clears, before -r all raises a refcount or rebuilds
// the refcount structures, every COPIED flag of the active tables on a
// cluster whose computed refcount is not one, and makes that durable.
// QEMU fixes the flags after the refcounts; killed in between, its image
// has a shared cluster marked COPIED, which the next write would
// overwrite in place under the snapshot sharing it. Cleared first, the
// worst a kill leaves is a flag missing: a copy on the next write. The
// flag pass then judges these entries as they were found, so the counts
// are QEMU's. A table whose write the overlap check refuses is left to
// the flag pass, as in QEMU.
func (c *checker) clearExcessCopied(ctx context.Context) error {
	cs := c.h.clusterSize
	c.preCleared = map[int64]uint64{}
	excess := func(e uint64, host int64) bool {
		return e&oflagCopied != 0 && c.imrt.get(host/cs) != 1
	}
	wrote := false
	for i, e := range c.l1 {
		l2off := int64(e & l1OffsetMask)
		if l2off == 0 {
			continue
		}
		if l2, err := c.readTable(ctx, l2off, c.h.l2Entries); err == nil {
			changed := map[int64]uint64{}
			for j, le := range l2 {
				host := int64(le & l2OffsetMask)
				if le&l2Compressed == 0 && host != 0 && excess(le, host) {
					changed[l2off+int64(j)*8] = le
					l2[j] = le &^ oflagCopied
				}
			}
			if len(changed) > 0 {
				ok, err := c.writeQuiet(ctx, encodeTable(l2), l2off, metaL2)
				if err != nil {
					return err
				}
				if ok {
					maps.Copy(c.preCleared, changed)
					wrote = true
				}
			}
		}
		if excess(e, l2off) {
			at := int64(c.h.l1Offset) + int64(i)*8
			ok, err := c.writeQuiet(ctx, binary.BigEndian.AppendUint64(nil, e&^oflagCopied), at, metaL1)
			if err != nil {
				return err
			}
			if ok {
				c.preCleared[at] = e
				c.l1[i] = e &^ oflagCopied
				wrote = true
			}
		}
	}
	if !wrote {
		return nil
	}
	if err := c.f.Fdatasync(ctx); err != nil {
		c.res.CheckErrors++
		return fmt.Errorf("qcow2: clear COPIED flags: %w", err)
	}
	return nil
}

// writeQuiet writes metadata b at off if the overlap check allows it,
// saying nothing when it does not (false: the caller leaves that to a
// later pass that reports it); a failed write is an error all the same.
func (c *checker) writeQuiet(ctx context.Context, b []byte, off int64, allow metaKind) (bool, error) {
	if c.overlaps(off, int64(len(b)), allow) != "" {
		return false, nil
	}
	if _, err := c.f.WriteAt(ctx, b, off); err != nil {
		c.res.CheckErrors++
		return false, fmt.Errorf("qcow2: clear COPIED flags at %#x: %w", off, err)
	}
	return true, nil
}
