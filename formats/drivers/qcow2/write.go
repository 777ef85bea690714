package qcow2

import (
	"context"
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/formats"
)

// Writes.
//
// A write into a cluster this image owns (a data cluster with refcount one,
// marked COPIED) goes straight to the host file, in parallel with anything
// else. Any other cluster (unallocated, zero, compressed, shared) gets a new
// one: under a range lock on the virtual clusters, the parts of the first
// and last cluster the write does not cover are read from what the cluster
// was (backing chain, zeroes, the compressed data), the whole clusters are
// written to newly allocated host clusters, and only then does the L2 entry
// point at them.
//
// Crash safety comes from the order Flush writes metadata in (flush.go):
// data and refcounts, then the refcount table, then L2 tables, then the L1
// table and header, each step made durable before the next. New L2 entries
// exist only in memory until then, so on disk an entry never points at a
// cluster whose data or refcount is not there yet; a crash loses what was
// not flushed, as the export promises, and at worst leaks clusters.

// WriteAt writes p at off.
func (q *Image) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	err := q.request(ctx, "write", off, int64(len(p)), func() error { return q.write(ctx, p, off) })
	if err != nil {
		return 0, err
	}
	return len(p), nil
}

// request runs change, which op names, on [off, off+n) of a writable
// image: the dirty bitmaps marked first, under w.users, then the metadata
// written back if it has grown too large.
func (q *Image) request(ctx context.Context, op string, off, n int64, change func() error) error {
	if err := q.checkWritable(op); err != nil {
		return err
	}
	if off < 0 || n < 0 || off+n > q.Size() {
		return fmt.Errorf("qcow2: %s [%d, +%d): %w", op, off, n, formats.ErrOutOfRange)
	}
	q.w.users.RLock()
	q.markDirty(off, n)
	err := change()
	q.w.users.RUnlock()
	q.wrote()
	if err != nil {
		return err
	}
	return q.boundWriteBack(ctx)
}

// TryWriteAt writes p in place when every cluster it touches is one this
// image owns, with its L2 entry in memory, and nobody holds a lock it
// needs; the host file takes it without waiting (aio's try: not with
// O_DIRECT). Clusters contiguous on the host take one write.
func (q *Image) TryWriteAt(p []byte, off int64) (bool, error) {
	cs := q.h.clusterSize
	if q.w == nil || q.direct || len(p) == 0 || off < 0 || off+int64(len(p)) > q.Size() || q.corrupt.Load() {
		return false, nil // O_DIRECT writes wait for the device; WriteAt reports the rest
	}
	if !q.w.users.TryRLock() {
		return false, nil
	}
	defer q.w.users.RUnlock()
	type run struct{ pos, n, host int64 }
	var buf [8]run
	runs := buf[:0]
	if !q.meta.TryRLock() {
		return false, nil
	}
	for pos := int64(0); pos < int64(len(p)); {
		voff := off + pos
		n := min(cs-voff%cs, int64(len(p))-pos)
		vc := voff / cs
		e, _, cached, _, err := q.l2Entry(vc)
		var m mapping
		if err == nil && cached {
			m, err = q.decode(vc, e, q.fileSize)
		}
		if err != nil || !cached || !ownsCluster(m) {
			q.meta.RUnlock()
			return false, nil
		}
		host := m.host + voff%cs
		if oe := q.checkWriteLocked(host, n, metaNone); oe != nil {
			q.meta.RUnlock()
			return true, q.refuse(context.Background(), oe, "data write")
		}
		if last := len(runs) - 1; last >= 0 && runs[last].host+runs[last].n == host {
			runs[last].n += n
		} else {
			runs = append(runs, run{pos, n, host})
		}
		pos += n
	}
	q.meta.RUnlock()
	q.markDirty(off, int64(len(p)))
	for _, r := range runs {
		done, err := q.f.TryWriteAt(p[r.pos:r.pos+r.n], r.host)
		if done {
			q.wrote()
		}
		if !done {
			// Not with a buffered file; were it so, the earlier runs
			// are written and the caller's WriteAt writes them again.
			return false, nil
		}
		if err != nil {
			return true, fmt.Errorf("qcow2: write %d bytes at host %#x: %w", r.n, r.host, err)
		}
	}
	return true, nil
}

