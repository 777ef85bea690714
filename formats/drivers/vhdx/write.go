package vhdx

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
)

// Writes to an open image, dynamic, fixed or differencing, as QEMU 7.2's
// vhdx driver makes them (QEMU refuses differencing images; they are
// written here the spec's way):
//
//   - The first write of a session (an open) writes both headers with a
//     new file write GUID, data write GUID and log GUID (MS-VHDX 2.2.2.1:
//     before the first write and the first user-visible write).
//   - A write to a FULLY_PRESENT block goes to its data in place; to a
//     PARTIALLY_PRESENT one (a differencing disk's) in place, in whole
//     logical sectors, with the sectors' bits set in its chunk's sector
//     bitmap.
//   - A write to a block that reads as zeroes allocates one: where the
//     entry (or a fixed disk's layout, data after the metadata) keeps a
//     place no other block or structure uses, else at the end of the file
//     (whole MiB, as QEMU's vhdx_allocate_block); the data is written, the
//     rest of the block zeroed (a new block past the end is a hole), and
//     the entry becomes FULLY_PRESENT. A write to a block a differencing
//     disk's parent holds allocates it PARTIALLY_PRESENT (and its chunk's
//     sector bitmap block, 1 MiB, where the chunk has none): the sectors
//     not written still read from the parent.
//   - BAT entries and sector bitmap sectors change in memory (reads see
//     them at once); at a flush (and at close) the data is made durable,
//     then the changed 4 KiB sectors go through the log: an entry written
//     at the log's start and made durable, the sectors written in place
//     and made durable, the entry's header sector cleared (a crash after
//     that leaves a clean log). At close both headers get a zero log GUID.
//   - Zeroes over a whole block of a dynamic or differencing disk make it
//     ZERO, a discard UNMAPPED (its place kept for the block's next
//     write); a fixed disk's blocks stay allocated and zeroes are written
//     there; a part of a block is written as zeroes where it does not
//     read as zeroes already, and a discard of one does nothing.
//   - The virtual size is fixed, as QEMU has no resize for vhdx.
type Writer struct {
	*Image
	// meta orders every change of the BAT, the bitmaps and the file's
	// end: allocations, zeroes, discards and commits, one at a time.
	meta    sync.Mutex
	noFlush atomic.Bool

	// end is where the next block allocated at the end goes (whole MiB),
	// past every byte of the file.
	end int64
	// used marks the MiBs of the file something uses (metadata, blocks,
	// bitmaps) at open: a place an entry keeps is reused only where it is
	// free of them, and then marked.
	used []uint64
	// openSize is the file's size at open: a place reused lies inside it.
	openSize int64
	// reuse holds the blocks whose entry keeps a place of their own that
	// nothing else uses (checked at open, or freed in this session).
	reuse map[int64]bool
	// fixedData is where a fixed disk's blocks lie, block after block, as
	// Create and QEMU lay them out (-1: another layout).
	fixedData int64

	headers headerPair
	// session: the headers hold this session's GUIDs (the log GUID set);
	// set under meta, read without it by writes in place.
	session atomic.Bool
	logGUID [16]byte
	logSeq  uint64
	zeroes  []byte
}

// ErrDamaged: the image reads, but a writer could not extend it safely.
var ErrDamaged = errors.New("vhdx: refusing to write")

// OpenWriter opens the image in f for writing, which it owns from now on
// (closed on failure too). A dirty log is replayed to the file first, as
// QEMU replays it at a read-write open.
func OpenWriter(ctx context.Context, f aio.File, o Options) (*Writer, error) {
	if _, err := Replay(ctx, f); err != nil {
		f.Close()
		return nil, err
	}
	img, err := New(ctx, f, o)
	if err != nil {
		return nil, err
	}
	w, err := img.openWriter(ctx)
	if err != nil {
		img.Close()
		return nil, fmt.Errorf("%s: %w", img.path, err)
	}
	return w, nil
}

