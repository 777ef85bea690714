package vmdk

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats/internal/inflate"
)

// Hosted sparse extent (VMware's "VMDK4" header, magic KDMV), as QEMU's
// vmdk_open_vmdk4 reads it.
const (
	sectorSize = 512

	flagNLDetect  = 1 << 0
	flagRGD       = 1 << 1
	flagZeroGrain = 1 << 2
	flagCompress  = 1 << 16
	flagMarker    = 1 << 17

	compressDeflate = 1
	gdAtEnd         = ^uint64(0)

	markerEOS    = 0
	markerFooter = 3

	// maxGTEs is QEMU's bound on grain-table entries ("L2 table size too big").
	maxGTEs = 512
	// maxGrainSectors is QEMU's bound on the grain ("Invalid granularity").
	maxGrainSectors = 0x200000
	// maxGDEntries is QEMU's bound on the grain directory ("L1 size too big").
	maxGDEntries = 32 << 20
	// maxSectors bounds one extent (2 PiB), so that byte offsets of
	// maxExtents extents never overflow.
	maxSectors = 1 << 42

	// maxCompressedGrain bounds the grain of a compressed extent, each
	// read of which inflates a whole grain into memory.
	maxCompressedGrain = 16 << 20

	// gteZeroed is a grain-table entry meaning "reads as zeroes" in an
	// image with flagZeroGrain.
	gteZeroed = 1
)

// header is the sparse extent header (after the 4-byte magic).
type header struct {
	version      uint32
	flags        uint32
	capacity     uint64 // sectors
	granularity  uint64 // sectors per grain
	descOffset   uint64 // sectors
	descSize     uint64
	numGTEs      uint32
	rgdOffset    uint64 // sectors
	gdOffset     uint64 // sectors
	grainOffset  uint64 // sectors
	compressAlgo uint16
}

func parseHeader(b []byte) header {
	le := binary.LittleEndian
	return header{
		version:      le.Uint32(b[4:]),
		flags:        le.Uint32(b[8:]),
		capacity:     le.Uint64(b[12:]),
		granularity:  le.Uint64(b[20:]),
		descOffset:   le.Uint64(b[28:]),
		descSize:     le.Uint64(b[36:]),
		numGTEs:      le.Uint32(b[44:]),
		rgdOffset:    le.Uint64(b[48:]),
		gdOffset:     le.Uint64(b[56:]),
		grainOffset:  le.Uint64(b[64:]),
		compressAlgo: le.Uint16(b[77:]),
	}
}

var magic = [4]byte{'K', 'D', 'M', 'V'}

// readFooter reads the header a stream-optimized file repeats at its end
// (gd_offset = GD_AT_END in the first one): footer marker, header, end of
// stream marker, one sector each.
func readFooter(ctx context.Context, f aio.File, fileSize int64) (header, error) {
	if fileSize < 1536+sectorSize {
		return header{}, fmt.Errorf("%w: grain directory at the end, and no room for a footer", ErrCorrupt)
	}
	b := make([]byte, 1536)
	if _, err := f.ReadAt(ctx, b, fileSize/sectorSize*sectorSize-1536); err != nil {
		return header{}, fmt.Errorf("vmdk: read footer: %w", err)
	}
	le := binary.LittleEndian
	if [4]byte(b[512:516]) != magic || le.Uint32(b[8:]) != 0 || le.Uint32(b[12:]) != markerFooter ||
		le.Uint64(b[1024:]) != 0 || le.Uint32(b[1032:]) != 0 || le.Uint32(b[1036:]) != markerEOS {
		return header{}, fmt.Errorf("%w: invalid footer", ErrCorrupt)
	}
	return parseHeader(b[512:1024]), nil
}

