package qcow2

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
)

// The on-disk header, as docs/interop/qcow2.txt in QEMU defines it. All
// fields are big-endian.

var magic = [4]byte{'Q', 'F', 'I', 0xfb}

// Header fields by byte offset (QEMU's docs/interop/qcow2.txt). Writes
// of single fields (flush.go, alloc.go, overlap.go) use these names too.
const (
	hdrVersion          = 4
	hdrBackingOffset    = 8
	hdrBackingSize      = 16
	hdrClusterBits      = 20
	hdrSize             = 24 // followed by crypt method, L1 size, L1 offset
	hdrCryptMethod      = 32
	hdrL1Size           = 36
	hdrL1Offset         = 40
	hdrRefcountOffset   = 48 // followed by refcount table clusters
	hdrRefcountClusters = 56
	hdrNbSnapshots      = 60
	hdrSnapshotsOffset  = 64
	// Version 3 only:
	hdrIncompatible    = 72
	hdrCompatible      = 80
	hdrAutoclear       = 88
	hdrRefcountOrder   = 96
	hdrHeaderLength    = 100
	hdrCompressionType = 104
)

const (
	v2HeaderLen = 72
	v3HeaderLen = 104

	minClusterBits = 9
	maxClusterBits = 21

	// maxL1Bytes is QEMU's QCOW_MAX_L1_SIZE: a larger L1 is refused.
	maxL1Bytes = 32 << 20
	// maxVirtualSize is QEMU's QCOW_MAX_VIRTUAL_SIZE... bounded by what the
	// L1 limit can map, checked below; this is an outer sanity bound.
	maxVirtualSize = 1 << 61

	maxBackingNameLen = 1023
)

// Incompatible feature bits.
const (
	incDirty          = 1 << 0
	incCorrupt        = 1 << 1
	incExternalData   = 1 << 2
	incCompressionTyp = 1 << 3
	incExtendedL2     = 1 << 4
	incKnown          = incDirty | incCorrupt | incExternalData | incCompressionTyp | incExtendedL2
)

// Compatible feature bits.
const compatLazyRefcounts = 1 << 0

// Header extension types.
const (
	extEnd          = 0x00000000
	extBackingFmt   = 0xe2792aca
	extFeatureNames = 0x6803f857
	extBitmaps      = 0x23852875
	extCrypto       = 0x0537be77
	extDataFile     = 0x44415441
)

// Compression types.
const (
	compressionZlib = 0
	compressionZstd = 1
)

// ErrUnsupported marks images that use a feature this driver does not
// implement; the message names the feature.
var ErrUnsupported = errors.New("qcow2: unsupported feature")

// ErrCorrupt marks images whose metadata is inconsistent.
var ErrCorrupt = errors.New("qcow2: corrupt image")

// ErrNotQCOW2 marks a file that is no qcow2 image at all (opened as qcow2
// because the user said so): nothing in it is damaged, so it is not
// ErrCorrupt (qemu-img: "Image is not in qcow2 format").
var ErrNotQCOW2 = errors.New("not a qcow2 image")

// header is the parsed, validated header.
type header struct {
	version          uint32
	backingOffset    uint64
	backingSize      uint32
	clusterBits      uint32
	size             uint64
	cryptMethod      uint32
	l1Size           uint32
	l1Offset         uint64
	refcountOffset   uint64
	refcountClusters uint32
	nbSnapshots      uint32
	snapshotsOffset  uint64
	incompatible     uint64
	compatible       uint64
	autoclear        uint64
	refcountOrder    uint32
	headerLength     uint32
	compressionType  uint8
	backingFile      string
	backingFormat    string
	featureNames     map[[2]uint8]string // (type, bit) -> name
	hasBitmaps       bool
	bitmaps          bitmapsExtension // the bitmaps extension, when hasBitmaps
	clusterSize      int64
	l2Entries        int64 // entries per L2 table
}

