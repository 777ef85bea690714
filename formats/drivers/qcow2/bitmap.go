package qcow2

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
)

// Persistent dirty bitmaps: the bitmaps header extension, the bitmap
// directory and the bitmap tables, as QEMU's docs/interop/qcow2.txt
// defines them and qcow2-bitmap.c checks them. The parser here is the one
// every open uses; what a writable open does with the bitmaps is in
// bitmapstore.go. The field limits are check_bitmaps.go's constants.

// Bitmap flags (BME_FLAG_IN_USE, BME_FLAG_AUTO).
const (
	bmFlagInUse = 1 << 0 // written to since it was last stored: not to be trusted
	bmFlagAuto  = 1 << 1 // enabled: every write must mark it
)

// bmMaxPhysBytes is QEMU's BME_MAX_PHYS_SIZE: the most bytes of data
// clusters one bitmap's table may address.
const bmMaxPhysBytes = 0x20000000

// bmTableOffsetMask is the host offset field of a bitmap table entry
// (BME_TABLE_ENTRY_OFFSET_MASK).
const bmTableOffsetMask = 0x00fffffffffffe00

// bitmapsExtension is the bitmaps header extension as parseHeader found it.
type bitmapsExtension struct {
	count     uint32
	dirSize   uint64
	dirOffset uint64
}

// bitmapEntry is one bitmap directory entry.
type bitmapEntry struct {
	name      string
	tableOff  int64
	tableSize int64 // entries
	flags     uint32
	granBits  uint8
	pos       int64 // where the entry starts in the directory
}

// bitmapBits is how many bits a bitmap with 2^granBits-byte granularity
// needs to cover size bytes, computed without overflow for any size.
func bitmapBits(size int64, granBits uint8) uint64 {
	if size <= 0 {
		return 0
	}
	return (uint64(size)-1)>>granBits + 1
}

// bitmapBytes is bitmapBits in bytes, as the data clusters store them.
func bitmapBytes(size int64, granBits uint8) uint64 {
	return (bitmapBits(size, granBits) + 7) / 8
}

// bitmapTableEntries is how many table entries (data clusters) a bitmap
// with 2^granBits-byte granularity needs for size bytes.
func bitmapTableEntries(size int64, granBits uint8, cs int64) uint64 {
	return (bitmapBytes(size, granBits) + uint64(cs) - 1) / uint64(cs)
}

// parseBitmapDirectory decodes and checks the directory dir, which the
// extension says holds count entries, for an image of size bytes with
// cs-byte clusters in a file of fileSize bytes: every check QEMU's
// bitmap_list_load and check_dir_entry make, and unique names.
func parseBitmapDirectory(dir []byte, count uint32, cs, size, fileSize int64) ([]bitmapEntry, error) {
	be := binary.BigEndian
	n := int64(len(dir))
	var entries []bitmapEntry
	names := map[string]bool{}
	p := int64(0)
	for p < n {
		if p+bmDirEntryLen > n {
			return nil, fmt.Errorf("%w: broken bitmap directory: entry at %#x is cut off by its end", ErrCorrupt, p)
		}
		e := dir[p:]
		nameLen, extraLen := int64(be.Uint16(e[18:])), int64(be.Uint32(e[20:]))
		next := p + (bmDirEntryLen+extraLen+nameLen+7)&^7
		if next > n {
			return nil, fmt.Errorf("%w: broken bitmap directory: entry at %#x runs past its end", ErrCorrupt, p)
		}
		if uint32(len(entries)) >= count {
			return nil, fmt.Errorf("%w: more bitmaps in the bitmap directory than the %d its header extension says", ErrCorrupt, count)
		}
		b := bitmapEntry{
			name:      string(e[bmDirEntryLen+extraLen : bmDirEntryLen+extraLen+nameLen]),
			tableOff:  int64(be.Uint64(e[0:])),
			tableSize: int64(be.Uint32(e[8:])),
			flags:     be.Uint32(e[12:]),
			granBits:  e[17],
			pos:       p,
		}
		if extraLen != 0 {
			return nil, fmt.Errorf("%w: bitmap %q has %d bytes of extra data", ErrUnsupported, b.name, extraLen)
		}
		if err := b.check(e[16], nameLen, cs, size, fileSize); err != nil {
			return nil, err
		}
		if names[b.name] {
			return nil, fmt.Errorf("%w: two bitmaps are named %q", ErrCorrupt, b.name)
		}
		names[b.name] = true
		entries = append(entries, b)
		p = next
	}
	if uint32(len(entries)) != count {
		return nil, fmt.Errorf("%w: %d bitmaps in the bitmap directory, its header extension says %d", ErrCorrupt, len(entries), count)
	}
	return entries, nil
}

