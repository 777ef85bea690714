package vmdk

import (
	"bytes"
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/klauspost/compress/zlib"
	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
)

// Writes, as QEMU's vmdk driver writes: in place into a flat extent or an
// allocated grain; a grain not yet allocated is appended to its extent
// file whole (what the write does not cover read from the parent, or
// zeroes) and then linked. The order makes a crash leave at worst a leak:
// the grain is written and synced (fdatasync) before its grain table
// entry, and the redundant grain table's entry comes last, so no table
// entry ever points at bytes not yet on the disk. The sync is shared:
// new grains wait, pending (their sectors in memory, where lookups find
// them), until maxPendingGrains of an extent are, or the image is
// flushed or closed; then one fdatasync makes them all durable and their
// entries are written. A crash meanwhile loses the pending grains, as it
// may lose any write not yet flushed. (QEMU 7.2 syncs once a grain,
// after its table entry: 1026 fdatasyncs for a 64 MiB convert -t
// writeback, as many as here before the batching.) A stream-optimized
// extent takes each grain once, deflated behind a grain marker, as QEMU's
// does; rewriting a grain is refused there, as QEMU refuses it.
//
// An image opened writable is checked further than for reading: its
// primary grain directory must be intact (not replaced by the redundant
// one), every grain table present, and no table, directory or descriptor
// may overlap another; a grain that lies on any of them is never written.

// tableVersions orders the loads of grain tables with the writes that
// change them: a load caches what it read only if no table changed since
// it began, so a table read before a write never replaces the write's.
type tableVersions struct {
	mu  sync.Mutex
	gen atomic.Uint64
}

// hostRange is [start, end) of an extent file.
type hostRange struct{ start, end int64 }

// writer is what an image opened writable keeps.
type writer struct {
	// mu serialises allocations (and the CID's update): a grain is
	// looked up again under it, so two writes never allocate one grain
	// twice.
	mu      sync.Mutex
	cidDone atomic.Bool
	noFlush atomic.Bool
	// descAt is where the descriptor lies in the image's file; descMax
	// its room when embedded in a sparse file, -1 for a descriptor file.
	descAt, descMax int64
	deflaters       sync.Pool // *zlib.Writer
}

// readOnlyHere is a variant of vmdk written by nobody here: a writable
// open of it is refused with formats.ErrReadOnly (the registry then
// points at a qcow2 overlay), its message the reason alone.
type readOnlyHere struct{ why string }

func (r readOnlyHere) Error() string        { return r.why }
func (r readOnlyHere) Is(target error) bool { return target == formats.ErrReadOnly }

// errStreamRewrite is QEMU's refusal to write a grain of a
// stream-optimized extent twice.
var errStreamRewrite = fmt.Errorf("%w: could not write to allocated cluster for streamOptimized", formats.ErrNotSupported)

// openWritable checks that the image may be written and prepares its
// extents for writing, refusing in one line what it will not write.
func (im *Image) openWritable(ctx context.Context) error {
	w := &writer{descAt: 0, descMax: -1}
	for i, e := range im.extents {
		if !e.sparse || e.f == nil {
			continue
		}
		if i == 0 && e.f == im.f {
			w.descAt, w.descMax = int64(e.hdr.descOffset)*sectorSize, int64(e.hdr.descSize)*sectorSize
		}
		if err := e.openWritable(ctx); err != nil {
			var ro readOnlyHere
			if errors.As(err, &ro) {
				return err
			}
			return fmt.Errorf("%s: %w; refusing to write it", e.name, err)
		}
	}
	im.w = w
	return nil
}

