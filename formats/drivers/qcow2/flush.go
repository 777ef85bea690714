package qcow2

import (
	"cmp"
	"context"
	"encoding/binary"
	"fmt"
	"slices"
)

// Metadata write-back, in the order that keeps the file consistent after a
// crash at any instant:
//
//  1. refcount blocks; fdatasync (this also makes every completed data
//     write durable, which the L2 entries below point at);
//  2. the refcount table, and if it moved, the header's pointer to it;
//     fdatasync;
//  3. L2 tables; fdatasync;
//  4. the L1 table, and if it moved or the size changed, the header;
//     fdatasync;
//  5. clusters freed by steps 2-4 lose their refcount (in memory; written by
//     step 1 of the next round, which Flush runs at once).
//
// Each step only ever points at things the steps before made durable, so
// on disk every reference is backed by a refcount: a crash leaks at most.

// hostWrite is one metadata write.
type hostWrite struct {
	off int64
	buf []byte
}

// metaSnapshot is what one write-back writes, copied under alloc so that
// writers may go on changing the tables meanwhile.
type metaSnapshot struct {
	blocks   []hostWrite
	rtable   *hostWrite
	rtHeader *hostWrite
	l2       []hostWrite
	l1       *hostWrite
	header   *hostWrite
	frees    []int64
	// What to mark dirty again if the write-back fails.
	l1Lo, l1Hi                    int
	rtDirty, rtMoved, l1Moved, sz bool
}

// Flush makes every completed write durable, metadata included.
func (q *Image) Flush(ctx context.Context) error {
	if q.w == nil {
		return nil
	}
	w := q.w
	w.flushMu.Lock()
	defer w.flushMu.Unlock()
	// Nothing written since the last flush began, and no metadata dirty:
	// that flush made it all durable already (a write completed since
	// would have moved writes).
	writes := w.writes.Load()
	clean := writes == w.flushed
	// A second round writes the refcounts that the first round's frees
	// dropped, so that a clean close leaves no leak behind.
	var refused error // a free refused as metadata: reported, after the rest
	for round := range 2 {
		s := q.snapshot()
		if round == 0 && clean && s.empty() {
			return nil
		}
		if err := q.writeBack(ctx, s); err != nil {
			q.redirty(s)
			return err
		}
		q.unpinClean()
		if len(s.frees) == 0 {
			if refused == nil && !q.noFlush.Load() {
				w.flushed = writes
			}
			return refused
		}
		r, err := q.applyFrees(ctx, s.frees)
		if err != nil {
			return err
		}
		refused = cmp.Or(refused, r)
	}
	return refused
}

// empty says the snapshot has nothing to write.
func (s *metaSnapshot) empty() bool {
	return len(s.blocks) == 0 && s.rtable == nil && s.rtHeader == nil && len(s.l2) == 0 &&
		s.l1 == nil && s.header == nil && len(s.frees) == 0
}

// snapshot copies the dirty metadata and marks it clean (but still pinned,
// until it is written).
func (q *Image) snapshot() *metaSnapshot {
	w := q.w
	w.alloc.Lock()
	defer w.alloc.Unlock()
	s := &metaSnapshot{}
	for off, p := range w.rbpin {
		if p.dirty {
			s.blocks = append(s.blocks, hostWrite{off, slices.Clone(p.b)})
			p.dirty = false
		}
	}
	w.dirtyRB.Store(0)
	if w.rtDirty {
		s.rtable = &hostWrite{w.rtOffset, encodeTable(w.rtable)}
		s.rtDirty = true
		if w.rtMoved {
			b := binary.BigEndian.AppendUint64(nil, uint64(w.rtOffset))
			b = binary.BigEndian.AppendUint32(b, uint32((w.rtEntries*8+q.h.clusterSize-1)/q.h.clusterSize))
			s.rtHeader = &hostWrite{hdrRefcountOffset, b}
			s.rtMoved = true
		}
		w.rtDirty, w.rtMoved = false, false
	}
	for off, p := range w.l2pin {
		if p.dirty {
			// Readers only read the table; alloc keeps writers out.
			s.l2 = append(s.l2, hostWrite{off, encodeTable(p.t)})
			p.dirty = false
		}
	}
	w.dirtyL2.Store(0)
	if w.l1Hi > 0 {
		s.l1Lo, s.l1Hi = w.l1Lo, w.l1Hi
		s.l1 = &hostWrite{w.l1Offset + int64(w.l1Lo)*8, encodeTable(q.l1[w.l1Lo:w.l1Hi])}
		w.l1Lo, w.l1Hi = 0, 0
	}
	if w.l1Moved || w.sizeDirty {
		b := binary.BigEndian.AppendUint64(nil, uint64(q.Size()))
		b = binary.BigEndian.AppendUint32(b, 0) // crypt_method
		b = binary.BigEndian.AppendUint32(b, uint32(len(q.l1)))
		b = binary.BigEndian.AppendUint64(b, uint64(w.l1Offset))
		s.header = &hostWrite{hdrSize, b}
		s.l1Moved, s.sz = w.l1Moved, w.sizeDirty
		w.l1Moved, w.sizeDirty = false, false
	}
	s.frees, w.pendingFree = w.pendingFree, nil
	return s
}