// check validates one entry's fields (typ and nameLen are the fields the
// entry keeps no copy of).
func (b *bitmapEntry) check(typ uint8, nameLen, cs, size, fileSize int64) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: bitmap %q: %s", ErrCorrupt, b.name, fmt.Sprintf(format, args...))
	}
	switch {
	case typ != bmTypeDirty:
		return bad("type %d (only 1, dirty tracking, exists)", typ)
	case nameLen == 0:
		return bad("empty name")
	case nameLen > bmMaxNameSize:
		return bad("name of %d bytes (at most %d)", nameLen, bmMaxNameSize)
	case b.flags&bmReservedFlags != 0:
		return bad("reserved flags %#x set", b.flags&bmReservedFlags)
	case b.granBits < bmMinGranularity || b.granBits > bmMaxGranularity:
		return bad("granularity 2^%d (must be 2^%d to 2^%d bytes)", b.granBits, bmMinGranularity, bmMaxGranularity)
	case b.tableSize == 0:
		return bad("empty bitmap table")
	case b.tableSize > bmMaxTableEntries:
		return bad("bitmap table of %d entries (at most %d)", b.tableSize, bmMaxTableEntries)
	case b.tableSize*cs > bmMaxPhysBytes:
		return bad("bitmap table addresses %d bytes of data (at most %d)", b.tableSize*cs, bmMaxPhysBytes)
	case b.tableOff <= 0 || b.tableOff%cs != 0:
		return bad("bitmap table offset %#x is zero or not cluster-aligned", b.tableOff)
	case b.tableOff > fileSize || b.tableSize*8 > fileSize-b.tableOff:
		return bad("bitmap table at %#x (%d entries) lies beyond the end of the file", b.tableOff, b.tableSize)
	}
	// An in-use bitmap may have any size (stored before a resize it
	// missed); a consistent one has exactly the table the disk needs, as
	// QEMU's load_bitmap_data demands.
	if need := bitmapTableEntries(size, b.granBits, cs); b.flags&bmFlagInUse == 0 && need != uint64(b.tableSize) {
		return bad("bitmap table of %d entries, a %d-byte disk at granularity %d needs %d", b.tableSize, size, int64(1)<<b.granBits, need)
	}
	return nil
}

// readBitmapDirectory reads and parses the directory the extension names.
func (q *Image) readBitmapDirectory(ctx context.Context) ([]byte, []bitmapEntry, error) {
	x := q.h.bitmaps
	cs := q.h.clusterSize
	q.meta.RLock()
	fileSize := q.fileSize
	q.meta.RUnlock()
	switch {
	case x.dirSize == 0:
		return nil, nil, fmt.Errorf("%w: bitmap directory of zero bytes", ErrCorrupt)
	case x.dirOffset == 0 || x.dirOffset%uint64(cs) != 0:
		return nil, nil, fmt.Errorf("%w: bitmap directory offset %#x is zero or not cluster-aligned", ErrCorrupt, x.dirOffset)
	case x.dirOffset > uint64(fileSize) || x.dirSize > uint64(fileSize)-x.dirOffset:
		return nil, nil, fmt.Errorf("%w: bitmap directory at %#x (%d bytes) lies beyond the end of the file", ErrCorrupt, x.dirOffset, x.dirSize)
	}
	dir := make([]byte, x.dirSize) // at most maxBitmapDirectorySize, as parseHeader checked
	if _, err := q.f.ReadAt(ctx, dir, int64(x.dirOffset)); err != nil && err != io.EOF {
		return nil, nil, fmt.Errorf("qcow2: read bitmap directory at %#x: %w", x.dirOffset, err)
	}
	entries, err := parseBitmapDirectory(dir, x.count, cs, q.Size(), fileSize)
	if err != nil {
		return nil, nil, fmt.Errorf("bitmap directory at %#x: %w", x.dirOffset, err)
	}
	return dir, entries, nil
}