func (e *extent) openWritable(ctx context.Context) error {
	switch {
	case e.usedRGD:
		return fmt.Errorf("%w: the grain directory is damaged (only the redundant one reads)", ErrCorrupt)
	case e.gdAtEnd:
		return readOnlyHere{"vmdk stream-optimized files with the grain directory in the footer are read here, not written"}
	case e.compressed && !e.marker:
		return readOnlyHere{"vmdk compressed grains without grain markers are read here, not written"}
	case e.compressed && e.fileEnd.Load() > e.grainStart:
		return readOnlyHere{"a vmdk streamOptimized image takes each grain once, as it is converted (as in QEMU), and this one holds grains"}
	}
	end := e.fileEnd.Load()
	meta := []hostRange{{0, sectorSize}}
	if e.hdr.descOffset != 0 {
		meta = append(meta, hostRange{int64(e.hdr.descOffset) * sectorSize, int64(e.hdr.descOffset+e.hdr.descSize) * sectorSize})
	}
	gtBytes := e.gtes * 4
	addDir := func(at uint64, gd []uint32, what string) error {
		meta = append(meta, hostRange{int64(at) * sectorSize, int64(at)*sectorSize + int64(len(gd))*4})
		for i, d := range gd {
			switch {
			case d == 0 && gd[i] != e.gd[i]:
				return fmt.Errorf("%w: %s entry %d is empty, the grain directory's is not", ErrCorrupt, what, i)
			case d == 0:
				return readOnlyHere{fmt.Sprintf("vmdk sparse extents without a grain table (%s entry %d) are read here, not written", what, i)}
			}
			meta = append(meta, hostRange{int64(d) * sectorSize, int64(d)*sectorSize + gtBytes})
		}
		return nil
	}
	if err := addDir(e.hdr.gdOffset, e.gd, "grain directory"); err != nil {
		return err
	}
	if e.hdr.flags&flagRGD != 0 && e.hdr.rgdOffset != 0 {
		rgd, err := readGD(ctx, e, e.hdr.rgdOffset, uint64(len(e.gd)), end)
		if err != nil {
			return fmt.Errorf("redundant grain directory: %w", err)
		}
		if err := addDir(e.hdr.rgdOffset, rgd, "redundant grain directory"); err != nil {
			return err
		}
		e.rgd = rgd
	}
	slices.SortFunc(meta, func(a, b hostRange) int { return cmp.Compare(a.start, b.start) })
	for i := 1; i < len(meta); i++ {
		if meta[i].start < meta[i-1].end {
			return fmt.Errorf("%w: metadata at %d and %d overlap", ErrCorrupt, meta[i-1].start, meta[i].start)
		}
	}
	e.meta = meta
	e.next = (max(end, e.grainStart, meta[len(meta)-1].end) + sectorSize - 1) &^ (sectorSize - 1)
	return nil
}

// onMeta says whether [at, at+n) of the extent file overlaps metadata.
func (e *extent) onMeta(at, n int64) bool {
	i := sort.Search(len(e.meta), func(i int) bool { return e.meta[i].end > at })
	return i < len(e.meta) && e.meta[i].start < at+n
}

// SetNoFlush makes Flush's syncs, and the sync before grain table
// updates, no-ops (new grains are linked at once): qemu-img convert's cache=unsafe, for a target whose crash
// safety nobody needs (an interrupted conversion is redone).
func (im *Image) SetNoFlush(on bool) {
	if im.w != nil {
		im.w.noFlush.Store(on)
	}
}

func (im *Image) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	if im.w == nil {
		return 0, formats.ErrReadOnly
	}
	if off < 0 || off > im.size || int64(len(p)) > im.size-off {
		return 0, fmt.Errorf("vmdk: %s: write of %d bytes at %d: %w", im.name, len(p), off, formats.ErrOutOfRange)
	}
	if err := im.touch(ctx); err != nil {
		return 0, err
	}
	done := 0
	for done < len(p) {
		at := off + int64(done)
		e := im.find(at)
		rel := at - e.start
		n := min(int64(len(p)-done), e.size-rel)
		var err error
		switch {
		case e.f == nil:
			err = fmt.Errorf("%w: a ZERO extent is not written", formats.ErrNotSupported)
		case !e.sparse:
			_, err = e.f.WriteAt(ctx, p[done:done+int(n)], e.flatOff+rel)
		default:
			n = min(n, e.grain-rel%e.grain)
			err = im.writeGrain(ctx, e, p[done:done+int(n)], rel)
		}
		if err != nil {
			return done, fmt.Errorf("vmdk: %s: write at %d: %w", im.name, at, err)
		}
		done += int(n)
	}
	return done, nil
}

// writeGrain writes p at rel of sparse extent e, inside one grain.
func (im *Image) writeGrain(ctx context.Context, e *extent, p []byte, rel int64) error {
	st, sector, _, err := e.lookupGrain(ctx, rel, false)
	if err != nil {
		return err
	}
	if st == grainData {
		return e.writeInPlace(ctx, p, rel, sector)
	}
	return im.allocGrain(ctx, e, p, rel, nil)
}