func (img *Image) openWriter(ctx context.Context) (*Writer, error) {
	size, err := aio.FileSize(img.f)
	if err != nil {
		return nil, fmt.Errorf("vhdx: %w", err)
	}
	if img.logLen < mib || img.logLen%mib != 0 || img.logOff%mib != 0 || img.logOff < headerSection || img.logOff > size || img.logLen > size-img.logOff {
		return nil, fmt.Errorf("%w: its log [%d, +%d) is not whole MiB inside the file (%d bytes) after the header section", ErrDamaged, img.logOff, img.logLen, size)
	}
	r, h, err := readHeaders(ctx, img.f, nil)
	if err != nil {
		return nil, err
	}
	hp, err := readHeaderPair(r, h.seq)
	if err != nil {
		return nil, err
	}
	w := &Writer{Image: img, end: (size + mib - 1) &^ (mib - 1), openSize: size, headers: hp, fixedData: -1, reuse: map[int64]bool{}}
	w.used = make([]uint64, (size/mib+64)/64)
	for _, s := range img.spans {
		w.mark(int64(s.start), int64(s.end-s.start))
	}
	// The end of the file, or of a last block that need only hold the
	// disk's bytes and so may end past it (the reader allows it, as QEMU
	// does): new blocks go after both.
	used := func(off, n int64) {
		w.mark(off, n)
		w.end = max(w.end, (off+n+mib-1)&^(mib-1))
	}
	for _, e := range img.bitmaps {
		if e&batStateMask == blockFullyPresent {
			used(int64(e&batOffsetMask), mib)
		}
	}
	for _, e := range img.bat {
		if s := e & batStateMask; s == blockFullyPresent || s == blockPartiallyPresent {
			used(int64(e&batOffsetMask), img.blockSize)
		}
	}
	// Places kept by entries that read as zeroes (QEMU's fixed disks with
	// block_state_zero, a discarded block): reused where free.
	for b, e := range img.bat {
		if off := int64(e & batOffsetMask); off != 0 && !img.fromParent(e&batStateMask) && e&batStateMask != blockFullyPresent && e&batStateMask != blockPartiallyPresent && w.free(off, img.blockSize) {
			w.mark(off, img.blockSize)
			w.reuse[int64(b)] = true
		}
	}
	if img.fixed && size >= img.size && (size-img.size)%mib == 0 {
		w.fixedData = size - img.size
	}
	img.pending = map[int64][]byte{}
	return w, nil
}

// mark marks the MiBs of [off, off+n) used, those inside the file at open.
func (w *Writer) mark(off, n int64) {
	for m := off / mib; m < (off+n+mib-1)/mib && m < int64(len(w.used))*64; m++ {
		w.used[m/64] |= 1 << (m % 64)
	}
}

// free says whether [off, off+n) lies in the file as opened, whole MiB,
// and nothing uses it.
func (w *Writer) free(off, n int64) bool {
	if off%mib != 0 || off < 0 || n > w.openSize || off > w.openSize-n {
		return false
	}
	for m := off / mib; m < (off+n+mib-1)/mib; m++ {
		if w.used[m/64]&(1<<(m%64)) != 0 {
			return false
		}
	}
	return true
}

// SetNoFlush skips every sync (qemu-img convert's cache=unsafe): the
// order of writes is kept, their durability left to the kernel.
func (w *Writer) SetNoFlush(on bool) { w.noFlush.Store(on) }

func (w *Writer) sync(ctx context.Context, what string) error {
	if w.noFlush.Load() {
		return nil
	}
	if err := w.f.Fdatasync(ctx); err != nil {
		return fmt.Errorf("vhdx: %s: sync %s: %w", w.path, what, err)
	}
	return nil
}

func (w *Writer) inRange(what string, off, n int64) error {
	if off < 0 || n < 0 || off > w.size || n > w.size-off {
		return fmt.Errorf("vhdx: %s of %d bytes at %d: %w", what, n, off, formats.ErrOutOfRange)
	}
	return nil
}

// entry is block b's BAT entry, read under mu.
func (w *Writer) entry(b int64) uint64 {
	w.mu.RLock()
	defer w.mu.RUnlock()
	return w.bat[b]
}

// WriteAt writes p at off, block by block.
func (w *Writer) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	if err := w.inRange("write", off, int64(len(p))); err != nil {
		return 0, err
	}
	for done := 0; done < len(p); {
		at := off + int64(done)
		n := int(min(int64(len(p)-done), w.blockSize-at%w.blockSize))
		if err := w.writeBlock(ctx, p[done:done+n], at); err != nil {
			return done, err
		}
		done += n
	}
	return len(p), nil
}

// TryWriteAt writes p in place where its blocks are FULLY_PRESENT and the
// file takes it without waiting; anything else waits (WriteAt).
func (w *Writer) TryWriteAt(p []byte, off int64) (bool, error) {
	if w.inRange("write", off, int64(len(p))) != nil || len(p) == 0 || off/w.blockSize != (off+int64(len(p))-1)/w.blockSize {
		return false, nil
	}
	if !w.session.Load() || !w.mu.TryRLock() {
		return false, nil
	}
	e := w.bat[off/w.blockSize]
	w.mu.RUnlock()
	if e&batStateMask != blockFullyPresent {
		return false, nil
	}
	return w.f.TryWriteAt(p, int64(e&batOffsetMask)+off%w.blockSize)
}

