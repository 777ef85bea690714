// Package vhdx reads Hyper-V VHDX images (MS-VHDX; QEMU's block/vhdx.c
// for what QEMU accepts): the file identifier, two headers chosen by
// sequence number under CRC-32C, the region table, the metadata region and
// the block allocation table. Create makes new images (create.go); an
// image opened writable is written with its metadata through the log
// (write.go, logwrite.go), a dirty log replayed first (replay.go).
//
// Every table entry is checked against the file before it is used: a BAT
// region past the end of the file, a payload block inside the headers, the
// log, a region or another block, are refused at open with one line, where
// QEMU 7.2 reads zeroes or another block's bytes.
package vhdx

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"slices"
	"sync"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/blockmap"
	"github.com/blockexport/blockexport/formats/internal/driver"
)

// ErrCorrupt marks an image whose metadata is inconsistent or hostile.
var ErrCorrupt = errors.New("vhdx: corrupt image")

// ErrUnsupported marks a valid image this reader does not read (QEMU 7.2
// refuses the same ones: differencing images, unknown required regions or
// metadata items).
var ErrUnsupported = errors.New("vhdx: unsupported image")

// ErrDirtyLog marks an image whose log holds entries not yet replayed: its
// BAT and metadata may be stale until they are.
var ErrDirtyLog = errors.New("vhdx: log needs to be replayed")

// Layout (MS-VHDX 2.1): a 1 MiB header section holding the file
// identifier, two headers and two copies of the region table.
const (
	mib            = 1 << 20
	header1Offset  = 64 << 10
	header2Offset  = 128 << 10
	headerSize     = 4 << 10
	region1Offset  = 192 << 10
	region2Offset  = 256 << 10
	regionSize     = 64 << 10
	headerSection  = mib
	maxRegions     = 2047
	metaTableSize  = 64 << 10
	maxMetaEntries = 2047

	blockSizeMin = 1 << 20
	blockSizeMax = 256 << 20
	// maxImageSize is QEMU's VHDX_MAX_IMAGE_SIZE (64 TiB, the spec's
	// limit): it bounds the BAT held in memory to what QEMU would hold.
	maxImageSize = 64 << 40
	// sectorsPerChunk is 2^23: the sectors one sector bitmap block covers.
	sectorsPerChunk = 1 << 23
)

// BAT entry states (MS-VHDX 2.5.1).
const (
	blockNotPresent       = 0
	blockUndefined        = 1
	blockZero             = 2
	blockUnmapped         = 3
	blockFullyPresent     = 6
	blockPartiallyPresent = 7
	batStateMask          = 7
	batOffsetMask         = 0xFFFFFFFFFFF00000
)

// GUIDs in their on-disk (little-endian first three fields) byte order.
var (
	guidBAT           = msGUID(0x2dc27766, 0xf623, 0x4200, 0x9d, 0x64, 0x11, 0x5e, 0x9b, 0xfd, 0x4a, 0x08)
	guidMetadata      = msGUID(0x8b7ca206, 0x4790, 0x4b9a, 0xb8, 0xfe, 0x57, 0x5f, 0x05, 0x0f, 0x88, 0x6e)
	guidFileParams    = msGUID(0xcaa16737, 0xfa36, 0x4d43, 0xb3, 0xb6, 0x33, 0xf0, 0xaa, 0x44, 0xe7, 0x6b)
	guidVirtualSize   = msGUID(0x2fa54224, 0xcd1b, 0x4876, 0xb2, 0x11, 0x5d, 0xbe, 0xd8, 0x3b, 0xf4, 0xb8)
	guidPage83        = msGUID(0xbeca12ab, 0xb2e6, 0x4523, 0x93, 0xef, 0xc3, 0x09, 0xe0, 0x00, 0xc7, 0x46)
	guidLogicalSector = msGUID(0x8141bf1d, 0xa96f, 0x4709, 0xba, 0x47, 0xf2, 0x33, 0xa8, 0xfa, 0xab, 0x5f)
	guidPhysSector    = msGUID(0xcda348c7, 0x445d, 0x4471, 0x9c, 0xc9, 0xe9, 0x88, 0x52, 0x51, 0xc5, 0x56)
	guidParentLocator = msGUID(0xa8d35f2d, 0xb30b, 0x454d, 0xab, 0xf7, 0xd3, 0xd8, 0x48, 0x34, 0xab, 0x0c)
	castagnoli        = crc32.MakeTable(crc32.Castagnoli)
)