// writeInPlace writes p at rel into its allocated grain at sector.
func (e *extent) writeInPlace(ctx context.Context, p []byte, rel int64, sector uint32) error {
	if e.compressed {
		return errStreamRewrite
	}
	host := int64(sector) * sectorSize
	if e.onMeta(host, e.grain) {
		return fmt.Errorf("%w: %s: the grain at %d lies on metadata (sector %d)", ErrCorrupt, e.name, rel, sector)
	}
	_, err := e.f.WriteAt(ctx, p, host+rel%e.grain)
	return err
}

// allocGrain appends the grain at rel of e to its file and links it: p
// are the bytes written at rel (within the grain), or comp the whole
// grain deflated (a stream-optimized extent's, from CompressCluster).
func (im *Image) allocGrain(ctx context.Context, e *extent, p []byte, rel int64, comp []byte) error {
	im.w.mu.Lock()
	defer im.w.mu.Unlock()
	st, sector, _, err := e.lookupGrain(ctx, rel, false)
	if err != nil {
		return err
	}
	if st == grainData { // allocated by a write that held the lock first
		if comp != nil {
			return errStreamRewrite
		}
		return e.writeInPlace(ctx, p, rel, sector)
	}
	g, inG := rel/e.grain, rel%e.grain
	if comp == nil {
		buf := p
		if int64(len(p)) != e.grain {
			buf = make([]byte, e.grain)
			if st == grainUnalloc {
				if err := im.readParent(ctx, buf, e.start+g*e.grain, e.start+e.size); err != nil {
					return err
				}
			}
			copy(buf[inG:], p)
		}
		if !e.compressed {
			return e.link(ctx, g, buf, im.w.noFlush.Load())
		}
		if comp, err = im.deflate(buf); err != nil {
			return err
		}
	}
	// A grain marker: the grain's first sector in the extent, the length;
	// then the deflated bytes, to a sector's end.
	rec := make([]byte, (12+int64(len(comp))+sectorSize-1)&^(sectorSize-1))
	binary.LittleEndian.PutUint64(rec, uint64(g*e.grain/sectorSize))
	binary.LittleEndian.PutUint32(rec[8:], uint32(len(comp)))
	copy(rec[12:], comp)
	return e.link(ctx, g, rec, im.w.noFlush.Load())
}

// readParent fills buf with the parent's bytes from off (zeroes past its
// end, or past end, the extent's), for a grain a write covers in part.
func (im *Image) readParent(ctx context.Context, buf []byte, off, end int64) error {
	if im.parent == nil {
		return nil
	}
	n := min(int64(len(buf)), end-off, im.parent.Size()-off)
	if n <= 0 {
		return nil
	}
	if _, err := im.parent.ReadAt(ctx, buf[:n], off); err != nil {
		return fmt.Errorf("read the parent at %d: %w", off, err)
	}
	return nil
}

// maxPendingGrains is how many new grains of an extent wait for one
// fdatasync before their table entries are written: 16 MiB of 64 KiB
// grains, a sync where there were 256, and a table of a few KiB in memory.
const maxPendingGrains = 256

// pendingGrains are the grains of an extent written since its last sync
// and not yet linked: grain index to sector. Lookups read it under its
// own lock (reads do not take the writer's); it changes under the
// writer's lock.
type pendingGrains struct {
	mu sync.Mutex
	n  atomic.Int64 // len(m), read without the lock
	m  map[int64]uint32
}

func (p *pendingGrains) get(g int64) (uint32, bool) {
	if p.n.Load() == 0 {
		return 0, false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	v, ok := p.m[g]
	return v, ok
}

func (p *pendingGrains) put(g int64, v uint32) int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.m == nil {
		p.m = map[int64]uint32{}
	}
	p.m[g] = v
	p.n.Store(int64(len(p.m)))
	return int64(len(p.m))
}

func (p *pendingGrains) drop(g int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.m, g)
	p.n.Store(int64(len(p.m)))
}

// sorted returns the pending grains (index, sector) in the order of
// their indexes, so that the table entries are written in the tables'
// order.
func (p *pendingGrains) sorted() [][2]int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([][2]int64, 0, len(p.m))
	for g, v := range p.m {
		out = append(out, [2]int64{g, int64(v)})
	}
	slices.SortFunc(out, func(a, b [2]int64) int { return cmp.Compare(a[0], b[0]) })
	return out
}

