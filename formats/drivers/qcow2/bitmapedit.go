package qcow2

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync/atomic"
)

// Editing persistent dirty bitmaps, as `qemu-img bitmap` does: add,
// remove, clear, enable, disable and merge, applied in memory in order,
// then written at once by Commit. Commit writes new data clusters, tables
// and a new directory, makes them durable, then switches the header to
// the new directory in one write and frees the old clusters: a crash at
// any instant leaves the bitmaps as they were or as they are after, and
// at most leaked clusters. The image is opened with Options.EditBitmaps,
// so no bitmap is marked in use by the open itself.
//
// The errors an operation returns are QEMU's words (the bitmap verb puts
// "Operation OP on bitmap NAME failed: " before them).

// ErrBitmapOp marks an operation qemu-img would refuse as such.
var ErrBitmapOp = errors.New("bitmap operation refused")

// bitmapOpError is a refused operation, worded as QEMU words it.
type bitmapOpError struct{ msg string }

func (e *bitmapOpError) Error() string { return e.msg }
func (e *bitmapOpError) Is(target error) bool {
	return target == ErrBitmapOp
}

func refuse(format string, args ...any) error {
	return &bitmapOpError{msg: fmt.Sprintf(format, args...)}
}

// editedBitmap is one bitmap as the edit has it.
type editedBitmap struct {
	entry bitmapEntry // name, flags, granularity; the table on disk (tableOff 0: none yet)
	table []uint64    // the table on disk, nil for a new bitmap
	// data is the bitmap's content when the edit changed it (nil: the
	// clusters on disk stay); zero: it is all clear (no data clusters).
	data    *liveBitmap
	zero    bool
	rewrite bool // new data clusters and table at Commit
}

// BitmapEdit is an edit of one writable image's bitmaps.
type BitmapEdit struct {
	q       *Image
	bitmaps []*editedBitmap
	byName  map[string]*editedBitmap
	removed []*editedBitmap // on disk before, to be freed after Commit
	dirSize int64           // the directory's size now, for QEMU's limit
}

// EditBitmaps starts an edit of q's bitmaps. q must be writable; it was
// opened with Options.EditBitmaps (else its enabled bitmaps are live and
// stored again at close, over the edit).
func (q *Image) EditBitmaps(ctx context.Context) (*BitmapEdit, error) {
	if err := q.checkWritable("edit bitmaps"); err != nil {
		return nil, err
	}
	e := &BitmapEdit{q: q, byName: map[string]*editedBitmap{}}
	s := q.w.bitmaps
	if s == nil {
		return e, nil
	}
	if len(s.live) > 0 {
		return nil, fmt.Errorf("qcow2: edit bitmaps: the image was opened without Options.EditBitmaps, its enabled bitmaps are in use")
	}
	for i, b := range s.entries {
		e.bitmaps = append(e.bitmaps, &editedBitmap{entry: b, table: s.tables[i]})
		e.byName[b.name] = e.bitmaps[i]
	}
	e.dirSize = s.dirSize
	return e, nil
}

// find is the bitmap called name, or nil.
func (e *BitmapEdit) find(name string) *editedBitmap {
	return e.byName[name]
}

// lookup is find with QEMU's error for a bitmap that is not there.
func (e *BitmapEdit) lookup(name string) (*editedBitmap, error) {
	if b := e.find(name); b != nil {
		return b, nil
	}
	return nil, refuse("Dirty bitmap '%s' not found", name)
}

// usable refuses an in-use bitmap, as QEMU refuses an inconsistent one.
func usable(b *editedBitmap) error {
	if b.entry.flags&bmFlagInUse != 0 {
		return refuse("Bitmap '%s' is inconsistent and cannot be used\nTry block-dirty-bitmap-remove to delete this bitmap from disk", b.entry.name)
	}
	return nil
}

// DefaultBitmapGranularity is QEMU's default for a new bitmap: the
// cluster size, within 4 KiB to 64 KiB.
func (q *Image) DefaultBitmapGranularity() int64 {
	return min(max(q.h.clusterSize, 4096), 65536)
}