// parseHeader decodes and validates the header in buf (the first cluster
// of the file, or as much of it as exists). fileSize bounds every offset.
func parseHeader(buf []byte, fileSize int64) (*header, error) {
	if len(buf) < len(magic) || [4]byte(buf[0:4]) != magic {
		return nil, fmt.Errorf("%w (it does not start with the qcow2 magic, QFI\\xfb)", ErrNotQCOW2)
	}
	if len(buf) < v2HeaderLen {
		return nil, fmt.Errorf("%w: file too short for a header (%d bytes)", ErrCorrupt, len(buf))
	}
	be := binary.BigEndian
	h := &header{
		version:          be.Uint32(buf[hdrVersion:]),
		backingOffset:    be.Uint64(buf[hdrBackingOffset:]),
		backingSize:      be.Uint32(buf[hdrBackingSize:]),
		clusterBits:      be.Uint32(buf[hdrClusterBits:]),
		size:             be.Uint64(buf[hdrSize:]),
		cryptMethod:      be.Uint32(buf[hdrCryptMethod:]),
		l1Size:           be.Uint32(buf[hdrL1Size:]),
		l1Offset:         be.Uint64(buf[hdrL1Offset:]),
		refcountOffset:   be.Uint64(buf[hdrRefcountOffset:]),
		refcountClusters: be.Uint32(buf[hdrRefcountClusters:]),
		nbSnapshots:      be.Uint32(buf[hdrNbSnapshots:]),
		snapshotsOffset:  be.Uint64(buf[hdrSnapshotsOffset:]),
		refcountOrder:    4,
		headerLength:     v2HeaderLen,
	}
	switch h.version {
	case 2:
	case 3:
		if len(buf) < v3HeaderLen {
			return nil, fmt.Errorf("%w: file too short for a version 3 header", ErrCorrupt)
		}
		h.incompatible = be.Uint64(buf[hdrIncompatible:])
		h.compatible = be.Uint64(buf[hdrCompatible:])
		h.autoclear = be.Uint64(buf[hdrAutoclear:])
		h.refcountOrder = be.Uint32(buf[hdrRefcountOrder:])
		h.headerLength = be.Uint32(buf[hdrHeaderLength:])
		if h.headerLength < v3HeaderLen || h.headerLength%8 != 0 {
			return nil, fmt.Errorf("%w: header length %d", ErrCorrupt, h.headerLength)
		}
		if h.headerLength > v3HeaderLen {
			if int(h.headerLength) > len(buf) {
				return nil, fmt.Errorf("%w: header length %d beyond the first cluster", ErrCorrupt, h.headerLength)
			}
			h.compressionType = buf[hdrCompressionType]
		}
	default:
		return nil, fmt.Errorf("%w: version %d (only 2 and 3 exist)", ErrUnsupported, h.version)
	}
	if h.clusterBits < minClusterBits || h.clusterBits > maxClusterBits {
		return nil, fmt.Errorf("%w: cluster size 2^%d (must be 512 B to 2 MiB)", ErrCorrupt, h.clusterBits)
	}
	h.clusterSize = 1 << h.clusterBits
	h.l2Entries = h.clusterSize / 8
	if int64(h.headerLength) > h.clusterSize {
		return nil, fmt.Errorf("%w: header length %d larger than a cluster", ErrCorrupt, h.headerLength)
	}
	if h.refcountOrder > 6 {
		return nil, fmt.Errorf("%w: refcount order %d", ErrCorrupt, h.refcountOrder)
	}
	if h.size > maxVirtualSize {
		return nil, fmt.Errorf("%w: virtual size %d is absurd", ErrCorrupt, h.size)
	}
	// QEMU counts the size in 512-byte sectors and drops a partial one:
	// a stored 67108764 is a 67108352-byte disk there, so here too.
	h.size &^= 511
	if uint64(h.refcountClusters)*uint64(h.clusterSize) > maxRefTableBytes {
		return nil, fmt.Errorf("%w: refcount table of %d clusters is too large (QEMU's limit is %d MiB)", ErrCorrupt, h.refcountClusters, maxRefTableBytes>>20)
	}
	if h.nbSnapshots > maxSnapshots {
		return nil, fmt.Errorf("%w: %d snapshots (at most %d)", ErrCorrupt, h.nbSnapshots, maxSnapshots)
	}
	if h.cryptMethod != 0 {
		return nil, fmt.Errorf("%w: encryption (method %d)", ErrUnsupported, h.cryptMethod)
	}
	if err := h.checkL1(fileSize); err != nil {
		return nil, err
	}
	if off, n := h.refcountOffset, uint64(h.refcountClusters)*uint64(h.clusterSize); n > 0 &&
		(off%uint64(h.clusterSize) != 0 || off > uint64(fileSize) || n > uint64(fileSize)-off) {
		return nil, fmt.Errorf("%w: refcount table at %#x (%d clusters) is misaligned or lies beyond the end of the file", ErrCorrupt, off, h.refcountClusters)
	}
	if err := h.readExtensions(buf); err != nil {
		return nil, err
	}
	if unknown := h.incompatible &^ incKnown; unknown != 0 {
		return nil, fmt.Errorf("%w: unknown incompatible features %s", ErrUnsupported, h.describeBits(0, unknown))
	}
	if h.incompatible&incExternalData != 0 {
		return nil, fmt.Errorf("%w: external data file", ErrUnsupported)
	}
	if h.incompatible&incExtendedL2 != 0 {
		return nil, fmt.Errorf("%w: extended L2 entries (subclusters)", ErrUnsupported)
	}
	switch h.compressionType {
	case compressionZlib, compressionZstd:
	default:
		return nil, fmt.Errorf("%w: compression type %d", ErrUnsupported, h.compressionType)
	}
	if (h.compressionType != compressionZlib) != (h.incompatible&incCompressionTyp != 0) {
		return nil, fmt.Errorf("%w: compression type %d disagrees with the compression feature bit", ErrCorrupt, h.compressionType)
	}
	if err := h.readBackingName(buf, fileSize); err != nil {
		return nil, err
	}
	return h, nil
}