// writeHost writes p at host offset host of a cluster this image owns,
// unless the L2 entry that said so points at metadata.
func (q *Image) writeHost(ctx context.Context, p []byte, host int64) error {
	if err := q.checkWrite(ctx, host, int64(len(p)), metaNone, "data write"); err != nil {
		return err
	}
	if _, err := q.f.WriteAt(ctx, p, host); err != nil {
		return fmt.Errorf("qcow2: write %d bytes at host %#x: %w", len(p), host, err)
	}
	return nil
}

// ownsCluster says whether a write may go to m's host cluster in place.
func ownsCluster(m mapping) bool {
	return m.kind == data && m.entry&oflagCopied != 0
}

// write is WriteAt for callers that hold w.users.
func (q *Image) write(ctx context.Context, p []byte, off int64) error {
	cs := q.h.clusterSize
	for pos := int64(0); pos < int64(len(p)); {
		voff := off + pos
		n := min(cs-voff%cs, int64(len(p))-pos)
		m, _, err := q.lookup(ctx, voff/cs)
		if err != nil {
			return err
		}
		inPlace := ownsCluster(m)
		// Extend over the following clusters of the same sort (for in-place
		// writes: contiguous on the host too).
		for pos+n < int64(len(p)) {
			next, _, err := q.lookup(ctx, (voff+n)/cs)
			if err != nil {
				return err
			}
			if ownsCluster(next) != inPlace || inPlace && next.host != m.host+voff%cs+n {
				break
			}
			n += min(cs, int64(len(p))-pos-n)
		}
		if inPlace {
			if err := q.writeHost(ctx, p[pos:pos+n], m.host+voff%cs); err != nil {
				return err
			}
		} else if err := q.allocWrite(ctx, p[pos:pos+n], voff); err != nil {
			return err
		}
		pos += n
	}
	return nil
}

// allocWrite writes p at off, all in clusters that were not ours to write
// in place when looked at.
func (q *Image) allocWrite(ctx context.Context, p []byte, off int64) error {
	cs := q.h.clusterSize
	vc0, vc1 := off/cs, (off+int64(len(p))+cs-1)/cs
	unlock, err := q.w.clusters.Lock(ctx, vc0*cs, (vc1-vc0)*cs)
	if err != nil {
		return err
	}
	defer unlock()
	// Look again under the lock: a writer before us may have allocated.
	olds := make([]mapping, vc1-vc0)
	for i := range olds {
		if olds[i], _, err = q.lookup(ctx, vc0+int64(i)); err != nil {
			return err
		}
	}
	for i := 0; i < len(olds); {
		j := i + 1
		for j < len(olds) && ownsCluster(olds[j]) == ownsCluster(olds[i]) {
			j++
		}
		a := max(off, (vc0+int64(i))*cs)
		b := min(off+int64(len(p)), (vc0+int64(j))*cs)
		piece := p[a-off : b-off]
		if ownsCluster(olds[i]) {
			for k := i; k < j; k++ {
				ca := max(a, (vc0+int64(k))*cs)
				cb := min(b, (vc0+int64(k)+1)*cs)
				if err := q.writeHost(ctx, p[ca-off:cb-off], olds[k].host+ca%cs); err != nil {
					return err
				}
			}
		} else if err := q.allocRun(ctx, piece, a, vc0+int64(i), olds[i:j]); err != nil {
			return err
		}
		i = j
	}
	return nil
}

// allocRun writes p at off into new clusters for virtual clusters
// [vc, vc+len(olds)), whose current mappings are olds, and points the L2
// entries at them. The caller holds the range lock on those clusters.
//
// alloc is taken twice, around the data write and not across it: to
// allocate, then to link. Holding it across the write would serialize
// every allocating write in the image behind one device write. (The walks
// of an allocating write are likewise three on purpose: write classifies
// clusters without locks, allocWrite looks again under the range lock,
// since a writer before it may have allocated, and setL2 links.)
func (q *Image) allocRun(ctx context.Context, p []byte, off, vc int64, olds []mapping) error {
	w := q.w
	cs := q.h.clusterSize
	n := int64(len(olds))
	head := off - vc*cs
	tail := (vc+n)*cs - off - int64(len(p))

	w.alloc.Lock()
	host, err := q.allocClusters(ctx, n)
	w.alloc.Unlock()
	if err != nil {
		return err
	}
	if err := q.writeNewClusters(ctx, p, off, vc, host, olds, head, tail); err != nil {
		w.alloc.Lock()
		q.unallocate(ctx, host, n)
		w.alloc.Unlock()
		return err
	}

	w.alloc.Lock()
	defer w.alloc.Unlock()
	for i := range n {
		if err := q.setL2(ctx, vc+i, uint64(host+i*cs)|oflagCopied); err != nil {
			q.unallocate(ctx, host+i*cs, n-i) // the clusters past i are ours alone
			return err
		}
		q.freeLater(olds[i].entry)
	}
	return nil
}