// dirEntrySize is a directory entry's size for a name of n bytes.
func dirEntrySize(n int) int64 { return int64(bmDirEntryLen+n+7) &^ 7 }

// Add adds an empty bitmap (granularity 0: the default), enabled unless
// disabled, with QEMU's checks in QEMU's order (qmp block-dirty-bitmap-add,
// qcow2_co_can_store_new_dirty_bitmap).
func (e *BitmapEdit) Add(name string, granularity int64, disabled bool) error {
	q := e.q
	if name == "" {
		return refuse("Bitmap name cannot be empty")
	}
	if granularity == 0 {
		granularity = q.DefaultBitmapGranularity()
	} else if granularity < 512 || granularity&(granularity-1) != 0 || granularity > 1<<31 {
		// qmp takes a uint32: the verb truncates larger values, as qemu-img does
		return refuse("Granularity must be power of 2 and at least 512")
	}
	persist := func(format string, args ...any) error {
		return refuse("Can't make bitmap '%s' persistent in '%s': %s", name, q.path, fmt.Sprintf(format, args...))
	}
	granBits := uint8(0)
	for int64(1)<<granBits < granularity {
		granBits++
	}
	size, cs := q.Size(), q.h.clusterSize
	switch nbytes := bitmapBytes(size, granBits); {
	case q.h.version < 3:
		return persist("Cannot store dirty bitmaps in qcow2 v2 files")
	case granBits > bmMaxGranularity:
		return persist("Granularity exceeds maximum (%d bytes)", int64(1)<<bmMaxGranularity)
	case granBits < bmMinGranularity:
		return persist("Granularity is under minimum (%d bytes)", int64(1)<<bmMinGranularity)
	case nbytes > bmMaxPhysBytes || nbytes > uint64(bmMaxTableEntries)*uint64(cs):
		return persist("Too much space will be occupied by the bitmap. Use larger granularity")
	case len(name) > bmMaxNameSize:
		return persist("Name length exceeds maximum (%d characters)", bmMaxNameSize)
	}
	if len(e.bitmaps) > 0 {
		switch {
		case len(e.bitmaps) >= maxBitmaps:
			return persist("Maximum number of persistent bitmaps is already reached")
		case e.dirSize+dirEntrySize(len(name)) > maxBitmapDirectorySize:
			return persist("Not enough space in the bitmap directory")
		}
	}
	if e.find(name) != nil {
		return refuse("Bitmap already exists: %s", name)
	}
	flags := uint32(bmFlagAuto)
	if disabled {
		flags = 0
	}
	b := &editedBitmap{entry: bitmapEntry{name: name, flags: flags, granBits: granBits}, zero: true, rewrite: true}
	e.bitmaps = append(e.bitmaps, b)
	e.byName[name] = b
	e.dirSize += dirEntrySize(len(name))
	return nil
}

// Remove removes a bitmap, in use or not.
func (e *BitmapEdit) Remove(name string) error {
	b, err := e.lookup(name)
	if err != nil {
		return err
	}
	for i, x := range e.bitmaps {
		if x == b {
			e.bitmaps = append(e.bitmaps[:i], e.bitmaps[i+1:]...)
			delete(e.byName, name)
			break
		}
	}
	if b.table != nil {
		e.removed = append(e.removed, b)
	}
	e.dirSize -= dirEntrySize(len(name))
	return nil
}

// Clear clears every bit of a bitmap.
func (e *BitmapEdit) Clear(name string) error {
	b, err := e.lookup(name)
	if err != nil {
		return err
	}
	if err := usable(b); err != nil {
		return err
	}
	b.data, b.zero, b.rewrite = nil, true, true
	return nil
}

// Enable makes a bitmap track writes (the auto flag).
func (e *BitmapEdit) Enable(name string) error { return e.setAuto(name, true) }

// Disable makes a bitmap stop tracking writes.
func (e *BitmapEdit) Disable(name string) error { return e.setAuto(name, false) }

func (e *BitmapEdit) setAuto(name string, on bool) error {
	b, err := e.lookup(name)
	if err != nil {
		return err
	}
	if err := usable(b); err != nil {
		return err
	}
	if on {
		b.entry.flags |= bmFlagAuto
	} else {
		b.entry.flags &^= bmFlagAuto
	}
	return nil
}

