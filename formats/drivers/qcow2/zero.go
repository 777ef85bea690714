package qcow2

import "context"

// Write-zeroes and discard. Whole clusters change only their L2 entries: a
// v3 zero flag (keeping the host cluster unless unmapping is allowed) or no
// entry at all; the parts of clusters at either end are written as zero
// bytes, unless they read as zeroes already. Version 2 images have no zero
// flag: there only unmapping without a backing file avoids writing zeroes.

// clusterOp is what happens to whole clusters.
type clusterOp uint8

const (
	opZeroKeep   clusterOp = iota // read as zeroes, keep the host cluster
	opZeroUnmap                   // read as zeroes, drop the host cluster
	opDiscard                     // drop; reads as zeroes (or v2: the backing file)
	opDiscardAll                  // drop the entry whatever the backing file (shrink)
)

// WriteZeroes makes [off, off+n) read as zeroes.
func (q *Image) WriteZeroes(ctx context.Context, off, n int64, mayUnmap bool) error {
	op := opZeroKeep
	if mayUnmap {
		op = opZeroUnmap
	}
	return q.request(ctx, "write zeroes", off, n, func() error { return q.zeroRange(ctx, off, n, op) })
}

// Discard drops the whole clusters in [off, off+n); partial ones keep
// their data, as in QEMU.
func (q *Image) Discard(ctx context.Context, off, n int64) error {
	// The bitmaps are marked for the whole request, whatever it drops, as
	// in QEMU.
	return q.request(ctx, "discard", off, n, func() error {
		a, b := q.wholeClusters(off, n)
		if a >= b {
			return nil
		}
		_, err := q.setClusters(ctx, a, b, off+n, opDiscard)
		return err
	})
}

// wholeClusters returns the clusters [a, b) that [off, off+n) covers whole;
// a short last cluster counts as whole when the range reaches the image end.
func (q *Image) wholeClusters(off, n int64) (a, b int64) {
	cs := q.h.clusterSize
	a, b = (off+cs-1)/cs, (off+n)/cs
	if off+n == q.end.Load() {
		b = (off + n + cs - 1) / cs
	}
	return a, b
}

// zeroRange zeroes [off, off+n). The caller holds w.users.
func (q *Image) zeroRange(ctx context.Context, off, n int64, op clusterOp) error {
	cs := q.h.clusterSize
	end := off + n
	ca, cb := q.wholeClusters(off, n)
	a, b := ca*cs, cb*cs
	if a >= b {
		return q.zeroPartial(ctx, off, n)
	}
	if off < a {
		if err := q.zeroPartial(ctx, off, a-off); err != nil {
			return err
		}
	}
	if b < end {
		if err := q.zeroPartial(ctx, b, end-b); err != nil {
			return err
		}
	}
	if q.h.version < 3 && !(op == opZeroUnmap && q.backing == nil) {
		// No zero flag: write zero bytes, a chunk at a time.
		zeros := make([]byte, min(b-a, 1<<20))
		for pos := a; pos < min(b, end); pos += int64(len(zeros)) {
			if err := q.write(ctx, zeros[:min(int64(len(zeros)), min(b, end)-pos)], pos); err != nil {
				return err
			}
		}
		return nil
	}
	short, err := q.setClusters(ctx, ca, cb, end, op)
	if err != nil || !short {
		return err
	}
	// The image grew meanwhile: the last cluster is partial now.
	return q.zeroPartial(ctx, b-cs, end-(b-cs))
}

// zeroPartial zeroes [off, off+n), which covers no cluster whole, by
// writing zeroes into each cluster it touches, unless that cluster reads as
// zeroes there already. The range may straddle a cluster boundary: every
// cluster is looked at on its own, since one that reads as zeroes says
// nothing about its neighbour.
func (q *Image) zeroPartial(ctx context.Context, off, n int64) error {
	cs := q.h.clusterSize
	for end := off + n; off < end; {
		k := min(cs-off%cs, end-off)
		m, _, err := q.lookup(ctx, off/cs)
		if err != nil {
			return err
		}
		if !q.readsZero(m, off) {
			if err := q.write(ctx, make([]byte, k), off); err != nil {
				return err
			}
		}
		off += k
	}
	return nil
}