// writeNewClusters fills the new clusters at host: p, and around it (head
// bytes before, tail after) what the clusters held before. Copy-on-write
// from zeroes (a cluster that read as zeroes) asks the host file system
// to zero the clusters instead of writing zero bytes, as QEMU does: no
// page-cache pages are dirtied for them.
func (q *Image) writeNewClusters(ctx context.Context, p []byte, off, vc, host int64, olds []mapping, head, tail int64) error {
	cs := q.h.clusterSize
	n := int64(len(olds))
	if (head > 0 || tail > 0) && (head == 0 || q.readsZero(olds[0], vc*cs)) &&
		(tail == 0 || q.readsZero(olds[n-1], off+int64(len(p)))) && !q.w.noZeroRange.Load() {
		err := q.f.Fallocate(ctx, unix.FALLOC_FL_ZERO_RANGE, host, n*cs)
		if err == nil {
			return q.writeHost(ctx, p, host+head)
		}
		if !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.ENOSYS) {
			return fmt.Errorf("qcow2: zero %d clusters at host %#x: %w", n, host, err)
		}
		q.w.noZeroRange.Store(true)
	}
	iov := make([][]byte, 0, 3)
	if head > 0 {
		buf := make([]byte, head)
		if err := q.readOld(ctx, buf, vc*cs, olds[0]); err != nil {
			return err
		}
		iov = append(iov, buf)
	}
	iov = append(iov, p)
	if tail > 0 {
		buf := make([]byte, tail)
		if err := q.readOld(ctx, buf, off+int64(len(p)), olds[n-1]); err != nil {
			return err
		}
		iov = append(iov, buf)
	}
	if _, err := q.f.WritevAt(ctx, iov, host); err != nil {
		return fmt.Errorf("qcow2: write %d clusters at host %#x: %w", n, host, err)
	}
	return nil
}

// readsZero says whether the cluster mapped as m reads as zeroes from
// virtual offset voff on, without looking at data.
func (q *Image) readsZero(m mapping, voff int64) bool {
	switch m.kind {
	case zero:
		return true
	case unallocated:
		// Past the image end too: that part of a last, partial cluster
		// must read as zeroes should the image grow (after the backing
		// file is dropped, say), not as the backing file beyond our end.
		return q.backing == nil || voff >= q.backing.Size() || voff >= q.end.Load()
	}
	return false
}

// readOld fills buf with what virtual offset voff read as under mapping m,
// before this write.
func (q *Image) readOld(ctx context.Context, buf []byte, voff int64, m mapping) error {
	switch m.kind {
	case zero:
		clear(buf)
		return nil
	case compressed:
		c, err := q.compressedCluster(ctx, m)
		if err != nil {
			return err
		}
		copy(buf, c[voff%q.h.clusterSize:])
		return nil
	case data:
		return q.doRun(ctx, ioRun{buf: buf, off: m.host + voff%q.h.clusterSize})
	}
	// The backing file up to the image end, zeroes past it (see readsZero).
	n := max(0, min(int64(len(buf)), q.end.Load()-voff))
	clear(buf[n:])
	if n == 0 {
		return nil
	}
	return q.doRun(ctx, ioRun{buf: buf[:n], off: voff, backing: true})
}

// boundWriteBack writes the metadata back once the changed tables would
// fill the L2 cache, so memory stays bounded without a client's flush.
func (q *Image) boundWriteBack(ctx context.Context) error {
	w := q.w
	// Changed tables are pinned outside the LRU; allow as many as QEMU's
	// default L2 cache holds (32 MiB) before writing them back unasked.
	limit := int64(max(q.l2cache.Cap(), int(maxDirtyMetadata/q.h.clusterSize)))
	if w.dirtyL2.Load() < limit && w.dirtyRB.Load() < limit {
		return nil
	}
	return q.Flush(ctx)
}

// maxDirtyMetadata bounds the changed metadata kept in memory between
// flushes.
const maxDirtyMetadata = 32 << 20

func (q *Image) logWarn(msg string, err error) {
	if q.log != nil {
		q.log.Warn(msg, "image", q.path, "err", err)
	}
}