// link writes rec (a grain, or a marker and its deflated grain) at the
// end of e's file and points grain g at it: the bytes first; then, once
// a sync made them durable (linkPending), the grain table entry; then
// the redundant table's. noSync (cache=unsafe): the entries at once,
// with no sync. Called with the writer's lock held.
func (e *extent) link(ctx context.Context, g int64, rec []byte, noSync bool) error {
	at := e.next
	if at/sectorSize > 0xffffffff {
		return fmt.Errorf("%w: %s: the extent file is full (grains lie at 32-bit sectors)", formats.ErrNotSupported, e.name)
	}
	if _, err := e.f.WriteAt(ctx, rec, at); err != nil {
		return fmt.Errorf("write grain at %d: %w", at, err)
	}
	e.next = at + int64(len(rec))
	if e.fileEnd.Load() < e.next {
		e.fileEnd.Store(e.next)
	}
	if noSync {
		return e.setGTE(ctx, g, uint32(at/sectorSize))
	}
	if e.pend.put(g, uint32(at/sectorSize)) >= maxPendingGrains {
		return e.linkPending(ctx, true)
	}
	return nil
}

// linkPending makes e's pending grains durable with one fdatasync (none
// when sync is false: cache=unsafe) and then writes their table entries;
// each grain leaves the pending map only once its entry is in the table
// cache, so a lookup always finds it in one or the other. Called with
// the writer's lock held.
func (e *extent) linkPending(ctx context.Context, sync bool) error {
	if e.pend.n.Load() == 0 {
		return nil
	}
	if sync {
		if err := e.f.Fdatasync(ctx); err != nil {
			return fmt.Errorf("sync the grains written since the last sync: %w", err)
		}
	}
	for _, gv := range e.pend.sorted() {
		if err := e.setGTE(ctx, gv[0], uint32(gv[1])); err != nil {
			return err
		}
		e.pend.drop(gv[0])
	}
	return nil
}

// linkPending links the pending grains of every extent of the image.
func (im *Image) linkPending(ctx context.Context) error {
	im.w.mu.Lock()
	defer im.w.mu.Unlock()
	sync := !im.w.noFlush.Load()
	for _, e := range im.extents {
		if err := e.linkPending(ctx, sync); err != nil {
			return fmt.Errorf("vmdk: %s: link new grains of %s: %w", im.name, e.name, err)
		}
	}
	return nil
}

// setGTE sets grain g's table entry to v, in the grain table, then in
// the redundant one, then in the cache.
func (e *extent) setGTE(ctx context.Context, g int64, v uint32) error {
	gdi, idx := g/e.gtes, g%e.gtes
	t, err := e.gt(ctx, e.gd[gdi], false)
	if err != nil {
		return err
	}
	var b [4]byte
	binary.LittleEndian.PutUint32(b[:], v)
	if _, err := e.f.WriteAt(ctx, b[:], int64(e.gd[gdi])*sectorSize+idx*4); err != nil {
		return fmt.Errorf("write grain table entry %d: %w", g, err)
	}
	if e.rgd != nil {
		if _, err := e.f.WriteAt(ctx, b[:], int64(e.rgd[gdi])*sectorSize+idx*4); err != nil {
			return fmt.Errorf("write redundant grain table entry %d: %w", g, err)
		}
	}
	nt := slices.Clone(t)
	nt[idx] = v
	e.tables.mu.Lock()
	e.tables.gen.Add(1)
	e.gtCache.Put(e.key(e.gd[gdi]), nt)
	e.tables.mu.Unlock()
	return nil
}