// checkL1 makes sure the L1 table maps the whole virtual size, is not
// absurdly large, and lies inside the file.
func (h *header) checkL1(fileSize int64) error {
	perL1 := uint64(h.clusterSize) * uint64(h.l2Entries) // bytes one L1 entry maps
	need := (h.size + perL1 - 1) / perL1
	if uint64(h.l1Size) < need {
		return fmt.Errorf("%w: L1 table has %d entries, the virtual size needs %d", ErrCorrupt, h.l1Size, need)
	}
	if uint64(h.l1Size)*8 > maxL1Bytes {
		return fmt.Errorf("%w: L1 table of %d entries is too large", ErrCorrupt, h.l1Size)
	}
	if h.l1Size == 0 {
		return nil
	}
	if h.l1Offset%uint64(h.clusterSize) != 0 {
		return fmt.Errorf("%w: L1 table offset %#x is not cluster-aligned", ErrCorrupt, h.l1Offset)
	}
	if h.l1Offset > uint64(fileSize) || uint64(h.l1Size)*8 > uint64(fileSize)-h.l1Offset {
		return fmt.Errorf("%w: L1 table at %#x (%d entries) lies beyond the end of the file", ErrCorrupt, h.l1Offset, h.l1Size)
	}
	return nil
}

// readExtensions walks the header extensions that follow the header in the
// first cluster.
func (h *header) readExtensions(buf []byte) error {
	be := binary.BigEndian
	end := min(int64(len(buf)), h.clusterSize)
	if h.backingOffset != 0 && int64(h.backingOffset) < end {
		end = int64(h.backingOffset) // extensions stop where the backing name starts
	}
	off := int64(h.headerLength)
	for off+8 <= end {
		typ := be.Uint32(buf[off:])
		length := int64(be.Uint32(buf[off+4:]))
		off += 8
		if typ == extEnd {
			return nil
		}
		if length > end-off {
			return fmt.Errorf("%w: header extension %#x of %d bytes overruns the header cluster", ErrCorrupt, typ, length)
		}
		data := buf[off : off+length]
		switch typ {
		case extBackingFmt:
			h.backingFormat = strings.TrimRight(string(data), "\x00")
		case extFeatureNames:
			h.featureNames = map[[2]uint8]string{}
			for i := 0; i+48 <= len(data); i += 48 {
				name := strings.TrimRight(string(data[i+2:i+48]), "\x00")
				h.featureNames[[2]uint8{data[i], data[i+1]}] = name
			}
		case extBitmaps:
			if err := h.checkBitmaps(data); err != nil {
				return err
			}
		case extCrypto:
			return fmt.Errorf("%w: encryption (LUKS header extension)", ErrUnsupported)
		case extDataFile:
			return fmt.Errorf("%w: external data file %q", ErrUnsupported, strings.TrimRight(string(data), "\x00"))
		}
		off += (length + 7) &^ 7
	}
	return nil
}