// CheckUsable refuses a bitmap that is not there or is in use, as an
// operation that changes its bits would.
func (e *BitmapEdit) CheckUsable(name string) error {
	b, err := e.lookup(name)
	if err != nil {
		return err
	}
	return usable(b)
}

// Merge sets in bitmap dst every block bitmap srcName of src marks; src
// nil is the image being edited (as the edit has it so far).
func (e *BitmapEdit) Merge(ctx context.Context, dst string, src *Image, srcName string) error {
	d, err := e.lookup(dst)
	if err != nil {
		return err
	}
	if err := usable(d); err != nil {
		return err
	}
	var from *liveBitmap
	var fromSize int64
	if src == nil {
		s, err := e.lookup(srcName)
		if err != nil {
			return err
		}
		if err := usable(s); err != nil {
			return err
		}
		if from, err = e.load(ctx, s); err != nil {
			return err
		}
		fromSize = e.q.Size()
	} else {
		if from, err = src.loadBitmapByName(ctx, srcName); err != nil {
			return err
		}
		fromSize = src.Size()
	}
	if fromSize != e.q.Size() {
		return refuse("Bitmaps are of different sizes (destination size is %d, source size is %d) and can't be merged", e.q.Size(), fromSize)
	}
	to, err := e.load(ctx, d)
	if err != nil {
		return err
	}
	if from.granBits == to.granBits {
		for i := range from.words {
			if v := from.words[i].Load(); v != 0 {
				to.words[i].Or(v)
			}
		}
	} else {
		g := int64(1) << from.granBits
		for i := uint64(0); i < from.nbits; i++ {
			if from.words[i/64].Load()&(1<<(i%64)) != 0 {
				to.mark(int64(i)*g, g)
			}
		}
	}
	d.data, d.zero, d.rewrite = to, false, true
	return nil
}

// load is b's content in memory (read once, then kept by the edit).
func (e *BitmapEdit) load(ctx context.Context, b *editedBitmap) (*liveBitmap, error) {
	q := e.q
	if b.data != nil {
		return b.data, nil
	}
	if b.zero {
		nbits := bitmapBits(q.Size(), b.entry.granBits)
		b.data = &liveBitmap{granBits: b.entry.granBits, nbits: nbits, words: make([]atomic.Uint64, (nbits+63)/64)}
		return b.data, nil
	}
	if err := q.checkBitmapMemory(b.entry.granBits); err != nil {
		return nil, err
	}
	live, err := q.loadBitmap(ctx, 0, &b.entry, b.table)
	if err != nil {
		return nil, err
	}
	b.data = live
	return live, nil
}

// checkBitmapMemory refuses to hold a bitmap bigger than the bound the
// writable open keeps to.
func (q *Image) checkBitmapMemory(granBits uint8) error {
	if n := (bitmapBits(q.Size(), granBits) + 63) / 64 * 8; n > maxLiveBitmapBytes {
		return fmt.Errorf("%w: the bitmap would take %d bytes of memory (at most %d)", ErrUnsupported, n, maxLiveBitmapBytes)
	}
	return nil
}

// loadBitmapByName reads the bitmap called name of q (opened read-only or
// not) into memory, as the source of a merge.
func (q *Image) loadBitmapByName(ctx context.Context, name string) (*liveBitmap, error) {
	if !q.h.hasBitmaps {
		return nil, refuse("Dirty bitmap '%s' not found", name)
	}
	_, entries, err := q.readBitmapDirectory(ctx)
	if err != nil {
		return nil, err
	}
	for i := range entries {
		b := &entries[i]
		if b.name != name {
			continue
		}
		if b.flags&bmFlagInUse != 0 {
			return nil, refuse("Bitmap '%s' is inconsistent and cannot be used\nTry block-dirty-bitmap-remove to delete this bitmap from disk", name)
		}
		if err := q.checkBitmapMemory(b.granBits); err != nil {
			return nil, err
		}
		q.meta.RLock()
		fileSize := q.fileSize
		q.meta.RUnlock()
		t, err := q.readBitmapTable(ctx, b, fileSize)
		if err != nil {
			return nil, err
		}
		return q.loadBitmap(ctx, i, b, t)
	}
	return nil, refuse("Dirty bitmap '%s' not found", name)
}