// writeBlock writes p at off, inside one block.
func (w *Writer) writeBlock(ctx context.Context, p []byte, off int64) error {
	in := off % w.blockSize
	if e := w.entry(off / w.blockSize); e&batStateMask == blockFullyPresent && w.session.Load() {
		return w.writeData(ctx, p, int64(e&batOffsetMask)+in)
	}
	host, err := w.allocating(ctx, p, off)
	if err != nil || host < 0 {
		return err
	}
	return w.writeData(ctx, p, host+in)
}

// allocating does what a write to a block that is not FULLY_PRESENT needs,
// under meta: the write itself (-1) or, where the block's data is p's
// alone to write, the block's place (the caller writes p there without
// the lock, so that writes to other new blocks go on meanwhile).
func (w *Writer) allocating(ctx context.Context, p []byte, off int64) (int64, error) {
	b, in := off/w.blockSize, off%w.blockSize
	w.meta.Lock()
	defer w.meta.Unlock()
	if err := w.startSession(ctx); err != nil {
		return -1, err
	}
	e := w.entry(b)
	state := e & batStateMask
	switch {
	case state == blockFullyPresent: // allocated meanwhile
		return int64(e & batOffsetMask), nil
	case state == blockPartiallyPresent:
		return -1, w.writeSectors(ctx, p, off, int64(e&batOffsetMask))
	case w.fromParent(state):
		if err := w.bitmapFor(ctx, b); err != nil {
			return -1, err
		}
		host, _, err := w.allocate(ctx, b)
		if err != nil {
			return -1, err
		}
		// Bits a chunk's bitmap may hold for a block it never had (a
		// foreign image's) would hand the parent's sectors to this one.
		ls := int64(w.logicalSector)
		if err := w.setBits(ctx, b*w.blockSize/ls, min((b+1)*w.blockSize, w.size)/ls, false); err != nil {
			return -1, err
		}
		if err := w.writeSectors(ctx, p, off, host); err != nil {
			return -1, err
		}
		return -1, w.setEntry(ctx, b, uint64(host)|blockPartiallyPresent)
	}
	// A block that reads as zeroes: its data, zeroes around it.
	host, fresh, err := w.allocate(ctx, b)
	if err != nil {
		return -1, err
	}
	if fresh {
		// Past the old end: a hole, zeroes, what the block read. The
		// entry goes first: a flush that commits it before p lands
		// leaves zeroes where an unacknowledged write was going.
		return host, w.setEntry(ctx, b, uint64(host)|blockFullyPresent)
	}
	// A place reused: zeroed around p before the entry names it.
	if err := w.zeroData(ctx, host, in); err != nil {
		return -1, err
	}
	if err := w.writeData(ctx, p, host+in); err != nil {
		return -1, err
	}
	if err := w.zeroData(ctx, host+in+int64(len(p)), w.blockSize-in-int64(len(p))); err != nil {
		return -1, err
	}
	return -1, w.setEntry(ctx, b, uint64(host)|blockFullyPresent)
}

// writeData writes guest bytes at host, which must lie in a block's data:
// never into the metadata (a guard against a bug, as qcow2's overlap
// check: the places were checked when the blocks were allocated or read).
func (w *Writer) writeData(ctx context.Context, p []byte, host int64) error {
	for _, s := range w.spans {
		if uint64(host) < s.end && s.start < uint64(host)+uint64(len(p)) {
			return fmt.Errorf("%w: %s: a data write at %d would overwrite %s", ErrDamaged, w.path, host, s.what)
		}
	}
	if _, err := w.f.WriteAt(ctx, p, host); err != nil {
		return fmt.Errorf("vhdx: %s: write %d bytes at %d: %w", w.path, len(p), host, err)
	}
	return nil
}

// zeroData zeroes n bytes of a block's data at host: a range the file
// zeroes without writing (a hole past its end reads as zeroes already
// and is left so), else written zeroes.
func (w *Writer) zeroData(ctx context.Context, host, n int64) error {
	if n <= 0 {
		return nil
	}
	if err := w.f.Fallocate(ctx, unix.FALLOC_FL_ZERO_RANGE|unix.FALLOC_FL_KEEP_SIZE, host, n); err == nil {
		return nil
	}
	if w.zeroes == nil {
		w.zeroes = make([]byte, mib)
	}
	for n > 0 {
		k := min(n, mib)
		if err := w.writeData(ctx, w.zeroes[:k], host); err != nil {
			return err
		}
		host, n = host+k, n-k
	}
	return nil
}

