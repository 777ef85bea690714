package qcow2

import (
	"context"
	"encoding/binary"
	"fmt"
	"slices"
	"sync/atomic"
)

// Persistent dirty bitmaps of a writable image, kept as QEMU keeps them
// (qcow2-bitmap.c):
//
//   - At open every enabled bitmap ("auto") that is consistent is read into
//     memory and marked in use in the directory, in place, durably, before
//     the first guest write: a crash from then on leaves it in use, which
//     tells every tool that it missed writes.
//   - Every write, write-zeroes and discard marks the granularity-sized
//     blocks it touches in those bitmaps.
//   - At a clean close they are stored back: new data clusters (all-zero
//     ones as table entry 0) and tables, allocated as any cluster is, then a
//     new directory without the in-use flags, made durable before the
//     header extension points at it; the old clusters are freed after.
//
// Disabled bitmaps and those already in use at open (QEMU loads those as
// inconsistent and never stores them) are left exactly as they are. All
// bitmap clusters count as metadata for the overlap checks (metaBitmap),
// so neither a guest write nor an allocation can land on them.

// maxLiveBitmapBytes bounds the memory the enabled bitmaps of one image
// take (a 2 TiB disk takes 4 MiB per bitmap at 64 KiB granularity, 512
// MiB at 512 bytes): a crafted directory of many fine-grained bitmaps
// over a large disk must not exhaust memory at open.
const maxLiveBitmapBytes = 1 << 30

// bitmapSet is what a writable image keeps of its bitmaps.
type bitmapSet struct {
	entries []bitmapEntry
	tables  [][]uint64 // each entry's table as on disk
	dirOff  int64
	dirSize int64
	live    []*liveBitmap
	// lost: a resize left every bitmap in use (bitmapresize.go).
	lost error
}

// liveBitmap is an enabled bitmap in memory: bit i is the granularity-sized
// block at i<<granBits, words little-endian as the data clusters hold them.
type liveBitmap struct {
	entry    int // in bitmapSet.entries
	granBits uint8
	nbits    uint64
	words    []atomic.Uint64
	// disabled: loaded only to be resized (bitmapresize.go); writes do
	// not mark it.
	disabled bool
}

// mark sets the bits of every block [off, off+n) touches. Lock-free: any
// number of writers mark at once.
func (b *liveBitmap) mark(off, n int64) {
	if n <= 0 || off < 0 || b.nbits == 0 {
		return
	}
	first := uint64(off) >> b.granBits
	last := min(uint64(off+n-1)>>b.granBits, b.nbits-1)
	if first > last {
		return
	}
	for w := first / 64; w <= last/64; w++ {
		mask := ^uint64(0)
		if w == first/64 {
			mask &= ^uint64(0) << (first % 64)
		}
		if w == last/64 {
			mask &= ^uint64(0) >> (63 - last%64)
		}
		if b.words[w].Load()&mask != mask {
			b.words[w].Or(mask)
		}
	}
}

// markDirty marks [off, off+n) in every enabled bitmap; called before
// each guest-visible change, under w.users (a resize swaps the bits under
// its write lock).
func (q *Image) markDirty(off, n int64) {
	if q.w == nil || q.w.bitmaps == nil {
		return
	}
	for _, b := range q.w.bitmaps.live {
		if !b.disabled {
			b.mark(off, n)
		}
	}
}

// openBitmaps reads the bitmaps of an image being opened for writing and
// marks the enabled ones in use. A directory or table that fails any
// check refuses the open: writing without keeping its bitmaps would leave
// them wrong. The caller has set up q.w and its metadata map.
func (q *Image) openBitmaps(ctx context.Context) error {
	if !q.h.hasBitmaps {
		return nil
	}
	dir, entries, err := q.readBitmapDirectory(ctx)
	if err != nil {
		return fmt.Errorf("persistent dirty bitmaps, which a writer must keep: %w", err)
	}
	s := &bitmapSet{entries: entries, dirOff: int64(q.h.bitmaps.dirOffset), dirSize: int64(len(dir))}
	cs := q.h.clusterSize
	fileSize := q.fileSize
	memory := uint64(0)
	for _, b := range entries {
		if b.flags&(bmFlagAuto|bmFlagInUse) == bmFlagAuto {
			memory += (bitmapBits(q.Size(), b.granBits) + 63) / 64 * 8
		}
	}
	if memory > maxLiveBitmapBytes {
		return fmt.Errorf("%w: the enabled dirty bitmaps would take %d bytes of memory (at most %d)", ErrUnsupported, memory, maxLiveBitmapBytes)
	}
	if err := q.claimBitmapClusters(s.dirOff, s.dirSize, "bitmap directory"); err != nil {
		return err
	}
	for i := range entries {
		b := &entries[i]
		if err := q.claimBitmapClusters(b.tableOff, b.tableSize*8, fmt.Sprintf("table of bitmap %q", b.name)); err != nil {
			return err
		}
		t, err := q.readBitmapTable(ctx, b, fileSize)
		if err != nil {
			return err
		}
		s.tables = append(s.tables, t)
		for _, e := range t {
			if off := int64(e & bmTableOffsetMask); off != 0 {
				if err := q.claimBitmapClusters(off, cs, fmt.Sprintf("data of bitmap %q", b.name)); err != nil {
					return err
				}
			}
		}
		if b.flags&(bmFlagAuto|bmFlagInUse) != bmFlagAuto || q.editBitmaps {
			continue // disabled, inconsistent already, or to be edited: left alone
		}
		live, err := q.loadBitmap(ctx, i, b, t)
		if err != nil {
			return err
		}
		s.live = append(s.live, live)
		b.flags |= bmFlagInUse
		binary.BigEndian.PutUint32(dir[b.pos+12:], b.flags)
	}
	if len(s.live) > 0 {
		if _, err := q.f.WriteAt(ctx, dir, s.dirOff); err != nil {
			return fmt.Errorf("qcow2: mark bitmaps in use in the directory at %#x: %w", s.dirOff, err)
		}
		if err := q.f.Fdatasync(ctx); err != nil {
			return fmt.Errorf("qcow2: mark bitmaps in use: %w", err)
		}
	}
	q.w.bitmaps = s
	return nil
}