// Commit writes the edit: the rewritten bitmaps' data and tables, a new
// directory, durable before the header names them, then the header, then
// the old clusters freed. Nothing changed, nothing is written.
func (e *BitmapEdit) Commit(ctx context.Context) error {
	defer e.q.wrote()
	q := e.q
	ctx = context.WithoutCancel(ctx) // the steps after the first write must all happen
	old := q.w.bitmaps
	changed := len(e.removed) > 0 || old == nil && len(e.bitmaps) > 0 || old != nil && len(old.entries) != len(e.bitmaps)
	entries := make([]bitmapEntry, len(e.bitmaps))
	tables := make([][]uint64, len(e.bitmaps))
	var replaced []*editedBitmap
	for i, b := range e.bitmaps {
		entries[i], tables[i] = b.entry, b.table
		if old == nil || i >= len(old.entries) || old.entries[i].name != b.entry.name || old.entries[i].flags != b.entry.flags {
			changed = true
		}
		if !b.rewrite {
			continue
		}
		changed = true
		table, err := e.storeData(ctx, b)
		if err != nil {
			return err
		}
		raw := encodeTable(table)
		off, err := q.allocBitmapClusters(ctx, int64(len(raw)))
		if err != nil {
			return err
		}
		if _, err := q.f.WriteAt(ctx, raw, off); err != nil {
			return fmt.Errorf("qcow2: write the table of bitmap %q at %#x: %w", b.entry.name, off, err)
		}
		entries[i].tableOff, entries[i].tableSize, tables[i] = off, int64(len(table)), table
		if b.table != nil {
			replaced = append(replaced, b)
		}
	}
	if !changed {
		return nil
	}
	var dir []byte
	var dirOff int64
	if len(entries) > 0 {
		dir = encodeBitmapDirectory(entries)
		var err error
		if dirOff, err = q.allocBitmapClusters(ctx, int64(len(dir))); err != nil {
			return err
		}
		if _, err := q.f.WriteAt(ctx, dir, dirOff); err != nil {
			return fmt.Errorf("qcow2: write the bitmap directory at %#x: %w", dirOff, err)
		}
	}
	// The new clusters, their refcounts and their contents durable before
	// the header names them.
	if err := q.Flush(ctx); err != nil {
		return err
	}
	if err := q.writeBitmapsExtension(ctx, uint32(len(entries)), int64(len(dir)), dirOff); err != nil {
		return err
	}
	cs := q.h.clusterSize
	q.w.alloc.Lock()
	freeTable := func(b *editedBitmap) {
		q.releaseBitmapClusters(b.entry.tableOff, b.entry.tableSize*8)
		for _, t := range b.table {
			if off := int64(t & bmTableOffsetMask); off != 0 {
				q.releaseBitmapClusters(off, cs)
			}
		}
	}
	if old != nil {
		q.releaseBitmapClusters(old.dirOff, old.dirSize)
	}
	for _, b := range e.removed {
		freeTable(b)
	}
	for _, b := range replaced {
		freeTable(b)
	}
	q.w.alloc.Unlock()
	q.w.bitmaps = nil
	if len(entries) > 0 {
		q.w.bitmaps = &bitmapSet{entries: entries, tables: tables, dirOff: dirOff, dirSize: int64(len(dir))}
	}
	for i, b := range e.bitmaps {
		b.entry, b.table, b.data, b.zero, b.rewrite = entries[i], tables[i], nil, false, false
	}
	e.removed, e.dirSize = nil, int64(len(dir))
	return q.Flush(ctx)
}

// storeData writes b's data clusters (none for a clear bitmap) and
// returns its table.
func (e *BitmapEdit) storeData(ctx context.Context, b *editedBitmap) ([]uint64, error) {
	q := e.q
	if b.zero && b.data == nil {
		return make([]uint64, bitmapTableEntries(q.Size(), b.entry.granBits, q.h.clusterSize)), nil
	}
	return q.storeBitmapData(ctx, b.data, b.entry.name)
}