func msGUID(d1 uint32, d2, d3 uint16, d4 ...byte) [16]byte {
	var g [16]byte
	binary.LittleEndian.PutUint32(g[0:], d1)
	binary.LittleEndian.PutUint16(g[4:], d2)
	binary.LittleEndian.PutUint16(g[6:], d3)
	copy(g[8:], d4)
	return g
}

// Options say how to open an image.
type Options struct {
	// OpenParent opens a differencing image's parent by the name its
	// parent locator gives (the registry confines it to the image's
	// directory) and returns it with its name as shown. nil: differencing
	// images are refused. A nil image with no error: parents are not
	// opened (info without the chain); reads of the parent's sectors
	// then read zeroes, so only a command that reads no data asks that.
	OpenParent func(name string) (formats.Image, string, error)
}

// header is the active VHDX header (MS-VHDX 2.2.2).
type header struct {
	seq           uint64
	dataWriteGUID [16]byte
	logGUID       [16]byte
	logVersion    uint16
	logLength     uint32
	logOffset     uint64
}

// span is a byte range of the file that holds metadata.
type span struct {
	start, end uint64
	what       string
}

// Image is an open VHDX image.
type Image struct {
	blockmap.Map // reads, tries, lends and extents, from locate
	formats.ReadOnly
	f    aio.File
	path string

	size           int64 // virtual size as QEMU reports it (whole 512-byte sectors)
	blockSize      int64
	logicalSector  uint32
	physicalSector uint32
	// fixed: the file parameters' LeaveBlocksAllocated (a fixed disk).
	fixed bool
	// bat holds the payload entries only, one per data block: what reads
	// need, never more than QEMU's BAT copy.
	bat []uint64
	// dataWriteGUID is the active header's: a child's parent_linkage.
	dataWriteGUID [16]byte

	// Differencing images: the parent (nil: not opened), its name as
	// shown, and one sector bitmap entry per chunk of chunkRatio blocks.
	diff       bool
	parent     formats.Image
	parentName string
	chunkRatio int64
	bitmaps    []uint64

	// Where the metadata lies, for a writer: every span the reader found
	// (the header section, the log, the regions), the BAT region and the
	// log.
	spans          []span
	batOff         int64
	logOff, logLen int64
	// mu guards bat, bitmaps and pending against a writer's changes
	// (write.go); a read-only image never takes it exclusively.
	mu sync.RWMutex
	// pending holds the 4 KiB metadata sectors (BAT and sector bitmap)
	// a writer changed and has not yet written through the log, by file
	// offset: reads of sector bitmaps see them first.
	pending map[int64][]byte
}

// New opens the VHDX image in f, which it owns from now on (Close closes
// it; so does a failed New).
func New(ctx context.Context, f aio.File, o Options) (*Image, error) {
	img, err := open(ctx, f, o, nil)
	if err != nil {
		f.Close()
		return nil, err
	}
	return img, nil
}

// open opens the image; with found set (a check), BAT entries past the
// end of the file are listed there instead of refused.
func open(ctx context.Context, f aio.File, o Options, found *[]string) (*Image, error) {
	name := f.Name()
	r, h, err := readHeaders(ctx, f, found)
	if err != nil {
		return nil, err
	}
	spans := []span{{0, headerSection, "the header section"}}
	if h.logLength > 0 {
		spans = append(spans, span{h.logOffset, h.logOffset + uint64(h.logLength), "the log"})
	}
	if err := r.checkLog(h); err != nil {
		return nil, err
	}
	bat, meta, spans, err := r.regions(spans)
	if err != nil {
		return nil, err
	}
	img := &Image{f: f, path: name, dataWriteGUID: h.dataWriteGUID, batOff: int64(bat.start), logOff: int64(h.logOffset), logLen: int64(h.logLength)}
	locator, err := r.metadata(img, meta)
	if err != nil {
		return nil, err
	}
	if img.diff && o.OpenParent == nil {
		return nil, fmt.Errorf("%w: %s: differencing VHDX image, and no way to open its parent here", ErrUnsupported, name)
	}
	if err := r.loadBAT(img, bat, spans); err != nil {
		return nil, err
	}
	img.spans = spans
	if img.diff {
		if err := img.openParent(locator, o.OpenParent); err != nil {
			return nil, err
		}
	}
	img.Map = blockmap.Map{Format: "vhdx", End: img.size, Locate: img.locate, Backing: img.parent, File: f,
		ReadOwn: func(ctx context.Context, r blockmap.Run, p []byte, off int64) error {
			return img.readPartial(ctx, p, off, r.Host-off%img.blockSize)
		}}
	return img, nil
}