// writeSectors writes p at off into a differencing disk's block at
// blockHost, in whole logical sectors (the bytes around p in its first
// and last sector read as they read now), and sets their bits.
func (w *Writer) writeSectors(ctx context.Context, p []byte, off, blockHost int64) error {
	ls := int64(w.logicalSector)
	a0, a1 := off&^(ls-1), (off+int64(len(p))+ls-1)&^(ls-1)
	buf := p
	if a0 != off || a1 != off+int64(len(p)) {
		buf = make([]byte, a1-a0)
		if _, err := w.Image.ReadAt(ctx, buf[:ls], a0); err != nil {
			return err
		}
		if _, err := w.Image.ReadAt(ctx, buf[len(buf)-int(ls):], a1-ls); err != nil {
			return err
		}
		copy(buf[off-a0:], p)
	}
	if err := w.writeData(ctx, buf, blockHost+a0%w.blockSize); err != nil {
		return err
	}
	return w.setBits(ctx, a0/ls, a1/ls, true)
}

// allocate finds block b a place: the one its entry (or a fixed disk's
// layout) keeps, where free, else the end of the file, which it extends
// to the block's end so that the BAT never names bytes past it. fresh:
// at the end, a hole that reads as zeroes.
func (w *Writer) allocate(ctx context.Context, b int64) (host int64, fresh bool, _ error) {
	if w.reuse[b] {
		delete(w.reuse, b)
		return int64(w.entry(b) & batOffsetMask), false, nil
	}
	if w.fixedData >= 0 {
		if off := (w.fixedData + b*w.blockSize + mib - 1) &^ (mib - 1); w.free(off, w.blockSize) {
			w.mark(off, w.blockSize)
			return off, false, nil
		}
	}
	host, err := w.allocateEnd(ctx, w.blockSize)
	return host, true, err
}

// allocateEnd takes n bytes (whole MiB) at the end of the file.
func (w *Writer) allocateEnd(ctx context.Context, n int64) (int64, error) {
	host := w.end
	size, err := aio.FileSize(w.f)
	if err != nil {
		return 0, fmt.Errorf("vhdx: %s: %w", w.path, err)
	}
	if size < host+n {
		if _, err := w.f.WriteAt(ctx, []byte{0}, host+n-1); err != nil {
			return 0, fmt.Errorf("vhdx: %s: extend the file to %d: %w", w.path, host+n, err)
		}
	}
	w.end = host + n
	return host, nil
}

// bitmapFor gives block b's chunk a sector bitmap block where it has none
// (1 MiB of zeroes: every sector from the parent).
func (w *Writer) bitmapFor(ctx context.Context, b int64) error {
	c := b / w.chunkRatio
	w.mu.RLock()
	e := w.bitmaps[c]
	w.mu.RUnlock()
	if e&batStateMask == blockFullyPresent {
		return nil
	}
	host, err := w.allocateEnd(ctx, mib)
	if err != nil {
		return err
	}
	return w.setBAT(ctx, c*(w.chunkRatio+1)+w.chunkRatio, uint64(host)|blockFullyPresent, func() { w.bitmaps[c] = uint64(host) | blockFullyPresent })
}

// setEntry sets block b's BAT entry, in memory and in its pending sector.
func (w *Writer) setEntry(ctx context.Context, b int64, e uint64) error {
	return w.setBAT(ctx, int64(batIndex(uint64(b), uint64(w.chunkRatio))), e, func() { w.bat[b] = e })
}

// setBAT sets BAT entry idx to e in its pending sector and, under mu in
// the same step, applies set to the in-memory copy.
func (w *Writer) setBAT(ctx context.Context, idx int64, e uint64, set func()) error {
	at := w.batOff + 8*idx
	s, err := w.pendingSector(ctx, at&^(logSector-1))
	if err != nil {
		return err
	}
	w.mu.Lock()
	binary.LittleEndian.PutUint64(s[at%logSector:], e)
	set()
	w.mu.Unlock()
	return nil
}

