package qcow2

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/formats"
)

// Copy-on-read and streaming (QEMU's copy-on-read filter, the
// BDRV_REQ_COPY_ON_READ path of bdrv_co_preadv, and block-stream).
//
// A read of clusters this image does not allocate takes them whole from
// the backing chain and writes them into this image, so that each block
// crosses from the backing file once. The copy holds the range lock on its
// clusters (the lock allocating writes, zeroing and discard take) from the
// second look at their mapping until they are linked: a guest write to the
// same cluster either came first (the cluster is allocated by then and the
// copy leaves it alone) or waits, and then overwrites the copy. Stale
// backing data never lands over newer guest data.
//
// Clusters whose backing data is all zeroes become zero clusters (v3), as
// QEMU writes zeroes for them, instead of data clusters of zeroes.

// maxCopyRun bounds the bytes one copy holds in memory and under lock.
const maxCopyRun = 1 << 20

// ReadCopy reads p at off as ReadAt does, after copying the clusters it
// touches that this image does not allocate from the backing chain into
// this image. Read-only or without a backing file it is ReadAt.
func (q *Image) ReadCopy(ctx context.Context, p []byte, off int64) (int, error) {
	if q.w == nil || q.backing == nil || len(p) == 0 {
		return q.ReadAt(ctx, p, off)
	}
	if off < 0 || off+int64(len(p)) > q.Size() {
		return 0, fmt.Errorf("qcow2: read [%d, +%d): %w", off, len(p), formats.ErrOutOfRange)
	}
	cs := q.h.clusterSize
	a := off / cs * cs
	b := min((off+int64(len(p))+cs-1)/cs*cs, q.Size())
	_, all, err := q.populate(ctx, a, b, p, off)
	if err == nil {
		err = q.boundWriteBack(ctx)
	}
	if isNoSpace(err) {
		// The overlay's disk is full: the copy is given up, not the
		// read, which the backing file still answers where the copy
		// failed (a failed copy leaves its clusters unallocated).
		// Guest writes fail as they must; reads go on.
		return q.ReadAt(ctx, p, off)
	}
	if err != nil {
		return 0, err
	}
	if all {
		return len(p), nil // every byte came from the copies
	}
	// Some clusters were allocated already (or became so): read them
	// where they are, with the copies.
	return q.ReadAt(ctx, p, off)
}

// isNoSpace says the host file system had no room (or quota) for a copy.
func isNoSpace(err error) bool {
	return errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT)
}

// TryReadHere is TryReadAt for clusters this image allocates: an
// unallocated one says "would wait", so that ReadCopy copies it. (A
// cluster discarded between the look and the read is read through from
// the backing file without a copy: as correct, and copied next time.)
func (q *Image) TryReadHere(p []byte, off int64) bool {
	cs := q.h.clusterSize
	if len(p) == 0 || off < 0 || off+int64(len(p)) > q.Size() {
		return false
	}
	if q.w != nil {
		if !q.w.users.TryRLock() {
			return false
		}
		m, ok := q.tryLookup(off / cs)
		q.w.users.RUnlock()
		if !ok || m.kind == unallocated {
			return false
		}
	}
	return q.TryReadAt(p, off)
}

// Populate copies the clusters in [off, off+n) that this image does not
// allocate from the backing chain into this image (block-stream's step),
// and returns how many bytes it copied.
func (q *Image) Populate(ctx context.Context, off, n int64) (int64, error) {
	if err := q.checkWritable("copy from the backing file"); err != nil {
		return 0, err
	}
	if off < 0 || n < 0 || off+n > q.Size() {
		return 0, fmt.Errorf("qcow2: populate [%d, +%d): %w", off, n, formats.ErrOutOfRange)
	}
	if q.backing == nil || n == 0 {
		return 0, nil
	}
	cs := q.h.clusterSize
	copied, _, err := q.populate(ctx, off/cs*cs, min((off+n+cs-1)/cs*cs, q.Size()), nil, 0)
	if err != nil {
		return copied, err
	}
	return copied, q.boundWriteBack(ctx)
}

