// Package vdi reads VirtualBox disk images (VDI, version 1.1), static and
// dynamic, as QEMU 7.2's vdi driver does (block/vdi.c): a 512-byte header,
// a block map of little-endian 32-bit entries, and 1 MiB data blocks.
//
// Images open read-only or writable (write.go: data before metadata, no
// deallocation, as QEMU), and Create makes them (create.go). Unlike QEMU,
// every block-map entry is checked when the image opens: an entry past
// the blocks the header counts or past the end of the file, and two
// entries naming one data block, make the image corrupt (QEMU serves
// zeroes or another block's bytes for them without an error). Data at an
// offset that is not a multiple of 512 (xmount's layout, which VirtualBox
// reads) is read and written; QEMU refuses it.
package vdi

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/blockmap"
)

// Errors callers branch on.
var (
	// ErrCorrupt: the metadata contradicts itself or the file.
	ErrCorrupt = errors.New("vdi: image is corrupt")
	// ErrUnsupported: a valid VDI image QEMU does not read either
	// (another version, block size, a differencing image).
	ErrUnsupported = errors.New("vdi: unsupported image")
)

const (
	headerSize  = 512 // QEMU's VdiHeader, read whole
	signature   = 0xbeda107f
	version11   = 0x00010001
	typeStatic  = 2
	sectorSize  = 512
	blockSize   = 1 << 20 // the only block size QEMU reads
	unallocated = 0xffffffff
	discarded   = 0xfffffffe // reads as zeroes
	// maxBlocks is QEMU's VDI_BLOCKS_IN_IMAGE_MAX: a block map of at most
	// 2 GiB, read in one piece.
	maxBlocks    = (1<<31 - 512) / 4
	maxDiskSize  = maxBlocks * blockSize
	offBmapField = 0x154
	// allocatedField is where the header counts the allocated blocks.
	allocatedField = offBmapField + 48
)

// Header is the part of the VDI header the reader uses, host-endian.
type Header struct {
	Version         uint32
	ImageType       uint32
	OffsetBmap      uint32
	OffsetData      uint32
	SectorSize      uint32
	DiskSize        uint64
	BlockSize       uint32
	BlocksInImage   uint32
	BlocksAllocated uint32
	UUIDLink        [16]byte
	UUIDParent      [16]byte
}

func parseHeader(b []byte) (Header, error) {
	le := binary.LittleEndian
	if le.Uint32(b[64:]) != signature {
		return Header{}, fmt.Errorf("%w: bad signature %08x", ErrCorrupt, le.Uint32(b[64:]))
	}
	h := Header{
		Version:         le.Uint32(b[68:]),
		ImageType:       le.Uint32(b[76:]),
		OffsetBmap:      le.Uint32(b[offBmapField:]),
		OffsetData:      le.Uint32(b[offBmapField+4:]),
		SectorSize:      le.Uint32(b[offBmapField+20:]),
		DiskSize:        le.Uint64(b[offBmapField+28:]),
		BlockSize:       le.Uint32(b[offBmapField+36:]),
		BlocksInImage:   le.Uint32(b[offBmapField+44:]),
		BlocksAllocated: le.Uint32(b[offBmapField+48:]),
	}
	copy(h.UUIDLink[:], b[offBmapField+84:])
	copy(h.UUIDParent[:], b[offBmapField+100:])
	return h, nil
}