// Bounds of the bitmaps extension, QEMU's QCOW2_MAX_BITMAPS and
// QCOW2_MAX_BITMAP_DIRECTORY_SIZE.
const (
	maxBitmaps             = 65535
	maxBitmapDirectorySize = 1024 * maxBitmaps
)

// autoclearBitmaps is the autoclear bit that says the bitmaps extension
// is consistent with the image.
const autoclearBitmaps = 1 << 0

// checkBitmaps validates the bitmaps extension as QEMU does at open. An
// extension whose autoclear bit is clear is stale and ignored, as there.
func (h *header) checkBitmaps(data []byte) error {
	if h.autoclear&autoclearBitmaps == 0 {
		return nil
	}
	if len(data) < 24 {
		return fmt.Errorf("%w: bitmaps extension of %d bytes (want 24)", ErrCorrupt, len(data))
	}
	be := binary.BigEndian
	nb, reserved := be.Uint32(data[0:]), be.Uint32(data[4:])
	dirSize, dirOffset := be.Uint64(data[8:]), be.Uint64(data[16:])
	switch {
	case reserved != 0:
		return fmt.Errorf("%w: bitmaps extension: reserved field is %#x", ErrCorrupt, reserved)
	case nb == 0:
		return fmt.Errorf("%w: bitmaps extension lists no bitmaps", ErrCorrupt)
	case nb > maxBitmaps:
		return fmt.Errorf("%w: %d bitmaps (at most %d)", ErrCorrupt, nb, maxBitmaps)
	case dirSize > maxBitmapDirectorySize:
		return fmt.Errorf("%w: bitmap directory of %d bytes is too large (at most %d)", ErrCorrupt, dirSize, maxBitmapDirectorySize)
	case dirOffset%uint64(h.clusterSize) != 0:
		return fmt.Errorf("%w: bitmap directory offset %#x is not cluster-aligned", ErrCorrupt, dirOffset)
	}
	h.hasBitmaps = true
	h.bitmaps = bitmapsExtension{count: nb, dirSize: dirSize, dirOffset: dirOffset}
	return nil
}

func (h *header) readBackingName(buf []byte, fileSize int64) error {
	if h.backingOffset == 0 {
		return nil
	}
	if h.backingSize == 0 || h.backingSize > maxBackingNameLen {
		return fmt.Errorf("%w: backing file name of %d bytes", ErrCorrupt, h.backingSize)
	}
	end := h.backingOffset + uint64(h.backingSize)
	if end > uint64(len(buf)) || end > uint64(fileSize) {
		return fmt.Errorf("%w: backing file name at %#x lies outside the header cluster", ErrCorrupt, h.backingOffset)
	}
	h.backingFile = string(buf[h.backingOffset:end])
	return nil
}

// describeBits names the set bits of a feature field (type 0 incompatible,
// 1 compatible, 2 autoclear), using the image's feature name table.
func (h *header) describeBits(typ uint8, bits uint64) string {
	var names []string
	for b := uint8(0); b < 64; b++ {
		if bits&(1<<b) == 0 {
			continue
		}
		if n, ok := h.featureNames[[2]uint8{typ, b}]; ok && n != "" {
			names = append(names, fmt.Sprintf("%q (bit %d)", n, b))
		} else {
			names = append(names, fmt.Sprintf("bit %d", b))
		}
	}
	return strings.Join(names, ", ")
}