// touch gives the image a new CID before its first write, as QEMU does,
// so that a delta disk made on it sees that its parent changed.
func (im *Image) touch(ctx context.Context) error {
	if im.w.cidDone.Load() {
		return nil
	}
	im.w.mu.Lock()
	defer im.w.mu.Unlock()
	if im.w.cidDone.Load() {
		return nil
	}
	room := im.w.descMax
	if room < 0 {
		room = maxDescFile
	}
	buf := make([]byte, room)
	n, err := im.f.ReadAt(ctx, buf, im.w.descAt)
	if err != nil && n == 0 {
		return fmt.Errorf("vmdk: %s: read the descriptor: %w", im.name, err)
	}
	old := buf[:n]
	if i := bytes.IndexByte(old, 0); i >= 0 {
		old = old[:i]
	}
	text := string(old)
	i, j := strings.Index(text, "CID"), strings.Index(text, "parentCID")
	if i < 0 || j < i+4 {
		return fmt.Errorf("%w: %s: the descriptor's CID is not where QEMU writes it", ErrCorrupt, im.name)
	}
	text = text[:i+4] + fmt.Sprintf("%x\n", rand.Uint32()) + text[j:]
	out := []byte(text)
	if im.w.descMax >= 0 {
		if int64(len(out)) > im.w.descMax {
			return fmt.Errorf("%w: %s: the descriptor outgrows its %d bytes", ErrCorrupt, im.name, im.w.descMax)
		}
		out = append(out, make([]byte, max(len(old)-len(out), 0))...) // no tail of the old text left
	}
	if _, err := im.f.WriteAt(ctx, out, im.w.descAt); err != nil {
		return fmt.Errorf("vmdk: %s: write the descriptor: %w", im.name, err)
	}
	if im.w.descMax < 0 {
		if err := unix.Ftruncate(im.f.Fd(), int64(len(out))); err != nil {
			return fmt.Errorf("vmdk: %s: truncate the descriptor: %w", im.name, err)
		}
	}
	if !im.w.noFlush.Load() {
		if err := im.f.Fdatasync(ctx); err != nil {
			return fmt.Errorf("vmdk: %s: sync the descriptor: %w", im.name, err)
		}
	}
	im.w.cidDone.Store(true)
	return nil
}

// WriteZeroes makes [off, off+n) read as zeroes: whole grains of an
// extent with zeroed-grain entries become such entries (a grain they
// held is leaked, as QEMU leaks it), grains that read as zeroes already
// are left alone, and the rest is written with zeroes.
func (im *Image) WriteZeroes(ctx context.Context, off, n int64, _ bool) error {
	if im.w == nil {
		return formats.ErrReadOnly
	}
	if off < 0 || n < 0 || off > im.size || n > im.size-off {
		return fmt.Errorf("vmdk: %s: zero %d bytes at %d: %w", im.name, n, off, formats.ErrOutOfRange)
	}
	if n == 0 {
		return nil
	}
	if err := im.touch(ctx); err != nil {
		return err
	}
	write := func(ctx context.Context, p []byte, at int64) (int, error) { return im.WriteAt(ctx, p, at) }
	for end := off + n; off < end; {
		e := im.find(off)
		rel := off - e.start
		k := min(end-off, e.size-rel)
		if e.sparse {
			k = min(k, e.grain-rel%e.grain)
			skip, err := im.zeroGrain(ctx, e, rel, k)
			if err != nil {
				return fmt.Errorf("vmdk: %s: zero at %d: %w", im.name, off, err)
			}
			if skip {
				off += k
				continue
			}
		}
		if e.f != nil {
			if err := formats.WriteZeroBuffers(ctx, write, off, k, 1); err != nil {
				return err
			}
		}
		off += k
	}
	return nil
}

// zeroGrain zeroes [rel, rel+k) of one grain of e by its metadata where
// it can; false: the bytes are to be written.
func (im *Image) zeroGrain(ctx context.Context, e *extent, rel, k int64) (bool, error) {
	st, _, _, err := e.lookupGrain(ctx, rel, false)
	if err != nil {
		return false, err
	}
	abs := e.start + rel - rel%e.grain
	fromParent := im.parent != nil && abs < im.parent.Size()
	switch {
	case st == grainZero, st == grainUnalloc && !fromParent:
		return true, nil
	case !e.zeroGrain || k != e.grain && !(rel%e.grain == 0 && rel+k == e.size):
		return false, nil
	}
	im.w.mu.Lock()
	defer im.w.mu.Unlock()
	g := rel / e.grain
	if err := e.setGTE(ctx, g, gteZeroed); err != nil {
		return false, err
	}
	e.pend.drop(g) // a pending grain zeroed is leaked, never linked
	return true, nil
}

// files are the image's open files: the descriptor's and the extents'.
func (im *Image) files() []aio.File {
	fs := []aio.File{im.f}
	for _, e := range im.extents {
		if e.f != nil {
			fs = append(fs, e.f)
		}
	}
	return fs
}

