package qcow2

import (
	"context"
	"encoding/binary"
	"fmt"

	"github.com/blockexport/blockexport/aio"
)

// The header cluster as amend rewrites it when the version changes, as
// QEMU's qcow2_update_header lays it out: the header (72 bytes for
// version 2, 112 for version 3), the extensions (the backing format, the
// feature name table for version 3 only, then every other extension as
// the image had it, the bitmaps one included), the end marker, and the
// backing file name. It is written in one write of the first cluster.

// v3HeaderWritten is the version 3 header length QEMU writes: the
// compression type byte, padded to 8.
const v3HeaderWritten = 112

// qemuFeatureNames is QEMU 7.2's feature name table: (type, bit, name).
var qemuFeatureNames = []struct {
	typ, bit uint8
	name     string
}{
	{0, 0, "dirty bit"},
	{0, 1, "corrupt bit"},
	{0, 2, "external data file"},
	{0, 3, "compression type"},
	{0, 4, "extended L2 entries"},
	{1, 0, "lazy refcounts"},
	{2, 0, "bitmaps"},
	{2, 1, "raw external data"},
}

type headerExtension struct {
	typ  uint32
	data []byte
}

// rawExtensions lists the header extensions in head as stored.
func rawExtensions(h *header, head []byte) []headerExtension {
	be := binary.BigEndian
	end := min(int64(len(head)), h.clusterSize)
	if h.backingOffset != 0 && int64(h.backingOffset) < end {
		end = int64(h.backingOffset)
	}
	var out []headerExtension
	for off := int64(h.headerLength); off+8 <= end; {
		typ, n := be.Uint32(head[off:]), int64(be.Uint32(head[off+4:]))
		off += 8
		if typ == extEnd || n > end-off {
			break
		}
		out = append(out, headerExtension{typ, head[off : off+n]})
		off += (n + 7) &^ 7
	}
	return out
}

// encodeHeaderCluster builds the first cluster of an image whose header
// is h (version, feature bits, refcount order and compression type as
// they are to be) from head, the cluster as it is now.
func encodeHeaderCluster(h *header, head []byte) ([]byte, error) {
	be := binary.BigEndian
	cs := h.clusterSize
	out := make([]byte, cs)
	copy(out, head[:v2HeaderLen])
	be.PutUint32(out[hdrVersion:], h.version)
	off := int64(v2HeaderLen)
	if h.version >= 3 {
		hl := int64(v3HeaderWritten)
		if int64(h.headerLength) > hl {
			// Fields of a later QEMU: kept as they are.
			hl = int64(h.headerLength)
			copy(out[v3HeaderLen:hl], head[v3HeaderLen:hl])
		}
		be.PutUint64(out[hdrIncompatible:], h.incompatible)
		be.PutUint64(out[hdrCompatible:], h.compatible)
		be.PutUint64(out[hdrAutoclear:], h.autoclear)
		be.PutUint32(out[hdrRefcountOrder:], h.refcountOrder)
		be.PutUint32(out[hdrHeaderLength:], uint32(hl))
		out[hdrCompressionType] = h.compressionType
		off = hl
	}
	exts := rawExtensions(h, head)
	var ordered []headerExtension
	for _, e := range exts {
		if e.typ == extBackingFmt {
			ordered = append(ordered, e)
		}
	}
	if h.version >= 3 {
		table := make([]byte, 0, 48*len(qemuFeatureNames))
		for _, f := range qemuFeatureNames {
			var ent [48]byte
			ent[0], ent[1] = f.typ, f.bit
			copy(ent[2:], f.name)
			table = append(table, ent[:]...)
		}
		ordered = append(ordered, headerExtension{extFeatureNames, table})
	}
	for _, e := range exts {
		if e.typ != extBackingFmt && e.typ != extFeatureNames {
			ordered = append(ordered, e)
		}
	}
	for _, e := range ordered {
		n := int64(len(e.data))
		if off+8+(n+7)&^7 > cs {
			return nil, fmt.Errorf("%w: the header extensions do not fit in one cluster", ErrUnsupported)
		}
		be.PutUint32(out[off:], e.typ)
		be.PutUint32(out[off+4:], uint32(n))
		copy(out[off+8:], e.data)
		off += 8 + (n+7)&^7
	}
	off += 8 // the end marker: zeroes
	name := h.backingFile
	if off+int64(len(name)) > cs {
		return nil, fmt.Errorf("%w: the backing file name does not fit in the header cluster", ErrUnsupported)
	}
	if name != "" {
		copy(out[off:], name)
		be.PutUint64(out[hdrBackingOffset:], uint64(off))
		be.PutUint32(out[hdrBackingSize:], uint32(len(name)))
	} else {
		be.PutUint64(out[hdrBackingOffset:], 0)
		be.PutUint32(out[hdrBackingSize:], 0)
	}
	return out, nil
}

// rewriteHeader writes h as the header cluster of f, in one write, and
// makes it durable.
func rewriteHeader(ctx context.Context, f aio.File, h *header, head []byte) error {
	out, err := encodeHeaderCluster(h, head)
	if err != nil {
		return err
	}
	if _, err := f.WriteAt(ctx, out, 0); err != nil {
		return fmt.Errorf("qcow2: write the header: %w", err)
	}
	if err := f.Fdatasync(ctx); err != nil {
		return fmt.Errorf("qcow2: write the header: %w", err)
	}
	return nil
}