// claimBitmapClusters records [off, off+n) as bitmap metadata, refusing
// it when other metadata, or another bitmap structure, is there already.
// For the open, before any request can allocate.
func (q *Image) claimBitmapClusters(off, n int64, what string) error {
	cs := q.h.clusterSize
	q.meta.Lock()
	defer q.meta.Unlock()
	m := q.w.metaMap
	if k := m.overlap(off/cs, (off+n+cs-1)/cs, metaNone); k != metaNone {
		return fmt.Errorf("%w: the %s at %#x overlaps the %s", ErrCorrupt, what, off, k)
	}
	for c := off / cs; c < (off+n+cs-1)/cs; c++ {
		m.addBitmap(c, 1)
	}
	return nil
}

// releaseBitmapClusters undoes claimBitmapClusters and queues the clusters
// to be freed at the next write-back. The caller holds alloc.
func (q *Image) releaseBitmapClusters(off, n int64) {
	cs := q.h.clusterSize
	q.meta.Lock()
	for c := off / cs; c < (off+n+cs-1)/cs; c++ {
		q.w.metaMap.addBitmap(c, -1)
	}
	q.meta.Unlock()
	q.freeRangeLater(off, n)
}

// loadBitmap reads the data of the consistent bitmap b (entry i) into
// memory.
func (q *Image) loadBitmap(ctx context.Context, i int, b *bitmapEntry, table []uint64) (*liveBitmap, error) {
	cs := q.h.clusterSize
	nbits := bitmapBits(q.Size(), b.granBits)
	live := &liveBitmap{entry: i, granBits: b.granBits, nbits: nbits, words: make([]atomic.Uint64, (nbits+63)/64)}
	perCluster := cs / 8 // words one data cluster holds
	buf := make([]byte, cs)
	for t, e := range table {
		first := int64(t) * perCluster
		if first >= int64(len(live.words)) {
			break // a table longer than the disk needs (QEMU stores no more)
		}
		words := live.words[first:min(first+perCluster, int64(len(live.words)))]
		switch off := int64(e & bmTableOffsetMask); {
		case off != 0:
			if _, err := q.f.ReadAt(ctx, buf, off); err != nil {
				return nil, fmt.Errorf("qcow2: read data of bitmap %q at %#x: %w", b.name, off, err)
			}
			for k := range words {
				words[k].Store(binary.LittleEndian.Uint64(buf[k*8:]))
			}
		case e&bmTableAllOnes != 0:
			for k := range words {
				words[k].Store(^uint64(0))
			}
		}
	}
	if r := nbits % 64; r != 0 {
		last := &live.words[len(live.words)-1]
		last.Store(last.Load() & (1<<r - 1)) // no bits past the disk's end
	}
	return live, nil
}

// closeFlush is Close's write-back: everything, then the bitmaps, then
// the frees their storing queued.
func (q *Image) closeFlush(ctx context.Context) error {
	if err := q.Flush(ctx); err != nil {
		return err
	}
	s := q.w.bitmaps
	if s == nil || len(s.live) == 0 || q.corrupt.Load() {
		return nil // a corrupt image keeps its bitmaps in use: they may have missed writes
	}
	err := q.storeBitmaps(ctx, s)
	q.wrote() // the directory and the header's switch to it: the flush makes them durable
	if err != nil {
		return fmt.Errorf("qcow2: store dirty bitmaps (left marked in use): %w", err)
	}
	return q.Flush(ctx)
}