// readHeaders makes the reader of f (a host file aio.Open accepted, or a
// remote object) and reads its file identifier and active header.
func readHeaders(ctx context.Context, f aio.File, found *[]string) (*reader, header, error) {
	size, err := aio.FileSize(f)
	if err != nil {
		return nil, header{}, fmt.Errorf("vhdx: %w", err)
	}
	r := &reader{ctx: ctx, f: f, name: f.Name(), size: uint64(size), found: found}
	id, err := r.read(0, 8)
	if err != nil {
		return nil, header{}, err
	}
	if Probe(id, "") == 0 {
		return nil, header{}, fmt.Errorf("%w: %s: no VHDX file identifier", ErrCorrupt, r.name)
	}
	h, err := r.headers()
	return r, h, err
}

// reader reads the metadata of one file at open.
type reader struct {
	ctx  context.Context
	f    aio.File
	name string
	size uint64
	// found, for a check: BAT entries past the end of the file, in
	// qemu-img check's words, instead of a refusal.
	found *[]string
}

// read reads n bytes at off; bytes past the end of the file read as
// zeroes, as QEMU's block layer reads them (a short file then fails its
// signature or checksum, not a read).
func (r *reader) read(off uint64, n int) ([]byte, error) {
	buf := make([]byte, n)
	if off >= r.size {
		return buf, nil
	}
	got, err := r.f.ReadAt(r.ctx, buf, int64(off))
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("vhdx: %s: read %d bytes at %d: %w", r.name, n, off, err)
	}
	clear(buf[got:])
	return buf, nil
}

// checksumOK checks a CRC-32C stored at buf[4:8], computed with that
// field as zero.
func checksumOK(buf []byte) bool {
	want := binary.LittleEndian.Uint32(buf[4:])
	c := crc32.Update(0, castagnoli, buf[:4])
	c = crc32.Update(c, castagnoli, []byte{0, 0, 0, 0})
	c = crc32.Update(c, castagnoli, buf[8:])
	return c == want
}

// headers picks the active header as QEMU's vhdx_parse_header does: a
// header counts if its checksum, signature and version are right; of two,
// the higher sequence number wins; equal numbers are accepted only for
// identical headers (Disk2VHD writes those).
func (r *reader) headers() (header, error) {
	var raw [2][]byte
	var valid [2]bool
	for i, off := range []uint64{header1Offset, header2Offset} {
		b, err := r.read(off, headerSize)
		if err != nil {
			return header{}, err
		}
		raw[i] = b
		valid[i] = string(b[:4]) == "head" && checksumOK(b) && binary.LittleEndian.Uint16(b[66:]) == 1
	}
	cur := 0
	switch {
	case valid[0] && !valid[1]:
	case !valid[0] && valid[1]:
		cur = 1
	case !valid[0] && !valid[1]:
		return header{}, fmt.Errorf("%w: %s: no valid VHDX header (both fail their checksum, signature or version)", ErrCorrupt, r.name)
	default:
		s0, s1 := binary.LittleEndian.Uint64(raw[0][8:]), binary.LittleEndian.Uint64(raw[1][8:])
		switch {
		case s1 > s0:
			cur = 1
		case s1 == s0 && !bytes.Equal(raw[0][:80], raw[1][:80]):
			return header{}, fmt.Errorf("%w: %s: both VHDX headers have sequence number %d but differ", ErrCorrupt, r.name, s0)
		}
	}
	b := raw[cur]
	h := header{
		seq:        binary.LittleEndian.Uint64(b[8:]),
		logVersion: binary.LittleEndian.Uint16(b[64:]),
		logLength:  binary.LittleEndian.Uint32(b[68:]),
		logOffset:  binary.LittleEndian.Uint64(b[72:]),
	}
	copy(h.dataWriteGUID[:], b[32:48])
	copy(h.logGUID[:], b[48:64])
	return h, nil
}