// Discard keeps the data: QEMU's vmdk discards nothing either, and what a
// discarded range reads is unspecified.
func (im *Image) Discard(context.Context, int64, int64) error {
	if im.w == nil {
		return formats.ErrReadOnly
	}
	return nil
}

// Resize is refused, as QEMU refuses it for vmdk.
func (im *Image) Resize(context.Context, int64) error {
	if im.w == nil {
		return formats.ErrReadOnly
	}
	return fmt.Errorf("vmdk: %s: resize: %w", im.name, formats.ErrNotSupported)
}

// Flush makes the writes durable: the pending grains synced and linked,
// then every file of the image synced.
func (im *Image) Flush(ctx context.Context) error {
	if im.w == nil {
		return nil
	}
	if err := im.linkPending(ctx); err != nil {
		return err
	}
	if im.w.noFlush.Load() {
		return nil
	}
	seen := map[int]bool{}
	for _, f := range im.files() {
		if seen[f.Fd()] {
			continue
		}
		seen[f.Fd()] = true
		if err := f.Fdatasync(ctx); err != nil {
			return fmt.Errorf("vmdk: %s: flush %s: %w", im.name, f.Name(), err)
		}
	}
	return nil
}

// ClusterSize is the grain of the image's first sparse extent: the unit
// CompressCluster takes; 0 without one (a flat image has no clusters,
// and convert -c refuses it, as qemu-img does: "invalid cluster size").
func (im *Image) ClusterSize() int64 {
	for _, e := range im.extents {
		if e.sparse {
			return e.grain
		}
	}
	return 0
}

// NeedsCompressedWrites: every grain of the image is stored deflated
// (a stream-optimized extent's), so a conversion compresses them all, on
// every core (QEMU's needs_compressed_writes).
func (im *Image) NeedsCompressedWrites() bool {
	return len(im.extents) > 0 && im.extents[0].sparse && im.extents[0].compressed
}

// CompressCluster deflates p, one grain (or the image's last, shorter
// one, padded with zeroes as the grain is stored), when the image stores
// grains deflated; ok false otherwise (the grain is written as it is).
// Safe for concurrent use: it touches no image state but its pool.
func (im *Image) CompressCluster(p []byte) ([]byte, bool, error) {
	if !im.NeedsCompressedWrites() {
		return nil, false, nil
	}
	if im.w == nil {
		return nil, false, formats.ErrReadOnly
	}
	g := im.extents[0].grain
	if int64(len(p)) > g || len(p) == 0 {
		return nil, false, fmt.Errorf("vmdk: compress %d bytes: want one grain of %d", len(p), g)
	}
	if int64(len(p)) < g {
		q := make([]byte, g)
		copy(q, p)
		p = q
	}
	c, err := im.deflate(p)
	return c, err == nil, err
}

// WriteCompressed stores comp, the grain at off deflated by
// CompressCluster, as a new grain.
func (im *Image) WriteCompressed(ctx context.Context, comp []byte, off int64) error {
	if im.w == nil {
		return formats.ErrReadOnly
	}
	if off < 0 || off >= im.size {
		return fmt.Errorf("vmdk: %s: compressed write at %d: %w", im.name, off, formats.ErrOutOfRange)
	}
	if err := im.touch(ctx); err != nil {
		return err
	}
	e := im.find(off)
	if !e.sparse || !e.compressed || (off-e.start)%e.grain != 0 {
		return fmt.Errorf("vmdk: %s: compressed write at %d: not a grain of a stream-optimized extent", im.name, off)
	}
	if err := im.allocGrain(ctx, e, nil, off-e.start, comp); err != nil {
		return fmt.Errorf("vmdk: %s: write the grain at %d: %w", im.name, off, err)
	}
	return nil
}

// deflate returns p deflated as a zlib stream (QEMU's compress(), at its
// default level), in a buffer of its own.
func (im *Image) deflate(p []byte) ([]byte, error) {
	var out bytes.Buffer
	out.Grow(len(p)/2 + 64)
	w, _ := im.w.deflaters.Get().(*zlib.Writer)
	if w == nil {
		w = zlib.NewWriter(&out)
	} else {
		w.Reset(&out)
	}
	_, err := w.Write(p)
	if err == nil {
		err = w.Close()
	}
	im.w.deflaters.Put(w)
	if err != nil {
		return nil, fmt.Errorf("vmdk: deflate: %w", err)
	}
	return out.Bytes(), nil
}