// pendingSector is the pending copy of the metadata sector at off, read
// from the file the first time (zeroes past its end).
func (w *Writer) pendingSector(ctx context.Context, off int64) ([]byte, error) {
	w.mu.RLock()
	s, ok := w.pending[off]
	w.mu.RUnlock()
	if ok {
		return s, nil
	}
	s = make([]byte, logSector)
	got, err := w.f.ReadAt(ctx, s, off)
	if err != nil && got < len(s) && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("vhdx: %s: read metadata at %d: %w", w.path, off, err)
	}
	w.mu.Lock()
	w.pending[off] = s
	w.mu.Unlock()
	return s, nil
}

// setBits sets (or clears) the sector bitmap bits of the logical sectors
// [s0, s1), which lie in one block.
func (w *Writer) setBits(ctx context.Context, s0, s1 int64, on bool) error {
	c := s0 / sectorsPerChunk
	w.mu.RLock()
	bm := int64(w.bitmaps[c] & batOffsetMask)
	w.mu.RUnlock()
	for s := s0; s < s1; {
		in := s % sectorsPerChunk
		at := bm + in/8
		sec, err := w.pendingSector(ctx, at&^(logSector-1))
		if err != nil {
			return err
		}
		end := min(s1, s+(logSector-at%logSector)*8-in%8) // to the sector's end
		w.mu.Lock()
		for i := s; i < end; i++ {
			j := i%sectorsPerChunk - (at&^(logSector-1)-bm)*8
			if on {
				sec[j/8] |= 1 << (j % 8)
			} else {
				sec[j/8] &^= 1 << (j % 8)
			}
		}
		w.mu.Unlock()
		s = end
	}
	return nil
}

// startSession writes the headers with this session's GUIDs before the
// first write: a new file write and data write GUID (the image changes:
// a differencing child made on it no longer matches, as the spec wants)
// and a log GUID that the log's entries carry.
func (w *Writer) startSession(ctx context.Context) error {
	if w.session.Load() {
		return nil
	}
	var gs [3][16]byte
	for i := range gs {
		g, err := newGUID()
		if err != nil {
			return err
		}
		gs[i] = g
	}
	err := w.headers.update(ctx, w.f, w.path, !w.noFlush.Load(), func(h []byte) {
		copy(h[16:32], gs[0][:])
		copy(h[32:48], gs[1][:])
		copy(h[48:64], gs[2][:])
	})
	if err != nil {
		return err
	}
	w.logGUID = gs[2]
	w.mu.Lock()
	w.dataWriteGUID = gs[1]
	w.mu.Unlock()
	w.session.Store(true)
	return nil
}

// WriteZeroes makes [off, off+n) read as zeroes.
func (w *Writer) WriteZeroes(ctx context.Context, off, n int64, _ bool) error {
	return w.clearRange(ctx, off, n, blockZero)
}

// Discard unmaps the whole blocks of [off, off+n) of a dynamic or
// differencing disk; the rest is left as it is.
func (w *Writer) Discard(ctx context.Context, off, n int64) error {
	return w.clearRange(ctx, off, n, blockUnmapped)
}

// clearRange zeroes (state ZERO) or discards (UNMAPPED) off..off+n.
func (w *Writer) clearRange(ctx context.Context, off, n int64, state uint64) error {
	if err := w.inRange("zero", off, n); err != nil {
		return err
	}
	for n > 0 {
		b, in := off/w.blockSize, off%w.blockSize
		k := min(n, w.blockSize-in)
		whole := in == 0 && (k == w.blockSize || off+k == w.size)
		asData, err := w.clearBlock(ctx, b, in, k, whole, state)
		if err != nil {
			return err
		}
		// Part of a block read from the parent or partially present:
		// zeroes written as data.
		for done := int64(0); asData && done < k; {
			c := min(k-done, mib)
			if err := w.writeBlock(ctx, make([]byte, c), off+done); err != nil {
				return err
			}
			done += c
		}
		off, n = off+k, n-k
	}
	return nil
}

// clearBlock zeroes or discards k bytes at in of block b (whole: all of
// it); asData: they are to be written as zeroes.
func (w *Writer) clearBlock(ctx context.Context, b, in, k int64, whole bool, state uint64) (asData bool, _ error) {
	w.meta.Lock()
	defer w.meta.Unlock()
	e := w.entry(b)
	cur := e & batStateMask
	switch {
	case cur == blockZero || cur == blockUnmapped || !w.diff && (cur == blockNotPresent || cur == blockUndefined):
		return false, nil // reads as zeroes already
	case !w.fixed && whole:
		if err := w.startSession(ctx); err != nil {
			return false, err
		}
		off := e & batOffsetMask
		if cur != blockFullyPresent && cur != blockPartiallyPresent {
			off = 0
		}
		if off != 0 {
			w.reuse[b] = true // its place stays the block's
		}
		return false, w.setEntry(ctx, b, off|state)
	case state == blockUnmapped:
		return false, nil // a discard of part of a block: its bytes stay
	case cur == blockFullyPresent:
		if err := w.startSession(ctx); err != nil {
			return false, err
		}
		return false, w.zeroData(ctx, int64(e&batOffsetMask)+in, k)
	}
	return true, nil
}