// regions reads the region table (the first copy, the second where the
// first fails its checksum: MS-VHDX keeps two for that) and returns the
// BAT and metadata regions, each checked to lie in the file, aligned, and
// clear of the header section, the log and every other region.
func (r *reader) regions(spans []span) (bat, meta span, _ []span, _ error) {
	var b []byte
	for _, off := range []uint64{region1Offset, region2Offset} {
		t, err := r.read(off, regionSize)
		if err != nil {
			return span{}, span{}, nil, err
		}
		if string(t[:4]) == "regi" && checksumOK(t) {
			b = t
			break
		}
	}
	if b == nil {
		return span{}, span{}, nil, fmt.Errorf("%w: %s: both copies of the region table fail their checksum or signature", ErrCorrupt, r.name)
	}
	n := binary.LittleEndian.Uint32(b[8:])
	if n > maxRegions {
		return span{}, span{}, nil, fmt.Errorf("%w: %s: region table has %d entries (at most %d)", ErrCorrupt, r.name, n, maxRegions)
	}
	var haveBAT, haveMeta bool
	for i := range int(n) {
		e := b[16+32*i : 16+32*(i+1)]
		guid := [16]byte(e[:16])
		off := binary.LittleEndian.Uint64(e[16:])
		length := uint64(binary.LittleEndian.Uint32(e[24:]))
		required := binary.LittleEndian.Uint32(e[28:])&1 != 0
		what := fmt.Sprintf("region %d", i)
		switch guid {
		case guidBAT:
			what = "the BAT region"
		case guidMetadata:
			what = "the metadata region"
		}
		s := span{off, off + length, what}
		if off%mib != 0 || length%mib != 0 || length == 0 || off > r.size || length > r.size-off {
			return span{}, span{}, nil, fmt.Errorf("%w: %s: %s [%d, +%d) is not whole MiB inside the file (%d bytes)", ErrCorrupt, r.name, what, off, length, r.size)
		}
		if o := overlap(spans, s); o != nil {
			return span{}, span{}, nil, fmt.Errorf("%w: %s: %s [%d, +%d) overlaps %s", ErrCorrupt, r.name, what, off, length, o.what)
		}
		spans = append(spans, s)
		switch guid {
		case guidBAT:
			if haveBAT {
				return span{}, span{}, nil, fmt.Errorf("%w: %s: two BAT regions", ErrCorrupt, r.name)
			}
			haveBAT, bat = true, s
		case guidMetadata:
			if haveMeta {
				return span{}, span{}, nil, fmt.Errorf("%w: %s: two metadata regions", ErrCorrupt, r.name)
			}
			haveMeta, meta = true, s
		default:
			if required {
				return span{}, span{}, nil, fmt.Errorf("%w: %s: region %d (%x) is marked required and is not one this reader knows (QEMU refuses it too)", ErrUnsupported, r.name, i, guid)
			}
		}
	}
	if !haveBAT || !haveMeta {
		return span{}, span{}, nil, fmt.Errorf("%w: %s: region table lacks the BAT or metadata region", ErrCorrupt, r.name)
	}
	return bat, meta, spans, nil
}

// overlap returns the span of spans that s overlaps, or nil.
func overlap(spans []span, s span) *span {
	for i := range spans {
		if s.start < spans[i].end && spans[i].start < s.end {
			return &spans[i]
		}
	}
	return nil
}

