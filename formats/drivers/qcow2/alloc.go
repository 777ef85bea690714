package qcow2

import (
	"context"
	"fmt"
	"slices"

	"golang.org/x/sys/unix"
)

// Cluster allocation and refcounts of a writable image.
//
// Refcount blocks live in memory once touched; a changed block stays pinned
// (never evicted) until Flush has written it. Allocation takes the first
// run of free clusters from a hint; a cluster whose refcount block does not
// exist yet is free, and missing blocks are created right after the run
// (counting themselves too). When the refcount table itself is full, a
// larger one is built past the end of what it covers (growRefcountTable).
//
// Frees are deferred: the metadata that stopped using a cluster (an L2 entry
// cleared, an old L1 table replaced) must be durable before the refcount
// drops, or a crash could leave a reused cluster referenced twice. So freed
// clusters wait in pendingFree until Flush has written that metadata, and
// are applied while no request is in flight (one that looked the cluster up
// before it was freed may still be reading or writing it).

// growFile notes that the file extends to at least end. The caller holds
// alloc.
func (q *Image) growFile(end int64) {
	q.meta.Lock()
	q.fileSize = max(q.fileSize, end)
	q.meta.Unlock()
	w := q.w
	if w.growAhead > 0 && end > w.physEnd {
		// The file is made longer ahead of the writes, in steps, since
		// appends update an ext4 file's size page by page (docs/design.md,
		// Convert's chunk sizes). Best effort: the writes extend it.
		n := (end + w.growAhead - 1) / w.growAhead * w.growAhead
		if err := unix.Ftruncate(q.f.Fd(), n); err != nil {
			w.growAhead = 0
			return
		}
		w.physEnd = n
	}
}

// SetGrowAhead makes the file grow ahead of allocation in steps of n
// bytes (0: off), for a writer that fills a new image from start to end
// (convert). Close cuts the file back to the clusters in use; an image
// left longer (the process killed) is still consistent: past the last
// cluster it has only free space, which qemu-img check passes.
func (q *Image) SetGrowAhead(n int64) {
	if q.w == nil || n < 0 {
		return
	}
	q.w.alloc.Lock()
	defer q.w.alloc.Unlock()
	q.w.growAhead = n
	if q.w.physEnd == 0 {
		q.meta.RLock()
		q.w.physEnd = q.fileSize
		q.meta.RUnlock()
	}
}

// trimGrowAhead cuts the file back to the end of the clusters in use,
// when it was grown ahead.
func (q *Image) trimGrowAhead() error {
	w := q.w
	w.alloc.Lock()
	defer w.alloc.Unlock()
	q.meta.RLock()
	end := q.fileSize
	q.meta.RUnlock()
	if w.physEnd <= end {
		return nil
	}
	if err := unix.Ftruncate(q.f.Fd(), end); err != nil {
		return fmt.Errorf("qcow2: cut the file back to %d bytes: %w", end, err)
	}
	w.physEnd = end
	return nil
}

// allocClusters finds n contiguous free host clusters, sets their refcounts
// to one and returns the first one's offset. Refcount blocks missing for
// them are created right after them (and count themselves too), so a run
// longer than one block covers still fits. The caller holds alloc.
func (q *Image) allocClusters(ctx context.Context, n int64) (int64, error) {
	w := q.w
	cs := q.h.clusterSize
	from := w.freeHint
	for {
		c, firstFree, err := q.findFree(ctx, from, n)
		if err != nil {
			return 0, err
		}
		// The run plus the blocks it lacks, until that is stable.
		total, beyond := n, int64(-1)
		for {
			missing, b := q.missingBlocks(c, total)
			if b >= 0 {
				beyond = b
				break
			}
			if n+missing == total {
				break
			}
			total = n + missing
		}
		if beyond >= 0 {
			if err := q.growRefcountTable(ctx, beyond); err != nil {
				return 0, err
			}
			from = w.freeHint
			continue
		}
		// The clusters for the new blocks must be free too.
		busy := int64(-1)
		for j := c + n; j < c+total; j++ {
			rc, err := q.getRef(ctx, j)
			if err != nil {
				return 0, err
			}
			if rc != 0 {
				busy = j
				break
			}
		}
		if busy >= 0 {
			from = busy + 1
			continue
		}
		// Free by its refcount, but a refcount can be too low: the run
		// must not hold metadata.
		if err := q.checkWrite(ctx, c*cs, total*cs, metaNone, fmt.Sprintf("allocation of %d clusters", total)); err != nil {
			return 0, err
		}
		next := c + n
		for i := c / w.perBlock; i <= (c+total-1)/w.perBlock; i++ {
			w.extendRefTable(i)
			if w.rtable[i] != 0 {
				continue
			}
			off := next * cs
			next++
			b := make([]byte, cs)
			w.rtable[i] = uint64(off)
			w.rtDirty = true
			q.meta.Lock()
			w.metaMap.addRB(off/cs, 1)
			q.meta.Unlock()
			if err := q.pinBlock(ctx, off, b); err != nil {
				return 0, err
			}
		}
		for j := c; j < c+total; j++ {
			if err := q.setRef(ctx, j, 1); err != nil {
				return 0, err
			}
		}
		if from == w.freeHint && firstFree == c {
			// Nothing free was skipped: the hint may move past the run.
			w.freeHint = c + total
		}
		q.growFile((c + total) * cs)
		return c * cs, nil
	}
}