// populate copies the unallocated clusters of [a, b) (a cluster-aligned,
// b aligned or the image end), a run of at most maxCopyRun at a time. p,
// when not nil, is a read at off inside [a, b): the copies fill it. all
// says every cluster of [a, b) was copied here (p is then filled).
func (q *Image) populate(ctx context.Context, a, b int64, p []byte, off int64) (copied int64, all bool, err error) {
	cs := q.h.clusterSize
	run := max(cs, maxCopyRun/cs*cs)
	q.w.users.RLock()
	defer q.w.users.RUnlock()
	defer q.wrote()
	all = true
	for pos := a; pos < b; {
		m, _, err := q.lookup(ctx, pos/cs)
		if err != nil {
			return copied, false, err
		}
		if m.kind != unallocated {
			all = false
			pos += cs
			continue
		}
		end := min(b, pos+cs)
		for end < b && end-pos < run {
			next, _, err := q.lookup(ctx, end/cs)
			if err != nil {
				return copied, false, err
			}
			if next.kind != unallocated {
				break
			}
			end = min(b, end+cs)
		}
		c, whole, err := q.copyRun(ctx, pos, end, p, off)
		copied += c
		if err != nil {
			return copied, false, err
		}
		all = all && whole
		pos = end
	}
	return copied, all, nil
}

// copyRun copies [a, b) from the backing chain under the range lock, the
// clusters still unallocated once the lock is held; whole says all were.
// The caller holds w.users.
func (q *Image) copyRun(ctx context.Context, a, b int64, p []byte, off int64) (copied int64, whole bool, err error) {
	cs := q.h.clusterSize
	vcA, vcB := a/cs, (b+cs-1)/cs
	unlock, err := q.w.clusters.Lock(ctx, vcA*cs, (vcB-vcA)*cs)
	if err != nil {
		return 0, false, err
	}
	defer unlock()
	// Look again under the lock: a guest write may have allocated since,
	// and its data wins.
	olds := make([]mapping, vcB-vcA)
	for i := range olds {
		if olds[i], _, err = q.lookup(ctx, vcA+int64(i)); err != nil {
			return 0, false, err
		}
	}
	whole = true
	buf := make([]byte, b-a)
	for i := 0; i < len(olds); {
		if olds[i].kind != unallocated {
			whole = false
			i++
			continue
		}
		j := i + 1
		for j < len(olds) && olds[j].kind == unallocated {
			j++
		}
		s, e := (vcA+int64(i))*cs, min(b, (vcA+int64(j))*cs)
		piece := buf[s-a : e-a]
		if err := q.readBacking(ctx, piece, s); err != nil {
			return copied, false, err
		}
		if err := q.storeCopy(ctx, piece, s, vcA+int64(i), olds[i:j]); err != nil {
			return copied, false, err
		}
		copied += e - s
		if p != nil {
			// The part of the read inside [s, e).
			ra, rb := max(s, off), min(e, off+int64(len(p)))
			if ra < rb {
				copy(p[ra-off:rb-off], piece[ra-s:rb-s])
			}
		}
		i = j
	}
	return copied, whole, nil
}

// storeCopy links data copied from the backing chain for clusters
// [vc, vc+len(olds)), all unallocated, under the caller's range lock:
// zero clusters when the data is all zeroes and the version has them,
// new data clusters otherwise.
func (q *Image) storeCopy(ctx context.Context, data []byte, off, vc int64, olds []mapping) error {
	if q.h.version < 3 || !allZero(data) {
		return q.allocRun(ctx, data, off, vc, olds)
	}
	span := q.h.l2Entries
	end := vc + int64(len(olds))
	q.w.alloc.Lock()
	defer q.w.alloc.Unlock()
	for a := vc; a < end; {
		b := min(end, (a/span+1)*span)
		if err := q.setClustersInTable(ctx, a, b, opZeroKeep); err != nil {
			return err
		}
		a = b
	}
	return nil
}