// metadata parses the metadata table and items (MS-VHDX 2.6).
func (r *reader) metadata(img *Image, meta span) ([]byte, error) {
	b, err := r.read(meta.start, metaTableSize)
	if err != nil {
		return nil, err
	}
	if string(b[:8]) != "metadata" {
		return nil, fmt.Errorf("%w: %s: metadata table has no signature", ErrCorrupt, r.name)
	}
	n := int(binary.LittleEndian.Uint16(b[10:]))
	if n > maxMetaEntries {
		return nil, fmt.Errorf("%w: %s: metadata table has %d entries (at most %d)", ErrCorrupt, r.name, n, maxMetaEntries)
	}
	items := map[[16]byte][]byte{}
	want := map[[16]byte]uint32{guidFileParams: 8, guidVirtualSize: 8, guidPage83: 16, guidLogicalSector: 4, guidPhysSector: 4, guidParentLocator: 20}
	var locator []byte
	for i := range n {
		e := b[32+32*i : 32+32*(i+1)]
		guid := [16]byte(e[:16])
		off := binary.LittleEndian.Uint32(e[16:])
		length := binary.LittleEndian.Uint32(e[20:])
		required := binary.LittleEndian.Uint32(e[24:])&4 != 0
		size, known := want[guid]
		if !known {
			if required {
				return nil, fmt.Errorf("%w: %s: metadata item %x is marked required and is not one this reader knows (QEMU refuses it too)", ErrUnsupported, r.name, guid)
			}
			continue
		}
		if _, dup := items[guid]; dup {
			return nil, fmt.Errorf("%w: %s: metadata item %x appears twice", ErrCorrupt, r.name, guid)
		}
		if off < metaTableSize || length < size || uint64(off)+uint64(length) > meta.end-meta.start {
			return nil, fmt.Errorf("%w: %s: metadata item %x at [%d, +%d) is outside the metadata region's %d bytes or too short", ErrCorrupt, r.name, guid, off, length, meta.end-meta.start)
		}
		if guid == guidParentLocator {
			// Read whole: its key-value table points into it. A metadata
			// item is inside its region, so at most the region's length.
			size = min(length, maxLocatorSize)
		}
		v, err := r.read(meta.start+uint64(off), int(size))
		if err != nil {
			return nil, err
		}
		items[guid] = v
	}
	for _, g := range [][16]byte{guidFileParams, guidVirtualSize, guidPage83, guidLogicalSector, guidPhysSector} {
		if items[g] == nil {
			return nil, fmt.Errorf("%w: %s: metadata lacks a required item (%x)", ErrCorrupt, r.name, g)
		}
	}
	params := items[guidFileParams]
	bs := binary.LittleEndian.Uint32(params)
	flags := binary.LittleEndian.Uint32(params[4:])
	if flags&2 != 0 {
		if items[guidParentLocator] == nil {
			return nil, fmt.Errorf("%w: %s: has a parent but no parent locator", ErrCorrupt, r.name)
		}
		img.diff, locator = true, items[guidParentLocator]
	}
	if bs < blockSizeMin || bs > blockSizeMax || bs&(bs-1) != 0 {
		return nil, fmt.Errorf("%w: %s: block size %d is not a power of two from 1 MiB to 256 MiB", ErrCorrupt, r.name, bs)
	}
	ls := binary.LittleEndian.Uint32(items[guidLogicalSector])
	ps := binary.LittleEndian.Uint32(items[guidPhysSector])
	// The physical sector size is a hint to the guest, read by nothing
	// here: QEMU does not check it either. (QEMU 7.2 refuses 4096-byte
	// logical sectors, which Hyper-V makes; they only change the chunk
	// ratio, and are read here.)
	if ls != 512 && ls != 4096 {
		return nil, fmt.Errorf("%w: %s: logical sector size %d is not 512 or 4096", ErrCorrupt, r.name, ls)
	}
	vs := binary.LittleEndian.Uint64(items[guidVirtualSize])
	if vs > maxImageSize {
		return nil, fmt.Errorf("%w: %s: virtual size %d is above the 64 TiB VHDX maximum", ErrCorrupt, r.name, vs)
	}
	img.blockSize, img.fixed = int64(bs), flags&1 != 0
	img.logicalSector, img.physicalSector = ls, ps
	// QEMU's size is in whole 512-byte sectors.
	img.size = int64(vs) &^ 511
	return locator, nil
}