// Resize is refused: QEMU 7.2's vhdx driver does not resize either.
func (w *Writer) Resize(context.Context, int64) error {
	return fmt.Errorf("vhdx: %s: resize: %w", w.path, formats.ErrNotSupported)
}

// Flush makes every completed write durable: the data, then the changed
// metadata through the log.
func (w *Writer) Flush(ctx context.Context) error {
	w.meta.Lock()
	defer w.meta.Unlock()
	return w.commit(ctx)
}

// commit writes the pending metadata sectors through the log, as many
// entries as the log needs, each: written at the log's start, made
// durable, written in place, made durable, its header sector cleared.
func (w *Writer) commit(ctx context.Context) error {
	if err := w.sync(ctx, "data"); err != nil {
		return err
	}
	w.mu.RLock()
	n := len(w.pending)
	w.mu.RUnlock()
	if n == 0 {
		return nil
	}
	if err := w.startSession(ctx); err != nil {
		return err
	}
	size, err := aio.FileSize(w.f)
	if err != nil {
		return fmt.Errorf("vhdx: %s: %w", w.path, err)
	}
	w.mu.RLock()
	all := sortedOffsets(w.pending)
	w.mu.RUnlock()
	per := logEntrySectors(w.logLen)
	for len(all) > 0 {
		offs := all[:min(per, len(all))]
		all = all[len(offs):]
		sectors := make(map[int64][]byte, len(offs))
		w.mu.RLock()
		for _, off := range offs {
			sectors[off] = append([]byte(nil), w.pending[off]...)
		}
		w.mu.RUnlock()
		w.logSeq++
		entry := buildLogEntry(w.logGUID, w.logSeq, uint64(size), offs, sectors)
		if _, err := w.f.WriteAt(ctx, entry, w.logOff); err != nil {
			return fmt.Errorf("vhdx: %s: write a log entry: %w", w.path, err)
		}
		if err := w.sync(ctx, "the log"); err != nil {
			return err
		}
		for _, off := range offs {
			if err := w.writeSector(ctx, sectors[off], off); err != nil {
				return err
			}
		}
		if err := w.sync(ctx, "the metadata"); err != nil {
			return err
		}
		// In place: reads of the file see them now. A sector changed
		// again since it was copied stays pending.
		w.mu.Lock()
		for _, off := range offs {
			if string(w.pending[off]) == string(sectors[off]) {
				delete(w.pending, off)
			}
		}
		w.mu.Unlock()
		// The entry is applied: a replay of it would write the same
		// bytes, so clearing its header need not be durable.
		if _, err := w.f.WriteAt(ctx, make([]byte, logSector), w.logOff); err != nil {
			return fmt.Errorf("vhdx: %s: clear the log: %w", w.path, err)
		}
	}
	return nil
}

// writeSector writes a metadata sector in place: never over the headers
// or the log.
func (w *Writer) writeSector(ctx context.Context, p []byte, off int64) error {
	if off < headerSection || off < w.logOff+w.logLen && w.logOff < off+int64(len(p)) {
		return fmt.Errorf("%w: %s: a metadata write at %d would overwrite the headers or the log", ErrDamaged, w.path, off)
	}
	if _, err := w.f.WriteAt(ctx, p, off); err != nil {
		return fmt.Errorf("vhdx: %s: write metadata at %d: %w", w.path, off, err)
	}
	return nil
}

// Close writes what is pending through the log, empties the log (both
// headers with a zero log GUID, as QEMU's vhdx_close) and closes.
func (w *Writer) Close() error {
	ctx := context.Background()
	w.meta.Lock()
	err := w.commit(ctx)
	if err == nil && w.session.Load() {
		err = w.headers.update(ctx, w.f, w.path, !w.noFlush.Load(), func(h []byte) { clear(h[48:64]) })
	}
	w.meta.Unlock()
	return errors.Join(err, w.Image.Close())
}