// findFree returns the first run of n clusters with refcount zero at or
// after from, and the first free cluster it saw.
func (q *Image) findFree(ctx context.Context, from, n int64) (c, firstFree int64, err error) {
	cs := q.h.clusterSize
	c, firstFree = from, -1
	// Refcounts past the end of the file belong to clusters allocated but
	// not yet written when a crash came: a few. Many are a corrupt table,
	// which must not send the scan on for billions of clusters.
	pastEnd := 0
	for run := int64(0); run < n; {
		if (c+run+1)*cs > maxHostOffset {
			return 0, 0, fmt.Errorf("qcow2: allocate %d clusters: the image file is full: %w", n, unix.EFBIG)
		}
		rc, err := q.getRef(ctx, c+run)
		if err != nil {
			return 0, 0, err
		}
		if rc != 0 {
			if (c+run)*cs >= q.fileSize {
				if pastEnd++; pastEnd > maxRefsPastEnd {
					return 0, 0, fmt.Errorf("%w: refcounts claim more than %d clusters past the end of the file", ErrCorrupt, maxRefsPastEnd)
				}
			}
			c, run = c+run+1, 0
			continue
		}
		if firstFree < 0 {
			firstFree = c + run
		}
		run++
	}
	return c, firstFree, nil
}

// missingBlocks counts the refcount blocks clusters [c, c+n) lack, or
// returns the first block index the refcount table has no entry for.
func (q *Image) missingBlocks(c, n int64) (missing, beyond int64) {
	w := q.w
	for i := c / w.perBlock; i <= (c+n-1)/w.perBlock; i++ {
		if i >= w.rtEntries {
			return 0, i
		}
		if i >= int64(len(w.rtable)) || w.rtable[i] == 0 {
			missing++
		}
	}
	return missing, -1
}

// maxHostOffset is where L2 entries' offset field ends.
const maxHostOffset = 1 << 56

// maxRefsPastEnd bounds the in-use clusters past the end of the file that
// allocation steps over (see findFree).
const maxRefsPastEnd = 1 << 20

// maxRefTableBytes is QEMU's QCOW_MAX_REFTABLE_SIZE.
const maxRefTableBytes = 8 << 20

// growRefcountTable replaces the refcount table with one that has an entry
// for block index need. The new table and the blocks that count it go
// right past what the old table covers (every cluster there is free), the
// old table's clusters are freed once the header points at the new one.
func (q *Image) growRefcountTable(ctx context.Context, need int64) error {
	w := q.w
	cs := q.h.clusterSize
	old := w.rtEntries
	x := old * w.perBlock // first cluster the old table cannot count
	entries := max(old*2, need+1)
	var tClusters, blocks int64
	for {
		tClusters = (entries*8 + cs - 1) / cs
		blocks = 1
		for (x+tClusters+blocks-1)/w.perBlock-x/w.perBlock+1 > blocks {
			blocks++
		}
		if (x+tClusters+blocks-1)/w.perBlock < entries {
			break
		}
		entries *= 2
	}
	if entries*8 > maxRefTableBytes {
		return fmt.Errorf("qcow2: refcount table of %d entries: the image file is too large: %w", entries, unix.EFBIG)
	}
	if err := q.checkWrite(ctx, x*cs, (tClusters+blocks)*cs, metaNone, "new refcount table"); err != nil {
		return err
	}
	rt := make([]uint64, entries)
	copy(rt, w.rtable)
	first := x / w.perBlock
	q.meta.Lock()
	w.metaMap.setRange(metaRefTable, x*cs, entries*8, cs)
	for k := range blocks {
		w.metaMap.addRB(x+tClusters+k, 1)
	}
	q.meta.Unlock()
	for k := range blocks {
		boff := (x + tClusters + k) * cs
		rt[first+k] = uint64(boff)
		if err := q.pinBlock(ctx, boff, make([]byte, cs)); err != nil {
			return err
		}
	}
	q.freeRangeLater(w.rtOffset, old*8) // once the header points at rt
	w.rtable, w.rtEntries, w.rtOffset = rt, entries, x*cs
	w.rtDirty, w.rtMoved = true, true
	for c := x; c < x+tClusters+blocks; c++ {
		if err := q.setRef(ctx, c, 1); err != nil {
			return err
		}
	}
	q.growFile((x + tClusters + blocks) * cs)
	return nil
}