func allZero(b []byte) bool {
	for len(b) >= 8 {
		if binary.LittleEndian.Uint64(b) != 0 {
			return false
		}
		b = b[8:]
	}
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// DropBacking makes the image stand alone (block-stream's completion):
// the header no longer names a backing file or its format. The caller has
// copied every cluster the backing chain answered for, flushed, and has no
// request in flight. The change is crash-safe: first the extensions are
// rewritten without the backing format (the name stays where the header
// points, so the image still reads the same), made durable; then the
// backing name's offset and length, 12 bytes of one sector, become zero in
// one write, made durable; only then is the unreferenced name cleared.
func (q *Image) DropBacking(ctx context.Context) error {
	defer q.wrote()
	if err := q.checkWritable("drop the backing file"); err != nil {
		return err
	}
	if q.h.backingOffset != 0 && q.h.nbSnapshots > 0 {
		// A snapshot reads its unallocated clusters from the backing
		// file too, and only the active layer was copied: without the
		// backing file they would read as zeroes. (QEMU's block-stream
		// drops it all the same.)
		return fmt.Errorf("%w: the image has %d internal snapshots, which would lose what they read from the backing file (delete them first: qemu-img snapshot -d)", ErrUnsupported, q.h.nbSnapshots)
	}
	if err := q.Flush(ctx); err != nil {
		return err
	}
	if q.h.backingOffset == 0 {
		return nil
	}
	// From here on the header changes in steps that must all happen: a
	// cancellation (SIGINT) between them would leave the backing file
	// named without its format, probed at every later open.
	ctx = context.WithoutCancel(ctx)
	hlen := int64(q.h.headerLength)
	if q.h.version < 3 {
		hlen = 72
	}
	nameOff, nameLen := int64(q.h.backingOffset), int64(q.h.backingSize)
	if nameOff < hlen {
		return fmt.Errorf("%w: backing file name at %#x inside the header fields", ErrCorrupt, nameOff)
	}
	region := make([]byte, nameOff-hlen) // extensions, up to the name
	if len(region) > 0 {
		if _, err := q.f.ReadAt(ctx, region, hlen); err != nil {
			return fmt.Errorf("qcow2: read header extensions: %w", err)
		}
	}
	be := binary.BigEndian
	kept := make([]byte, 0, len(region))
	for pos := 0; pos+8 <= len(region); {
		typ, n := be.Uint32(region[pos:]), int(be.Uint32(region[pos+4:]))
		if typ == extEnd {
			break
		}
		next := pos + 8 + (n+7)&^7
		if next > len(region) {
			return fmt.Errorf("%w: header extension %#x overruns the backing file name", ErrCorrupt, typ)
		}
		if typ != extBackingFmt {
			kept = append(kept, region[pos:next]...)
		}
		pos = next
	}
	// Once the header names no backing file, extensions are read up to
	// an end marker, past where the name was: the marker must fit before
	// the name, which stays in place until the header forgets it. QEMU
	// always writes one there; a crafted header may leave no room.
	if len(kept)+8 > len(region) {
		return fmt.Errorf("%w: no room for the end of the header extensions before the backing file name at %#x (qemu-img rebase -b '' rewrites the header whole)", ErrUnsupported, nameOff)
	}
	kept = append(kept, make([]byte, len(region)-len(kept))...)
	sync := func(what string) error {
		if err := q.f.Fdatasync(ctx); err != nil {
			return fmt.Errorf("qcow2: flush %s: %w", what, err)
		}
		return nil
	}
	if len(kept) > 0 {
		if _, err := q.f.WriteAt(ctx, kept, hlen); err != nil {
			return fmt.Errorf("qcow2: write header extensions: %w", err)
		}
		if err := sync("header extensions"); err != nil {
			return err
		}
	}
	if _, err := q.f.WriteAt(ctx, make([]byte, 12), hdrBackingOffset); err != nil {
		return fmt.Errorf("qcow2: clear the backing file name's place: %w", err)
	}
	if err := sync("header"); err != nil {
		return err
	}
	if _, err := q.f.WriteAt(ctx, make([]byte, nameLen), nameOff); err != nil {
		return fmt.Errorf("qcow2: clear the old backing file name: %w", err)
	}
	if err := sync("header"); err != nil {
		return err
	}
	q.h.backingOffset, q.h.backingSize = 0, 0
	q.h.backingFile, q.h.backingFormat = "", ""
	if q.backing != nil {
		b := q.backing
		q.backing = nil
		if err := b.Close(); err != nil {
			return fmt.Errorf("qcow2: close the backing file: %w", err)
		}
	}
	return nil
}