// loadBAT reads the BAT and keeps the payload entries, refusing a state
// the spec does not define for a non-differencing image and a present
// block that does not lie wholly in the file, clear of every metadata
// span and of every other block.
func (r *reader) loadBAT(img *Image, bat span, spans []span) error {
	blocks := (uint64(img.size) + uint64(img.blockSize) - 1) / uint64(img.blockSize)
	chunk := uint64(sectorsPerChunk) * uint64(img.logicalSector) / uint64(img.blockSize)
	img.chunkRatio = int64(chunk)
	entries := uint64(0)
	chunks := (blocks + chunk - 1) / chunk
	switch {
	case img.diff:
		entries = chunks * (chunk + 1) // every chunk has its sector bitmap entry
	case blocks > 0:
		entries = blocks + (blocks-1)/chunk
	}
	if entries > (bat.end-bat.start)/8 {
		return fmt.Errorf("%w: %s: the BAT region holds %d entries; the virtual size needs %d", ErrCorrupt, r.name, (bat.end-bat.start)/8, entries)
	}
	// The BAT is read a MiB at a time into the payload and sector bitmap
	// entries kept: no second copy of a BAT of up to 512 MiB.
	img.bat = make([]uint64, blocks)
	if img.diff {
		img.bitmaps = make([]uint64, chunks)
	}
	buf := make([]byte, min(entries*8, mib))
	for j := uint64(0); j < entries; {
		n := min(uint64(len(buf))/8, entries-j)
		got, err := r.f.ReadAt(r.ctx, buf[:n*8], int64(bat.start+8*j))
		if err != nil && !(errors.Is(err, io.EOF) && uint64(got) == n*8) {
			return fmt.Errorf("vhdx: %s: read the BAT: %w", r.name, err)
		}
		for x := range n {
			e := binary.LittleEndian.Uint64(buf[8*x:])
			switch idx := j + x; {
			case idx%(chunk+1) != chunk:
				if b := idx - idx/(chunk+1); b < blocks { // a last chunk's tail has no blocks
					img.bat[b] = e
				}
			case img.diff:
				img.bitmaps[idx/(chunk+1)] = e
			}
		}
		j += n
	}
	// present holds the file offset of every present block and sector
	// bitmap (MiB-aligned, so bit 0 marks a bitmap), to find overlaps.
	var present []uint64
	sbSize := uint64(mib) // a sector bitmap block
	for k, e := range img.bitmaps {
		switch e & batStateMask {
		case blockNotPresent:
		case blockFullyPresent: // SB_BLOCK_PRESENT
			off := e & batOffsetMask
			if off > r.size || sbSize > r.size-off {
				return fmt.Errorf("%w: %s: sector bitmap %d points at [%d, +%d), past the end of the file (%d bytes)", ErrCorrupt, r.name, k, off, sbSize, r.size)
			}
			if o := overlap(spans, span{off, off + sbSize, ""}); o != nil {
				return fmt.Errorf("%w: %s: sector bitmap %d points at [%d, +%d), inside %s", ErrCorrupt, r.name, k, off, sbSize, o.what)
			}
			present = append(present, off|1)
		default:
			return fmt.Errorf("%w: %s: sector bitmap entry %d has state %d", ErrCorrupt, r.name, k, e&batStateMask)
		}
	}
	for i, e := range img.bat {
		i := uint64(i)
		switch e & batStateMask {
		case blockNotPresent, blockUndefined, blockZero, blockUnmapped:
		case blockPartiallyPresent:
			if !img.diff {
				return fmt.Errorf("%w: %s: BAT entry %d is partially present in an image without a parent", ErrCorrupt, r.name, i)
			}
			if img.bitmaps[i/chunk]&batStateMask != blockFullyPresent {
				return fmt.Errorf("%w: %s: BAT entry %d is partially present, and its chunk has no sector bitmap", ErrCorrupt, r.name, i)
			}
			fallthrough
		case blockFullyPresent:
			off := e & batOffsetMask
			s := span{off, off + uint64(img.blockSize), ""}
			// The last block need only hold the disk's bytes, as QEMU
			// allows (files from other tools end there).
			need := min(uint64(img.blockSize), uint64(img.size)-i*uint64(img.blockSize))
			if (off > r.size || need > r.size-off) && r.found != nil {
				*r.found = append(*r.found, fmt.Sprintf("VHDX BAT entry %d start offset %d points after end of file (%d). Image has probably been truncated.", batIndex(i, chunk), off, r.size))
				img.bat[i] = blockNotPresent
				continue
			}
			if off > r.size || need > r.size-off {
				return fmt.Errorf("%w: %s: BAT entry %d points at [%d, +%d), past the end of the file (%d bytes)", ErrCorrupt, r.name, i, off, need, r.size)
			}
			if o := overlap(spans, s); o != nil {
				return fmt.Errorf("%w: %s: BAT entry %d points at [%d, +%d), inside %s", ErrCorrupt, r.name, i, off, img.blockSize, o.what)
			}
			present = append(present, off)
		default:
			return fmt.Errorf("%w: %s: BAT entry %d has state %d, undefined for a VHDX image without a parent", ErrCorrupt, r.name, i, e&batStateMask)
		}
	}
	slices.Sort(present)
	for i := 1; i < len(present); i++ {
		prev, size := present[i-1], uint64(img.blockSize)
		if prev&1 != 0 {
			prev, size = prev&^1, sbSize
		}
		if present[i]&^1 < prev+size {
			return fmt.Errorf("%w: %s: BAT entries share file bytes at %d (a block or sector bitmap over another)", ErrCorrupt, r.name, present[i]&^1)
		}
	}
	return nil
}