// SetNoFlush makes Flush (and the write-backs that bound dirty metadata)
// write what is dirty without waiting for the disk: no fdatasync, as
// QEMU's cache=unsafe (qemu-img convert's default for its target). What
// is written is as safe as the page cache: a killed process leaves a
// consistent image, a crash of the host may not.
func (q *Image) SetNoFlush(on bool) { q.noFlush.Store(on) }

// writeBack writes s in the crash-safe order.
func (q *Image) writeBack(ctx context.Context, s *metaSnapshot) error {
	put := func(what string, hw hostWrite) error {
		if _, err := q.f.WriteAt(ctx, hw.buf, hw.off); err != nil {
			return fmt.Errorf("qcow2: write %s at %#x: %w", what, hw.off, err)
		}
		return nil
	}
	sync := func() error {
		if q.noFlush.Load() {
			return nil
		}
		if err := q.f.Fdatasync(ctx); err != nil {
			return fmt.Errorf("qcow2: flush: %w", err)
		}
		return nil
	}
	// 1. Refcount blocks, with all data written so far.
	for _, hw := range s.blocks {
		if err := put("refcount block", hw); err != nil {
			return err
		}
	}
	if err := sync(); err != nil {
		return err
	}
	// 2. The refcount table, then the header's pointer to it.
	if s.rtable != nil {
		if err := put("refcount table", *s.rtable); err != nil {
			return err
		}
		if s.rtHeader != nil {
			if err := sync(); err != nil {
				return err
			}
			if err := put("header (refcount table)", *s.rtHeader); err != nil {
				return err
			}
		}
		if err := sync(); err != nil {
			return err
		}
	}
	// 3. L2 tables.
	for _, hw := range s.l2 {
		if err := put("L2 table", hw); err != nil {
			return err
		}
	}
	if len(s.l2) > 0 {
		if err := sync(); err != nil {
			return err
		}
	}
	// 4. The L1 table, then the header.
	if s.l1 != nil {
		if err := put("L1 table", *s.l1); err != nil {
			return err
		}
		if s.header != nil && s.l1Moved {
			if err := sync(); err != nil {
				return err
			}
		}
	}
	if s.header != nil {
		if err := put("header", *s.header); err != nil {
			return err
		}
	}
	if s.l1 != nil || s.header != nil {
		return sync()
	}
	return nil
}

// redirty marks what a failed write-back took as dirty again.
func (q *Image) redirty(s *metaSnapshot) {
	w := q.w
	w.alloc.Lock()
	defer w.alloc.Unlock()
	for _, hw := range s.blocks {
		if p, ok := w.rbpin[hw.off]; ok && !p.dirty {
			p.dirty = true
			w.dirtyRB.Add(1)
		}
	}
	for _, hw := range s.l2 {
		if p, ok := w.l2pin[hw.off]; ok && !p.dirty {
			p.dirty = true
			w.dirtyL2.Add(1)
		}
	}
	if s.l1Hi > 0 {
		q.l1Changed(s.l1Lo)
		q.l1Changed(s.l1Hi - 1)
	}
	w.rtDirty = w.rtDirty || s.rtDirty
	w.rtMoved = w.rtMoved || s.rtMoved
	w.l1Moved = w.l1Moved || s.l1Moved
	w.sizeDirty = w.sizeDirty || s.sz
	w.pendingFree = append(s.frees, w.pendingFree...)
}

// unpinClean moves tables that are written and unchanged since back to the
// caches, where they may be evicted.
func (q *Image) unpinClean() {
	w := q.w
	w.alloc.Lock()
	defer w.alloc.Unlock()
	for off, p := range w.rbpin {
		if !p.dirty {
			q.rcache.Put(off, p.b)
			delete(w.rbpin, off)
		}
	}
	q.meta.Lock()
	defer q.meta.Unlock()
	unpinned := false
	for off, p := range w.l2pin {
		if !p.dirty {
			q.l2cache.Put(off, p.t)
			delete(w.l2pin, off)
			unpinned = true
		}
	}
	if unpinned {
		// Lookups that read a table from the file before it was written
		// must not cache what they read.
		q.l2cache.Bump()
	}
}

// encodeTable is a table of big-endian 64-bit entries as stored.
func encodeTable(t []uint64) []byte {
	b := make([]byte, len(t)*8)
	for i, v := range t {
		binary.BigEndian.PutUint64(b[i*8:], v)
	}
	return b
}

// decodeTable is the table of big-endian 64-bit entries stored in b.
func decodeTable(b []byte) []uint64 {
	t := make([]uint64, len(b)/8)
	for i := range t {
		t[i] = binary.BigEndian.Uint64(b[i*8:])
	}
	return t
}