// unallocate drops clusters [host, host+n*cs) that nothing references yet
// (an allocating write failed). Failing that, they leak: logged, not
// returned, since the caller reports the write's own error. The caller
// holds alloc.
func (q *Image) unallocate(ctx context.Context, host, n int64) {
	cs := q.h.clusterSize
	for c := host / cs; c < host/cs+n; c++ {
		if err := q.setRef(ctx, c, 0); err != nil {
			q.logWarn("leaking clusters after a failed write", err)
			return
		}
		q.w.freeHint = min(q.w.freeHint, c)
	}
}

// freeLater queues the host clusters that L2 entry e used, now that it no
// longer does. A compressed cluster counts once in every host cluster its
// sectors touch, as QEMU frees it. The caller holds alloc.
func (q *Image) freeLater(e uint64) {
	if e&l2Compressed != 0 {
		host, sectors := q.compressedEntry(e)
		q.freeRangeLater(host&^511, sectors*512)
		return
	}
	if host := int64(e & l2OffsetMask); host != 0 {
		q.freeRangeLater(host, 1)
	}
}

// freeRangeLater queues every host cluster that [off, off+n) touches. The
// caller holds alloc.
func (q *Image) freeRangeLater(off, n int64) {
	cs := q.h.clusterSize
	for c := off / cs; c <= (off+n-1)/cs; c++ {
		q.w.pendingFree = append(q.w.pendingFree, c)
	}
}

// applyFrees drops the refcounts of clusters whose last user's metadata is
// durable. No request is in flight meanwhile. Clusters that become free
// are punched out of the host file. A free refused because the cluster is
// metadata comes back as refused; the others are applied.
func (q *Image) applyFrees(ctx context.Context, frees []int64) (refused, err error) {
	w := q.w
	w.users.Lock()
	defer w.users.Unlock()
	w.alloc.Lock()
	defer w.alloc.Unlock()
	var freed []int64
	for i, c := range frees {
		rc, err := q.getRef(ctx, c)
		if err == nil && rc == 0 {
			err = fmt.Errorf("%w: freeing cluster %#x whose refcount is already zero", ErrCorrupt, c*q.h.clusterSize)
		}
		if err == nil && rc == 1 {
			// The last reference goes: the cluster must not be metadata
			// (a compressed entry pointing into the header would have the
			// header freed, punched out and handed out again). Such a
			// cluster keeps its refcount; the rest are freed as usual.
			if err := q.checkWrite(ctx, c*q.h.clusterSize, q.h.clusterSize, metaNone, "freeing the cluster"); err != nil {
				refused = err
				continue
			}
		}
		if err == nil {
			err = q.setRef(ctx, c, rc-1)
		}
		if err != nil {
			// Keep what is left for the next flush; a leak at worst.
			w.pendingFree = append(w.pendingFree, frees[i+1:]...)
			return refused, err
		}
		if rc == 1 {
			freed = append(freed, c)
			q.compFreed(c)
			w.freeHint = min(w.freeHint, c)
		}
	}
	// Give the space back to the host; where it cannot, the clusters are
	// merely free for reuse. Neighbouring clusters go in one punch: a
	// punch costs about a millisecond on ext4 whatever its length, and
	// emptying the top of a commit freed one cluster at a time took most
	// of the commit (2048 punches, 2.2 s of a 256 MiB chain's 3 s).
	slices.Sort(freed)
	cs := q.h.clusterSize
	for i := 0; i < len(freed); {
		j := i + 1
		for j < len(freed) && freed[j] == freed[j-1]+1 {
			j++
		}
		err := q.f.Fallocate(ctx, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, freed[i]*cs, int64(j-i)*cs)
		if err != nil {
			break
		}
		i = j
	}
	return refused, nil
}