// setClusters applies op to virtual clusters [a, b), one L2 table's span
// at a time under the range lock. limit is where the request ends: a last
// cluster reaching past it was taken whole because the request reached
// the image end (wholeClusters). Should the image have grown since, that
// cluster is left alone and short says so: its part past limit belongs to
// the image now, and a writer that saw the new size may have written
// there already, without the range lock (in place).
func (q *Image) setClusters(ctx context.Context, a, b, limit int64, op clusterOp) (short bool, err error) {
	w := q.w
	cs := q.h.clusterSize
	span := q.h.l2Entries
	for vc := a; vc < b; {
		end := min(b, (vc/span+1)*span)
		unlock, err := w.clusters.Lock(ctx, vc*cs, (end-vc)*cs)
		if err != nil {
			return false, err
		}
		w.alloc.Lock()
		stop := end
		// Under alloc, which a grow holds to move end: while end is
		// still limit, no grow has begun, and none publishes its size
		// before it has moved end, so no writer is past limit yet.
		if end == b && b*cs > limit && q.end.Load() != limit {
			stop, short = b-1, true
		}
		if vc < stop {
			err = q.setClustersInTable(ctx, vc, stop, op)
		}
		w.alloc.Unlock()
		unlock()
		if err != nil {
			return false, err
		}
		vc = end
	}
	return short, nil
}

// setClustersInTable applies op to [a, b), all mapped by one L2 table.
// The caller holds alloc.
func (q *Image) setClustersInTable(ctx context.Context, a, b int64, op clusterOp) error {
	var table []uint64 // the current table, for reading; nil: none
	l2off := int64(q.l1[a/q.h.l2Entries] & l1OffsetMask)
	if l2off == 0 && op == opDiscardAll {
		// No table: nothing here to drop. Commit empties its top over
		// the whole virtual size, mostly such spans in a large image.
		return nil
	}
	if l2off != 0 {
		t, err := q.l2ForAlloc(ctx, l2off)
		if err != nil {
			return err
		}
		table = t
	}
	for vc := a; vc < b; vc++ {
		var old uint64
		if table != nil {
			old = table[vc%q.h.l2Entries]
		}
		m, err := q.decode(vc, old, q.fileSize)
		if err != nil {
			return err
		}
		next, keep := q.zeroEntry(m, op)
		if next == old {
			continue
		}
		if err := q.setL2(ctx, vc, next); err != nil {
			return err
		}
		// Read on from the table setL2 pinned (or created).
		table = q.w.l2pin[int64(q.l1[a/q.h.l2Entries]&l1OffsetMask)].t
		if !keep {
			q.freeLater(old)
		}
	}
	return nil
}

// zeroEntry is the L2 entry a cluster mapped as m gets from op, and
// whether m's host cluster stays in use.
func (q *Image) zeroEntry(m mapping, op clusterOp) (uint64, bool) {
	switch op {
	case opZeroKeep:
		switch {
		case m.kind == zero:
			return m.entry, true
		case ownsCluster(m):
			return uint64(m.host) | oflagCopied | l2ZeroFlag, true
		case m.kind == unallocated && q.backing == nil:
			return m.entry, true // reads as zeroes already
		}
		return l2ZeroFlag, false
	case opDiscardAll:
		return 0, false
	}
	// Zeroing with unmap, and discard: with a backing file, v3 makes the
	// cluster read as zeroes rather than show the backing file through, as
	// QEMU does.
	if q.h.version >= 3 && q.backing != nil {
		return l2ZeroFlag, false
	}
	return 0, false
}