// storeBitmaps writes the enabled bitmaps to new clusters, points a new
// directory at them with their in-use flags clear, makes that durable,
// then switches the header extension to it and queues the old clusters'
// frees. A crash anywhere leaks at most, and leaves the bitmaps in use
// until the header switches. No request is in flight.
func (q *Image) storeBitmaps(ctx context.Context, s *bitmapSet) error {
	w := q.w
	cs := q.h.clusterSize
	entries := slices.Clone(s.entries)
	tables := slices.Clone(s.tables)
	for _, b := range s.live {
		if want := bitmapBits(q.Size(), b.granBits); b.nbits != want {
			// A table of another size would make QEMU refuse the image.
			return fmt.Errorf("bitmap %q holds %d bits for %d bytes, want %d", entries[b.entry].name, b.nbits, q.Size(), want)
		}
		table, err := q.storeBitmapData(ctx, b, entries[b.entry].name)
		if err != nil {
			return err
		}
		raw := encodeTable(table)
		off, err := q.allocBitmapClusters(ctx, int64(len(raw)))
		if err != nil {
			return err
		}
		if _, err := q.f.WriteAt(ctx, raw, off); err != nil {
			return fmt.Errorf("write the table of bitmap %q at %#x: %w", entries[b.entry].name, off, err)
		}
		e := &entries[b.entry]
		e.tableOff, e.tableSize, e.flags = off, int64(len(table)), e.flags&^bmFlagInUse
		tables[b.entry] = table
	}
	dir := encodeBitmapDirectory(entries)
	dirOff, err := q.allocBitmapClusters(ctx, int64(len(dir)))
	if err != nil {
		return err
	}
	if _, err := q.f.WriteAt(ctx, dir, dirOff); err != nil {
		return fmt.Errorf("write the bitmap directory at %#x: %w", dirOff, err)
	}
	// The new clusters' refcounts, and (by the same fdatasync) their
	// contents, before the header names them.
	if err := q.Flush(ctx); err != nil {
		return err
	}
	at, err := q.bitmapsExtensionAt(ctx)
	if err != nil {
		return err
	}
	var ext [16]byte
	binary.BigEndian.PutUint64(ext[0:], uint64(len(dir)))
	binary.BigEndian.PutUint64(ext[8:], uint64(dirOff))
	if _, err := q.f.WriteAt(ctx, ext[:], at+8); err != nil {
		return fmt.Errorf("write the bitmaps header extension: %w", err)
	}
	if !q.noFlush.Load() {
		if err := q.f.Fdatasync(ctx); err != nil {
			return fmt.Errorf("write the bitmaps header extension: %w", err)
		}
	}
	w.alloc.Lock()
	q.releaseBitmapClusters(s.dirOff, s.dirSize)
	for _, b := range s.live {
		old := s.entries[b.entry]
		q.releaseBitmapClusters(old.tableOff, old.tableSize*8)
		for _, e := range s.tables[b.entry] {
			if off := int64(e & bmTableOffsetMask); off != 0 {
				q.releaseBitmapClusters(off, cs)
			}
		}
	}
	w.alloc.Unlock()
	q.h.bitmaps.dirSize, q.h.bitmaps.dirOffset = uint64(len(dir)), uint64(dirOff)
	s.entries, s.tables, s.dirOff, s.dirSize, s.live = entries, tables, dirOff, int64(len(dir)), nil
	return nil
}

// storeBitmapData writes b's data clusters and returns its table: one
// entry per cluster of bits, 0 for a cluster of zeroes.
func (q *Image) storeBitmapData(ctx context.Context, b *liveBitmap, name string) ([]uint64, error) {
	cs := q.h.clusterSize
	perCluster := cs / 8
	n := (int64(len(b.words))*8 + cs - 1) / cs
	table := make([]uint64, n)
	buf := make([]byte, cs)
	for t := range table {
		words := b.words[int64(t)*perCluster : min(int64(t+1)*perCluster, int64(len(b.words)))]
		clear(buf)
		dirty := false
		for k := range words {
			v := words[k].Load()
			binary.LittleEndian.PutUint64(buf[k*8:], v)
			dirty = dirty || v != 0
		}
		if !dirty {
			continue
		}
		off, err := q.allocBitmapClusters(ctx, cs)
		if err != nil {
			return nil, err
		}
		if _, err := q.f.WriteAt(ctx, buf, off); err != nil {
			return nil, fmt.Errorf("write data of bitmap %q at %#x: %w", name, off, err)
		}
		table[t] = uint64(off)
	}
	return table, nil
}

// allocBitmapClusters allocates clusters for n bytes of bitmap metadata
// and records them as such.
func (q *Image) allocBitmapClusters(ctx context.Context, n int64) (int64, error) {
	cs := q.h.clusterSize
	q.w.alloc.Lock()
	defer q.w.alloc.Unlock()
	off, err := q.allocClusters(ctx, (n+cs-1)/cs)
	if err != nil {
		return 0, err
	}
	q.meta.Lock()
	for c := off / cs; c < (off+n+cs-1)/cs; c++ {
		q.w.metaMap.addBitmap(c, 1)
	}
	q.meta.Unlock()
	return off, nil
}