// validate applies QEMU's vdi_open checks, in its order, and rounds an odd
// disk size up to a sector as it does. Unlike QEMU, data that starts at
// an offset that is not a multiple of 512 is accepted: xmount puts it
// right after the block map (0x380 for a 96 MiB disk), VirtualBox reads
// such images, and nothing in them contradicts itself (where the data
// would overlap the map, loadBmap refuses the image).
func (h *Header) validate() error {
	if h.DiskSize > maxDiskSize {
		return fmt.Errorf("%w: size %#x is over the maximum %#x", ErrUnsupported, h.DiskSize, uint64(maxDiskSize))
	}
	h.DiskSize = (h.DiskSize + sectorSize - 1) &^ (sectorSize - 1) // VBoxManage convertfromraw makes odd sizes
	switch {
	case h.Version != version11:
		return fmt.Errorf("%w: version %d.%d", ErrUnsupported, h.Version>>16, h.Version&0xffff)
	case h.OffsetBmap%sectorSize != 0:
		return fmt.Errorf("%w: unaligned block map offset %#x", ErrUnsupported, h.OffsetBmap)
	case h.SectorSize != sectorSize:
		return fmt.Errorf("%w: sector size %d is not %d", ErrUnsupported, h.SectorSize, sectorSize)
	case h.BlockSize != blockSize:
		return fmt.Errorf("%w: block size %d is not %d", ErrUnsupported, h.BlockSize, blockSize)
	case h.DiskSize > uint64(h.BlocksInImage)*uint64(h.BlockSize):
		return fmt.Errorf("%w: disk size %d, block map has room for %d", ErrUnsupported, h.DiskSize, uint64(h.BlocksInImage)*uint64(h.BlockSize))
	case h.UUIDLink != [16]byte{}:
		return fmt.Errorf("%w: non-null link UUID", ErrUnsupported)
	case h.UUIDParent != [16]byte{}:
		return fmt.Errorf("%w: non-null parent UUID (a differencing image)", ErrUnsupported)
	case h.BlocksInImage > maxBlocks:
		return fmt.Errorf("%w: too many blocks %d, max is %d", ErrUnsupported, h.BlocksInImage, maxBlocks)
	}
	return nil
}

// Image is an open VDI image.
type Image struct {
	blockmap.Map // reads, tries, lends and extents, from locate
	f            aio.File
	h            Header
	size         int64
	static       bool
	// bmap holds the entries of the blocks that cover the disk (QEMU holds
	// blocks_in_image of them; those past the disk are never used). A
	// writer changes an entry from unallocated to a data block: entries
	// are read and stored atomically.
	bmap []uint32

	writable bool
	noFlush  atomic.Bool // qemu-img's cache=unsafe: no syncs (SetNoFlush)
	// alloc serialises allocations: the header's count, head and the
	// block buffer are its.
	alloc allocator
}

// allocator is the state of a writable image's allocations.
type allocator struct {
	mu sync.Mutex
	// count is the header's blocks_allocated: the next data block.
	count uint32
	// head is the file's first bytes: the header, then the block map's
	// first entries (up to maxHead, never past the map), as written; an
	// allocation in that part of the map writes its entry and the new
	// count in one write.
	head []byte
	// metaEnd bounds every metadata write: the end of the block map,
	// where the data may begin.
	metaEnd int64
	// block is a new block's bytes before it is written.
	block []byte
	// used marks the data blocks below the count that entries name, and
	// leaked counts those they do not, which allocation takes first
	// (from next up); nil once none is left.
	used   []uint64
	leaked uint32
	next   uint32
	// failed: a metadata write failed; the image takes no more writes.
	failed error
}

// Options say how to open a VDI image.
type Options struct {
	// Writable opens it for writing (the block map checked whole first).
	Writable bool
	// Direct: the file is O_DIRECT (behind aio.Aligned).
	Direct bool
	// Logger hears of leaked blocks found by a writable open; nil: none.
	Logger *slog.Logger
}

// New opens the VDI image of f, which it owns from now on (Close closes
// it; so does a failed New).
func New(ctx context.Context, f aio.File, o Options) (*Image, error) {
	img, err := open(ctx, f)
	if err == nil && o.Writable {
		err = img.openForWriting(ctx, o.Direct, o.Logger)
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: %w", f.Name(), err)
	}
	return img, nil
}

func open(ctx context.Context, f aio.File) (*Image, error) {
	fileSize, err := aio.FileSize(f)
	if err != nil {
		return nil, err
	}
	// A short file reads as zero-padded, as QEMU reads it; its size is
	// refused after the fields are (QEMU's messages first).
	h, err := readHeader(ctx, f)
	if err != nil {
		return nil, err
	}
	if fileSize < headerSize {
		return nil, fmt.Errorf("%w: file of %d bytes is shorter than the header", ErrCorrupt, fileSize)
	}
	img := &Image{f: f, h: h, size: int64(h.DiskSize), static: h.ImageType == typeStatic}
	if err := img.loadBmap(ctx, fileSize); err != nil {
		return nil, err
	}
	img.Map = blockmap.Map{Format: "vdi", End: img.size, Locate: img.locate, File: f}
	return img, nil
}