// Size is the virtual size in bytes.
func (img *Image) Size() int64 { return img.size }

// locate says where the bytes at off lie, to the end of their block:
// present blocks in the file; a partially present block's sectors come
// from the file or the parent by its sector bitmap, which is not held in
// memory (read by readPartial: a try says it would wait); a differencing
// image's NOT_PRESENT and UNDEFINED blocks are the parent's; ZERO blocks
// (and UNMAPPED ones with a parent) are allocated zeroes; the other
// states read as zeroes from nowhere, as QEMU reads them without a parent.
func (img *Image) locate(_ context.Context, off, n int64, try bool) (blockmap.Run, bool, error) {
	in := off % img.blockSize
	r := blockmap.Run{Kind: blockmap.Hole, N: min(n, img.blockSize-in), File: img.f}
	if !try {
		img.mu.RLock()
	} else if !img.mu.TryRLock() {
		return r, false, nil
	}
	e := img.bat[off/img.blockSize]
	img.mu.RUnlock()
	switch state := e & batStateMask; {
	case state == blockFullyPresent:
		r.Kind, r.Host = blockmap.Data, int64(e&batOffsetMask)+in
	case state == blockPartiallyPresent:
		r.Kind, r.Host = blockmap.Own, int64(e&batOffsetMask)+in
		return r, !try, nil
	case img.fromParent(state):
		r.Kind = blockmap.Backing
	case state == blockZero || state == blockUnmapped && img.diff:
		r.Kind = blockmap.Zero
	}
	return r, true, nil
}

// Info is what qemu-img 7.2 prints for a VHDX image: its block size as
// the cluster size, and no format-specific block (QEMU's vhdx driver has
// no bdrv_get_specific_info).
func (img *Image) Info() formats.Info {
	inf := formats.Info{Format: "vhdx", Filename: img.path, VirtualSize: img.size, ActualSize: img.ActualSize(),
		ClusterSize: img.blockSize, RequestAlignment: 1}
	if img.diff {
		inf.BackingFilename, inf.FullBackingFilename, inf.BackingFilenameFormat = img.parentName, img.parentName, "vhdx"
	}
	return inf
}

// Close closes the file and the parent's.
func (img *Image) Close() error {
	err := img.f.Close()
	if img.parent != nil {
		err = errors.Join(err, img.parent.Close())
	}
	return err
}

// batIndex is the BAT entry of payload block i: each chunk's payload
// entries are followed by its sector bitmap entry.
func batIndex(i, chunk uint64) uint64 { return i + i/chunk }

// Check checks the image in f as qemu-img check checks a VHDX: the image
// opens (every refusal of New is the check's failure, exit 1), and each
// present block that lies past the end of the file is a corruption, said
// in qemu-img's words. QEMU's check repairs nothing itself; its one
// repair is replaying a dirty log, which it does at any writable open, so
// a repair (-r leaks or all, f writable under the writer's lock) replays
// the log first, counted as one corruption fixed, as qemu-img counts it.
// Without -r a dirty log fails the check with the line that says how to
// replay it. The parent of a differencing image is not opened: the check
// is of this file. f is closed.
func Check(ctx context.Context, f aio.File, _ driver.Options, repair int) (formats.CheckResult, error) {
	replayed := false
	if repair != driver.RepairNone {
		var err error
		if replayed, err = Replay(ctx, f); err != nil {
			f.Close()
			return formats.CheckResult{}, err
		}
	}
	var found []string
	img, err := open(ctx, f, Options{OpenParent: func(string) (formats.Image, string, error) { return nil, "", nil }}, &found)
	if err != nil {
		f.Close()
		return formats.CheckResult{}, err
	}
	res := formats.CheckResult{Filename: img.path, Format: "vhdx", Corruptions: int64(len(found)), Messages: found}
	if replayed {
		res.CorruptionsFixed++
	}
	return res, img.Close()
}