// writeBitmapsExtension points the header at the directory (count 0: no
// bitmaps, no extension), in one write of the header and its extensions,
// with the bitmaps autoclear bit set while there are bitmaps. The backing
// file name, which follows the extensions, moves with them.
func (q *Image) writeBitmapsExtension(ctx context.Context, count uint32, dirSize, dirOff int64) error {
	cs := q.h.clusterSize
	head := make([]byte, cs)
	n, err := q.f.ReadAt(ctx, head, 0)
	if err != nil && err != io.EOF {
		return fmt.Errorf("qcow2: read the header: %w", err)
	}
	head = head[:n]
	be := binary.BigEndian
	hlen := int64(q.h.headerLength)
	if q.h.version < 3 || hlen < v3HeaderLen || hlen > int64(len(head)) {
		return fmt.Errorf("%w: no version 3 header to hold bitmaps", ErrUnsupported)
	}
	end := int64(len(head))
	backOff, backLen := int64(be.Uint64(head[hdrBackingOffset:])), int64(be.Uint32(head[hdrBackingOffset+8:]))
	var backing []byte
	if backOff != 0 {
		if backOff < hlen || backOff+backLen > int64(len(head)) {
			return fmt.Errorf("%w: the backing file name at %#x is not inside the header cluster", ErrCorrupt, backOff)
		}
		backing = append([]byte(nil), head[backOff:backOff+backLen]...)
		end = backOff
	}
	var exts []byte
	p := hlen
	for p+8 <= end {
		typ, l := be.Uint32(head[p:]), int64(be.Uint32(head[p+4:]))
		if typ == extEnd || l > end-p-8 {
			break
		}
		next := min(p+8+(l+7)&^7, end)
		if typ != extBitmaps {
			exts = append(exts, head[p:next]...)
		}
		p = next
	}
	oldEnd := max(min(p+8, end), backOff+backLen) // where the old header's bytes stop
	autoclear := be.Uint64(head[hdrAutoclear:])
	if count > 0 {
		exts = be.AppendUint32(exts, extBitmaps)
		exts = be.AppendUint32(exts, 24)
		exts = be.AppendUint32(exts, count)
		exts = be.AppendUint32(exts, 0)
		exts = be.AppendUint64(exts, uint64(dirSize))
		exts = be.AppendUint64(exts, uint64(dirOff))
		autoclear |= autoclearBitmaps
	} else {
		autoclear &^= autoclearBitmaps
	}
	exts = append(exts, make([]byte, 8)...) // the end marker
	out := append(append([]byte(nil), head[:hlen]...), exts...)
	be.PutUint64(out[hdrAutoclear:], autoclear)
	if backing != nil {
		be.PutUint64(out[hdrBackingOffset:], uint64(len(out)))
		out = append(out, backing...)
	}
	if int64(len(out)) > cs {
		return fmt.Errorf("%w: the header extensions and the backing file name do not fit in the header cluster", ErrUnsupported)
	}
	// Past the end of the new header, the old one's bytes are zeroed, so
	// that no stale extension or name is left. One small write: a kill
	// can cut a long write short between pages, never this one.
	if int64(len(out)) < oldEnd {
		out = append(out, make([]byte, oldEnd-int64(len(out)))...)
	}
	if _, err := q.f.WriteAt(ctx, out, 0); err != nil {
		return fmt.Errorf("qcow2: write the header with the bitmaps extension: %w", err)
	}
	if !q.noFlush.Load() {
		if err := q.f.Fdatasync(ctx); err != nil {
			return fmt.Errorf("qcow2: write the header with the bitmaps extension: %w", err)
		}
	}
	q.h.autoclear = autoclear
	q.h.hasBitmaps = count > 0
	q.h.bitmaps = bitmapsExtension{count: count, dirSize: uint64(dirSize), dirOffset: uint64(dirOff)}
	if backing != nil {
		q.h.backingOffset = uint64(hlen) + uint64(len(exts))
	}
	return nil
}