// loadBmap reads and checks the entries of the blocks that hold the disk.
// QEMU reads a block map past the end of the file as zeroes (every block
// then is data block 0) and uses entries unchecked; here the map must lie
// in the file, after the header and before the data, and each allocated
// entry must name a distinct data block inside the file and below the
// header's count.
func (img *Image) loadBmap(ctx context.Context, fileSize int64) error {
	h := img.h
	blocks := (img.size + blockSize - 1) / blockSize // <= BlocksInImage (validate)
	mapStart, mapEnd := int64(h.OffsetBmap), int64(h.OffsetBmap)+4*blocks
	switch {
	case mapStart < headerSize:
		return fmt.Errorf("%w: block map at %#x overlaps the header", ErrCorrupt, mapStart)
	case mapEnd > fileSize:
		return fmt.Errorf("%w: block map [%#x, %#x) ends past the end of the file (%d bytes)", ErrCorrupt, mapStart, mapEnd, fileSize)
	case blocks > 0 && int64(h.OffsetData) < mapEnd:
		return fmt.Errorf("%w: data at %#x overlaps the block map [%#x, %#x)", ErrCorrupt, h.OffsetData, mapStart, mapEnd)
	}
	raw := make([]byte, 4*blocks) // bounded by the file's size (checked above)
	if _, err := img.f.ReadAt(ctx, raw, mapStart); err != nil {
		return fmt.Errorf("vdi: read block map: %w", err)
	}
	// Data blocks that fit in the file: a used one is marked here, so
	// that a second entry naming it is seen (bounded by the file, not by
	// the header's counts).
	// Every entry checked below is at most fit, whose (partial) block is
	// the last one in the file.
	fit := max(0, (fileSize-int64(h.OffsetData))/blockSize)
	used := make([]uint64, (min(fit+1, int64(h.BlocksAllocated))+63)/64)
	img.bmap = make([]uint32, blocks)
	for i := range img.bmap {
		e := binary.LittleEndian.Uint32(raw[4*i:])
		img.bmap[i] = e
		if e >= discarded {
			continue
		}
		if e >= h.BlocksAllocated {
			return fmt.Errorf("%w: block %d names data block %d, but the image has %d", ErrCorrupt, i, e, h.BlocksAllocated)
		}
		// The part of the block inside the disk must be in the file.
		need := min(int64(blockSize), img.size-int64(i)*blockSize)
		if off := int64(h.OffsetData) + int64(e)*blockSize; off+need > fileSize {
			return fmt.Errorf("%w: block %d's data at %#x ends past the end of the file (%d bytes)", ErrCorrupt, i, off, fileSize)
		}
		w, bit := e/64, uint64(1)<<(e%64)
		if used[w]&bit != 0 {
			return fmt.Errorf("%w: block %d names data block %d, which another block names too", ErrCorrupt, i, e)
		}
		used[w] |= bit
	}
	return nil
}

func (img *Image) Size() int64 { return img.size }

// locate says where the bytes at off lie, to the end of their block: an
// allocated block's in the file (the file's own bytes for a static image,
// whose holes QEMU asks the file about), or zeroes for an unallocated or
// discarded one (QEMU's BDRV_BLOCK_ZERO).
func (img *Image) locate(_ context.Context, off, n int64, _ bool) (blockmap.Run, bool, error) {
	in := off % blockSize
	r := blockmap.Run{Kind: blockmap.Zero, N: min(n, blockSize-in)}
	if e := atomic.LoadUint32(&img.bmap[off/blockSize]); e < discarded {
		r.Kind, r.File, r.Host, r.Raw = blockmap.Data, img.f, int64(img.h.OffsetData)+int64(e)*blockSize+in, img.static
	}
	return r, true, nil
}

// Info is qemu-img info's: the block size as cluster size, and no
// format-specific block (QEMU 7.2's vdi driver prints none).
func (img *Image) Info() formats.Info {
	return formats.Info{Format: "vdi", Filename: img.f.Name(), VirtualSize: img.size, ActualSize: img.ActualSize(),
		ClusterSize: blockSize, RequestAlignment: 1}
}

func (img *Image) Close() error { return img.f.Close() }