// openSparse makes the sparse extent of f (whose first bytes are head),
// checking every field against the file before anything is allocated by it.
func openSparse(ctx context.Context, e *extent, head []byte, fileSize int64) error {
	h := parseHeader(head)
	if h.capacity == 0 && h.descOffset != 0 {
		// QEMU then reads the embedded descriptor as a descriptor file,
		// whose extents may name this very file: it recurses without
		// bound. Such a file is refused.
		return fmt.Errorf("%w: sparse file of capacity 0 with a descriptor of its own (QEMU recurses on it): refused", ErrCorrupt)
	}
	e.headerEnd = sectorSize
	if h.gdOffset == gdAtEnd {
		e.gdAtEnd = true
		var err error
		if h, err = readFooter(ctx, e.f, fileSize); err != nil {
			return err
		}
		if h.gdOffset == gdAtEnd {
			return fmt.Errorf("%w: footer puts the grain directory at the end too", ErrCorrupt)
		}
	}
	if h.version > 3 {
		return fmt.Errorf("%w: VMDK version %d", ErrUnsupported, h.version)
	}
	if h.numGTEs > maxGTEs {
		return fmt.Errorf("%w: L2 table size too big (%d grain table entries, at most %d)", ErrCorrupt, h.numGTEs, maxGTEs)
	}
	if h.granularity > maxGrainSectors {
		return fmt.Errorf("%w: invalid granularity %d sectors", ErrCorrupt, h.granularity)
	}
	gtSectors := uint64(h.numGTEs) * h.granularity
	if gtSectors == 0 {
		return fmt.Errorf("%w: L1 entry size is invalid (%d entries of %d sectors)", ErrCorrupt, h.numGTEs, h.granularity)
	}
	if h.capacity > maxSectors {
		return fmt.Errorf("%w: capacity of %d sectors", ErrCorrupt, h.capacity)
	}
	gdEntries := (h.capacity + gtSectors - 1) / gtSectors
	if gdEntries > maxGDEntries {
		return fmt.Errorf("%w: L1 size too big", ErrCorrupt)
	}
	if h.grainOffset > uint64(fileSize)/sectorSize {
		return fmt.Errorf("%w: file truncated, expecting at least %d bytes", ErrCorrupt, h.grainOffset*sectorSize)
	}
	e.sparse = true
	e.hdr = h
	e.size = int64(h.capacity) * sectorSize
	e.grain = int64(h.granularity) * sectorSize
	e.gtes = int64(h.numGTEs)
	e.zeroGrain = h.flags&flagZeroGrain != 0
	e.compressed = h.compressAlgo == compressDeflate
	e.marker = h.flags&flagMarker != 0
	e.fileEnd.Store(fileSize)
	e.grainStart = int64(h.grainOffset) * sectorSize
	if e.compressed && e.grain > maxCompressedGrain {
		// A compressed grain is inflated whole: QEMU's 1 GiB grain would
		// cost 3 GiB a read whatever the file holds.
		return fmt.Errorf("%w: compressed grains of %d bytes (at most %d read; VMware writes 64 KiB)", ErrUnsupported, e.grain, maxCompressedGrain)
	}

	gd, err := readGD(ctx, e, h.gdOffset, gdEntries, fileSize)
	if err != nil && h.flags&flagRGD != 0 && h.rgdOffset != 0 {
		// The redundant directory is there for this: a primary one that
		// does not check out. QEMU reads the primary only.
		rgd, rerr := readGD(ctx, e, h.rgdOffset, gdEntries, fileSize)
		if rerr != nil {
			return fmt.Errorf("%w (and the redundant one: %v)", err, rerr)
		}
		gd, err = rgd, nil
		e.usedRGD = true
	}
	if err != nil {
		return err
	}
	e.gd = gd
	return nil
}