// bitmapsExtensionAt finds where the bitmaps extension's data lies in the
// header now, as the one naming the directory in use: it is not where
// the open found it once DropBacking removed an extension before it.
func (q *Image) bitmapsExtensionAt(ctx context.Context) (int64, error) {
	head := make([]byte, q.h.clusterSize)
	n, err := q.f.ReadAt(ctx, head, 0)
	if err != nil && err != io.EOF {
		return 0, fmt.Errorf("qcow2: read the header: %w", err)
	}
	head = head[:n]
	be := binary.BigEndian
	end := int64(len(head))
	if end < v3HeaderLen {
		return 0, fmt.Errorf("%w: the header is cut short", ErrCorrupt)
	}
	if bo := be.Uint64(head[hdrBackingOffset:]); bo != 0 && bo < uint64(end) {
		end = int64(bo) // extensions stop where the backing name starts
	}
	for p := int64(q.h.headerLength); p+8 <= end; {
		typ, l := be.Uint32(head[p:]), int64(be.Uint32(head[p+4:]))
		p += 8
		if typ == extEnd || l > end-p {
			break
		}
		if typ == extBitmaps && l >= 24 && be.Uint64(head[p+16:]) == q.h.bitmaps.dirOffset {
			return p, nil
		}
		p += (l + 7) &^ 7
	}
	return 0, fmt.Errorf("%w: the header no longer has the bitmaps extension naming the directory at %#x", ErrCorrupt, q.h.bitmaps.dirOffset)
}

// readBitmapTable reads and checks b's table (check_table_entry): an
// entry is 0 (a cluster of zeroes), 1 (of ones), or the offset of an
// aligned data cluster inside the file.
func (q *Image) readBitmapTable(ctx context.Context, b *bitmapEntry, fileSize int64) ([]uint64, error) {
	cs := q.h.clusterSize
	raw := make([]byte, b.tableSize*8)
	if _, err := q.f.ReadAt(ctx, raw, b.tableOff); err != nil && err != io.EOF {
		return nil, fmt.Errorf("qcow2: read the table of bitmap %q at %#x: %w", b.name, b.tableOff, err)
	}
	t := make([]uint64, b.tableSize)
	for i := range t {
		e := binary.BigEndian.Uint64(raw[i*8:])
		off := int64(e & bmTableOffsetMask)
		switch {
		case e&bmTableReserved != 0,
			off != 0 && e&bmTableAllOnes != 0,
			off%cs != 0,
			off != 0 && off > fileSize-cs:
			return nil, fmt.Errorf("%w: bitmap %q: table entry %d (%#x) is invalid or points beyond the end of the file", ErrCorrupt, b.name, i, e)
		}
		t[i] = e
	}
	return t, nil
}

// encodeBitmapDirectory is the directory for entries, laid out as
// parseBitmapDirectory reads it (no extra data, names padded to 8 bytes).
func encodeBitmapDirectory(entries []bitmapEntry) []byte {
	be := binary.BigEndian
	var dir []byte
	for i := range entries {
		b := &entries[i]
		b.pos = int64(len(dir))
		dir = be.AppendUint64(dir, uint64(b.tableOff))
		dir = be.AppendUint32(dir, uint32(b.tableSize))
		dir = be.AppendUint32(dir, b.flags)
		dir = append(dir, bmTypeDirty, b.granBits)
		dir = be.AppendUint16(dir, uint16(len(b.name)))
		dir = be.AppendUint32(dir, 0) // extra data
		dir = append(dir, b.name...)
		for len(dir)%8 != 0 {
			dir = append(dir, 0)
		}
	}
	return dir
}

// BitmapInfo is one bitmap in `qemu-img info --output=json`'s
// format-specific data.
type BitmapInfo struct {
	Flags       []string `json:"flags"`
	Name        string   `json:"name"`
	Granularity int64    `json:"granularity"`
}

// bitmapInfo lists the bitmaps as qemu-img info does. A directory that
// does not parse lists none: a read-only open does not need it, and the
// error says why (shown as one line).
func (q *Image) bitmapInfo(ctx context.Context) ([]BitmapInfo, error) {
	if !q.h.hasBitmaps {
		return nil, nil
	}
	_, entries, err := q.readBitmapDirectory(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]BitmapInfo, 0, len(entries))
	for _, b := range entries {
		flags := []string{}
		if b.flags&bmFlagInUse != 0 {
			flags = append(flags, "in-use")
		}
		if b.flags&bmFlagAuto != 0 {
			flags = append(flags, "auto")
		}
		out = append(out, BitmapInfo{Flags: flags, Name: b.name, Granularity: int64(1) << b.granBits})
	}
	return out, nil
}

// bitmapLines is bitmaps as qemu-img info's human output words them.
func bitmapLines(bitmaps []BitmapInfo) []string {
	lines := []string{"bitmaps:"}
	for i, b := range bitmaps {
		lines = append(lines, fmt.Sprintf("    [%d]:", i), "        flags:")
		for j, f := range b.Flags {
			lines = append(lines, fmt.Sprintf("            [%d]: %s", j, f))
		}
		lines = append(lines, "        name: "+b.Name, fmt.Sprintf("        granularity: %d", b.Granularity))
	}
	return lines
}