// readGD reads a grain directory of n entries at sector off and checks
// it: it lies inside the file and past the header, and every grain table
// it names lies inside the file, past the header, off the directory, and
// is named once.
func readGD(ctx context.Context, e *extent, off, n uint64, fileSize int64) ([]uint32, error) {
	gdBytes := n * 4
	if off == 0 {
		return nil, fmt.Errorf("%w: grain directory inside the header (sector 0)", ErrCorrupt)
	}
	if off > uint64(fileSize)/sectorSize || off*sectorSize+gdBytes > uint64(fileSize) {
		return nil, fmt.Errorf("%w: grain directory at sector %d (%d entries) past the end of the file (%d bytes)", ErrCorrupt, off, n, fileSize)
	}
	raw := make([]byte, gdBytes)
	if _, err := e.f.ReadAt(ctx, raw, int64(off)*sectorSize); err != nil {
		return nil, fmt.Errorf("vmdk: read grain directory: %w", err)
	}
	gd := make([]uint32, n)
	gtBytes := uint64(e.gtes) * 4
	gdStart, gdEnd := off*sectorSize, off*sectorSize+gdBytes
	for i := range gd {
		v := binary.LittleEndian.Uint32(raw[4*i:])
		gd[i] = v
		if v == 0 {
			continue
		}
		s := uint64(v) * sectorSize
		if s+gtBytes > uint64(fileSize) {
			return nil, fmt.Errorf("%w: grain table %d at sector %d past the end of the file", ErrCorrupt, i, v)
		}
		if s < uint64(e.headerEnd) {
			return nil, fmt.Errorf("%w: grain table %d at sector %d inside the header", ErrCorrupt, i, v)
		}
		if s < gdEnd && gdStart < s+gtBytes {
			return nil, fmt.Errorf("%w: grain table %d at sector %d overlaps the grain directory", ErrCorrupt, i, v)
		}
	}
	sorted := slices.Clone(gd)
	slices.Sort(sorted)
	for i := 1; i < len(sorted); i++ {
		if sorted[i] != 0 && sorted[i]-sorted[i-1] < uint32((gtBytes+sectorSize-1)/sectorSize) {
			return nil, fmt.Errorf("%w: grain tables at sectors %d and %d overlap", ErrCorrupt, sorted[i-1], sorted[i])
		}
	}
	return gd, nil
}

// gt returns grain table i of the extent (its GD entry gdEntry), from the
// cache or, unless try, the file. nil, nil: try and not cached.
func (e *extent) gt(ctx context.Context, gdEntry uint32, try bool) ([]uint32, error) {
	if t, ok := e.gtCache.Get(e.key(gdEntry)); ok {
		return t, nil
	}
	if try {
		return nil, nil
	}
	// A table read while a write changes it must not land in the cache
	// after the write's own copy: it is cached only if no table changed
	// since the read began (see extent.tables).
	gen := e.tables.gen.Load()
	raw := make([]byte, e.gtes*4)
	if _, err := e.f.ReadAt(ctx, raw, int64(gdEntry)*sectorSize); err != nil {
		return nil, fmt.Errorf("vmdk: %s: read grain table at sector %d: %w", e.name, gdEntry, err)
	}
	t := make([]uint32, e.gtes)
	for i := range t {
		t[i] = binary.LittleEndian.Uint32(raw[4*i:])
	}
	e.tables.mu.Lock()
	if e.tables.gen.Load() == gen {
		e.gtCache.Put(e.key(gdEntry), t)
	}
	e.tables.mu.Unlock()
	return t, nil
}

// grain states.
const (
	grainUnalloc = iota
	grainZero
	grainData
)

// lookupGrain says what holds the grain of the extent at byte off (relative
// to the extent): its state and, for data, its sector in the file. try:
// only from cache; ok false when it would read the file.
func (e *extent) lookupGrain(ctx context.Context, off int64, try bool) (state int, sector uint32, ok bool, err error) {
	g := off / e.grain
	gdi := g / e.gtes
	if gdi >= int64(len(e.gd)) {
		return 0, 0, true, fmt.Errorf("%w: grain at %d beyond the grain directory", ErrCorrupt, off)
	}
	if v, ok := e.pend.get(g); ok { // written, its table entry not yet
		return grainData, v, true, nil
	}
	d := e.gd[gdi]
	if d == 0 {
		return grainUnalloc, 0, true, nil
	}
	t, err := e.gt(ctx, d, try)
	if err != nil {
		return 0, 0, true, err
	}
	if t == nil {
		return 0, 0, false, nil
	}
	v := t[g%e.gtes]
	switch {
	case v == 0:
		return grainUnalloc, 0, true, nil
	case v == gteZeroed && e.zeroGrain:
		return grainZero, 0, true, nil
	}
	s := int64(v) * sectorSize
	if s < e.headerEnd {
		return 0, 0, true, fmt.Errorf("%w: %s: grain at %d lies at sector %d, inside the header", ErrCorrupt, e.name, off, v)
	}
	if e.compressed {
		if s < e.grainStart || s+12 > e.fileEnd.Load() {
			return 0, 0, true, fmt.Errorf("%w: %s: compressed grain at %d lies at sector %d, past the end of the file", ErrCorrupt, e.name, off, v)
		}
	} else {
		need := min(e.grain, e.size-g*e.grain)
		if s < e.grainStart || s+need > e.fileEnd.Load() {
			return 0, 0, true, fmt.Errorf("%w: %s: grain at %d lies at sector %d, outside the file's grains (%d..%d)", ErrCorrupt, e.name, off, v, e.grainStart, e.fileEnd.Load())
		}
	}
	return grainData, v, true, nil
}

// readCompressed fills b with the bytes of the compressed grain at
// sector (grain grainIndex) from inG on: in place when the grain is
// stored blocks (see stored.go), else from its inflated copy. try: from
// the caches and the page cache only; false when it would wait.
func (e *extent) readCompressed(ctx context.Context, sector uint32, grainIndex int64, b []byte, inG int64, try bool) (bool, error) {
	key := e.key(sector)
	if g, ok := e.storedCache.Get(key); ok {
		return e.readStored(ctx, g, b, inG, try)
	}
	d, ok := e.grainCache.Get(key)
	if !ok {
		if try {
			return false, nil
		}
		var g *storedGrain
		var err error
		if g, d, err = e.load(ctx, sector, grainIndex); err != nil {
			return false, err
		}
		if g != nil {
			return e.readStored(ctx, g, b, inG, false)
		}
	}
	if inG+int64(len(b)) > int64(len(d)) {
		return false, fmt.Errorf("%w: %s: compressed grain %d holds %d bytes, %d read", ErrCorrupt, e.name, grainIndex, len(d), inG+int64(len(b)))
	}
	copy(b, d[inG:])
	return true, nil
}

// flight is the loads of compressed grains under way (an image's), so
// that readers of a grain being loaded wait for that load rather than
// read and inflate it again: 16 sequential 4 KiB reads in flight all
// fall in one 64 KiB grain.
type flight struct {
	mu    sync.Mutex
	calls map[int64]*flightCall
}

type flightCall struct {
	done chan struct{}
	g    *storedGrain
	d    []byte
	err  error
}

// load reads the compressed grain at sector, once however many readers
// ask for it at a time, and caches it: its stored runs, or else its
// inflated bytes.
func (e *extent) load(ctx context.Context, sector uint32, grainIndex int64) (*storedGrain, []byte, error) {
	key := e.key(sector)
	e.flight.mu.Lock()
	for {
		c, ok := e.flight.calls[key]
		if !ok {
			break
		}
		e.flight.mu.Unlock()
		select {
		case <-c.done:
		case <-ctx.Done():
			return nil, nil, fmt.Errorf("vmdk: %s: wait for grain at sector %d: %w", e.name, sector, context.Cause(ctx))
		}
		// A load given up by its own reader (its request interrupted)
		// is not this reader's failure: it loads the grain itself.
		if c.err == nil || !errors.Is(c.err, context.Canceled) && !errors.Is(c.err, context.DeadlineExceeded) {
			return c.g, c.d, c.err
		}
		e.flight.mu.Lock()
	}
	c := &flightCall{done: make(chan struct{})}
	if e.flight.calls == nil {
		e.flight.calls = map[int64]*flightCall{}
	}
	e.flight.calls[key] = c
	e.flight.mu.Unlock()
	c.g, c.d, c.err = e.loadOnce(ctx, sector, grainIndex)
	e.flight.mu.Lock()
	delete(e.flight.calls, key)
	e.flight.mu.Unlock()
	close(c.done)
	return c.g, c.d, c.err
}

// loadOnce is load's work. The marker's length is checked against the
// file and two grains (QEMU's bound), its LBA against the grain asked
// for, and the output against one grain.
func (e *extent) loadOnce(ctx context.Context, sector uint32, grainIndex int64) (*storedGrain, []byte, error) {
	off := int64(sector) * sectorSize
	hdr := int64(0)
	if e.marker {
		hdr = 12
	}
	if off >= e.fileEnd.Load() {
		return nil, nil, fmt.Errorf("%w: %s: compressed grain at %d past the end of the file (%d bytes)", ErrCorrupt, e.name, off, e.fileEnd.Load())
	}
	// One read of the marker and what a grain of incompressible data
	// takes (the grain, a zlib header and checksum, 5 bytes a block),
	// rather than a read for the marker and another for the data, nor
	// QEMU's two grains each time. The scratch buffer is reused.
	span := min(hdr+2*e.grain, e.fileEnd.Load()-off)
	first := span
	if e.marker {
		first = min(span, hdr+e.grain+e.grain/64+64)
	}
	scratch := e.scratchBuf()
	defer e.scratch.Put(scratch)
	raw := (*scratch)[:first]
	if _, err := e.f.ReadAt(ctx, raw, off); err != nil && !errors.Is(err, io.EOF) {
		return nil, nil, fmt.Errorf("vmdk: %s: read compressed grain at %d: %w", e.name, off, err)
	}
	length := span
	if e.marker {
		if span < hdr {
			return nil, nil, fmt.Errorf("%w: %s: grain marker at %d past the end of the file", ErrCorrupt, e.name, off)
		}
		lba := binary.LittleEndian.Uint64(raw)
		length = int64(binary.LittleEndian.Uint32(raw[8:]))
		if lba != uint64(grainIndex*e.grain/sectorSize) {
			return nil, nil, fmt.Errorf("%w: %s: grain marker at %d says sector %d, the table says %d", ErrCorrupt, e.name, off, lba, grainIndex*e.grain/sectorSize)
		}
	}
	if length == 0 || length > 2*e.grain || off+hdr+length > e.fileEnd.Load() {
		return nil, nil, fmt.Errorf("%w: %s: compressed grain at %d of %d bytes (file %d bytes, grain %d)", ErrCorrupt, e.name, off, length, e.fileEnd.Load(), e.grain)
	}
	if hdr+length > first {
		raw = (*scratch)[:hdr+length]
		if _, err := e.f.ReadAt(ctx, raw[first:], off+first); err != nil {
			return nil, nil, fmt.Errorf("vmdk: %s: read compressed grain at %d: %w", e.name, off, err)
		}
	}
	buf := raw[hdr : hdr+length]
	if g := parseStored(buf, off+hdr, e.grain, storedRunsMax(e.grain)); g != nil {
		e.storedCache.Put(e.key(sector), g)
		return g, nil, nil
	}
	out := make([]byte, e.grain)
	// Inflate to the stream's end, which checks its Adler-32 (as QEMU's
	// uncompress does): a stream cut short, or a wrong checksum, is an
	// error, and so is more output than a grain.
	n, err := inflate.Zlib(out, buf)
	if errors.Is(err, inflate.ErrTooLong) {
		return nil, nil, fmt.Errorf("%w: %s: compressed grain at %d inflates past one grain", ErrCorrupt, e.name, off)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %s: compressed grain at %d: %v", ErrCorrupt, e.name, off, err)
	}
	out = out[:n]
	e.grainCache.Put(e.key(sector), out)
	return nil, out, nil
}

// scratchBuf is a buffer of a marker and two grains from the extent's
// pool (put it back with e.scratch.Put).
func (e *extent) scratchBuf() *[]byte {
	if s, _ := e.scratch.Get().(*[]byte); s != nil && int64(cap(*s)) >= 12+2*e.grain {
		return s
	}
	b := make([]byte, 12+2*e.grain)
	return &b
}

// key is the cache key of a table or grain at sector of this extent.
func (e *extent) key(sector uint32) int64 { return e.id<<40 | int64(sector) }
