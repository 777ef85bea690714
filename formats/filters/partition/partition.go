// Package partition finds the partitions of a disk image (MBR, with
// logical partitions through the EBR chain, and GPT) and serves each as a
// [formats.Image] of its own: a byte range of the disk.
//
// Partitions are numbered as Linux numbers them (block/partitions/msdos.c
// and efi.c), so that NAME-pN here is /dev/loop0pN under `losetup -P`. The
// sector size is 512, the logical block size our exports declare; a GPT
// found only at 4096-byte sectors (a 4Kn disk's image) is read with those.
//
// A table is trusted only as far as it is checked, as the kernel checks
// it: partitions inside the image and not overlapping, EBR chains that
// neither loop nor leave their extended partition, GPT CRCs (the backup
// header when the primary fails). Anything else is refused with one line.
package partition

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"sort"
	"unicode/utf16"
)

// Errors callers branch on with [errors.Is].
var (
	// ErrNoTable: the image has no partition table we read (no MBR
	// signature, or sector 0 is not a partition table).
	ErrNoTable = errors.New("no partition table")
	// ErrCorrupt: the table is there but does not hold together.
	ErrCorrupt = errors.New("corrupt partition table")
)

// Limits, as the kernel bounds what it reads.
const (
	// maxPartitions is DISK_MAX_PARTS (include/linux/blkdev.h): the kernel
	// numbers no partition above it.
	maxPartitions = 256
	// maxEBRs bounds an EBR chain: the kernel stops after 100 links
	// (msdos.c, loopct); a longer chain is refused here.
	maxEBRs = 100
	// maxEntryArray bounds a GPT entry array as the kernel's kmalloc
	// bound does (KMALLOC_MAX_SIZE with 4 KiB pages: 4 MiB).
	maxEntryArray = 4 << 20
	gptEntrySize  = 128 // the kernel accepts no other sizeof_partition_entry
	gptHeaderMin  = 92
)

// Scheme is the kind of partition table.
type Scheme string

const (
	MBR Scheme = "mbr"
	GPT Scheme = "gpt"
)

// Partition is one partition: a byte range of the disk.
type Partition struct {
	// Number is the kernel's: pN of the disk.
	Number int
	// Start and Size are in bytes.
	Start, Size int64
	// Type is the MBR type byte ("0x83") or the GPT type GUID.
	Type string
	// Name is the GPT partition name (empty for MBR).
	Name string
	// Logical: an MBR logical partition (inside the extended one).
	Logical bool
}

// Table is a disk's partition table.
type Table struct {
	Scheme     Scheme
	SectorSize int
	// Partitions in number order.
	Partitions []Partition
	// BackupUsed: the primary GPT was damaged and the backup was read.
	BackupUsed bool
}

// Find returns partition n, or an error naming the numbers there are.
func (t *Table) Find(n int) (Partition, error) {
	var nums []int
	for _, p := range t.Partitions {
		if p.Number == n {
			return p, nil
		}
		nums = append(nums, p.Number)
	}
	return Partition{}, fmt.Errorf("partition %d: the %s table has no such partition (it has %v)", n, t.Scheme, nums)
}

// Reader is what Parse reads from: a formats.Image is one.
type Reader interface {
	ReadAt(ctx context.Context, p []byte, off int64) (int, error)
	Size() int64
}

// Parse reads the partition table of r.
func Parse(ctx context.Context, r Reader) (*Table, error) {
	size := r.Size()
	if size < 512 {
		return nil, fmt.Errorf("partition: the image is %d bytes, smaller than one sector: %w", size, ErrNoTable)
	}
	mbr := make([]byte, 512)
	if err := readFull(ctx, r, mbr, 0); err != nil {
		return nil, fmt.Errorf("partition: reading the MBR: %w", err)
	}
	if mbr[510] != 0x55 || mbr[511] != 0xaa {
		return nil, fmt.Errorf("partition: sector 0 has no MBR signature (0x55aa): %w", ErrNoTable)
	}
	entries := mbrEntries(mbr)
	for i, e := range entries {
		// The kernel takes a sector with any other boot flag for a boot
		// sector (a FAT file system), not a partition table.
		if e.boot != 0 && e.boot != 0x80 {
			return nil, fmt.Errorf("partition: MBR entry %d has boot flag %#x (want 0 or 0x80): sector 0 is not a partition table: %w", i+1, e.boot, ErrNoTable)
		}
	}
	for _, e := range entries {
		if e.typ == 0xee {
			return parseGPT(ctx, r)
		}
	}
	return parseMBR(ctx, r, entries)
}

type mbrEntry struct {
	boot, typ   byte
	start, size uint32 // in sectors; start relative to the table's base
}

func mbrEntries(sector []byte) [4]mbrEntry {
	var es [4]mbrEntry
	for i := range es {
		b := sector[446+16*i:]
		es[i] = mbrEntry{boot: b[0], typ: b[4],
			start: binary.LittleEndian.Uint32(b[8:]), size: binary.LittleEndian.Uint32(b[12:])}
	}
	return es
}

// isExtended: DOS (0x05), Win98 LBA (0x0f) and Linux (0x85) extended.
func isExtended(typ byte) bool { return typ == 0x05 || typ == 0x0f || typ == 0x85 }

func parseMBR(ctx context.Context, r Reader, entries [4]mbrEntry) (*Table, error) {
	const ss = 512
	size := r.Size()
	t := &Table{Scheme: MBR, SectorSize: ss}
	var extended []Partition // for the overlap check against primaries
	for i, e := range entries {
		if e.size == 0 {
			// An unused slot. The kernel goes by the size alone: an
			// entry of type 0 with a size is a partition to it, so it is
			// one here.
			continue
		}
		p := Partition{Number: i + 1, Start: int64(e.start) * ss, Size: int64(e.size) * ss, Type: fmt.Sprintf("%#02x", e.typ)}
		if e.start == 0 {
			return nil, fmt.Errorf("partition: MBR partition %d starts at sector 0, the MBR itself: %w", p.Number, ErrCorrupt)
		}
		if p.Start+p.Size > size {
			return nil, fmt.Errorf("partition: MBR partition %d (sectors %d+%d) runs past the end of the image (%d sectors): %w",
				p.Number, e.start, e.size, size/ss, ErrCorrupt)
		}
		if isExtended(e.typ) {
			extended = append(extended, p)
			continue
		}
		t.Partitions = append(t.Partitions, p)
	}
	next := 5
	for _, ext := range extended {
		logical, err := parseEBRChain(ctx, r, ext, &next)
		if err != nil {
			return nil, err
		}
		t.Partitions = append(t.Partitions, logical...)
	}
	// Primaries and extended containers must not overlap one another;
	// logical partitions must not overlap each other (they lie inside
	// their container by construction).
	outer, logical := append([]Partition(nil), extended...), []Partition(nil)
	for _, p := range t.Partitions {
		if p.Logical {
			logical = append(logical, p)
		} else {
			outer = append(outer, p)
		}
	}
	if err := checkOverlaps(outer); err != nil {
		return nil, err
	}
	if err := checkOverlaps(logical); err != nil {
		return nil, err
	}
	return t, nil
}

// parseEBRChain walks the extended partition ext's chain of EBRs as the
// kernel's parse_extended does: data entries are relative to their EBR,
// link entries to the start of the extended partition. Logical partitions
// are numbered from *next on.
func parseEBRChain(ctx context.Context, r Reader, ext Partition, next *int) ([]Partition, error) {
	const ss = 512
	var out []Partition
	seen := map[int64]bool{}
	base := ext.Start / ss
	ebr, ebrSize := base, ext.Size/ss // the current EBR and the extent it describes
	sector := make([]byte, ss)
	for links := 0; ; links++ {
		if links >= maxEBRs {
			return nil, fmt.Errorf("partition: the EBR chain of partition %d has more than %d links: %w", ext.Number, maxEBRs, ErrCorrupt)
		}
		if seen[ebr] {
			return nil, fmt.Errorf("partition: the EBR chain of partition %d loops back to sector %d: %w", ext.Number, ebr, ErrCorrupt)
		}
		seen[ebr] = true
		if ebr*ss+ss > r.Size() {
			return nil, fmt.Errorf("partition: an EBR of partition %d at sector %d is past the end of the image: %w", ext.Number, ebr, ErrCorrupt)
		}
		if err := readFull(ctx, r, sector, ebr*ss); err != nil {
			return nil, fmt.Errorf("partition: reading the EBR at sector %d: %w", ebr, err)
		}
		if sector[510] != 0x55 || sector[511] != 0xaa {
			// The kernel ends the chain here without a word; an EBR that
			// the chain names but that is not one is a broken table.
			return nil, fmt.Errorf("partition: the EBR at sector %d (partition %d's chain) has no 0x55aa signature: %w", ebr, ext.Number, ErrCorrupt)
		}
		es := mbrEntries(sector)
		for i, e := range es {
			if e.size == 0 || isExtended(e.typ) {
				continue
			}
			if e.boot != 0 && e.boot != 0x80 {
				return nil, fmt.Errorf("partition: the EBR at sector %d has boot flag %#x in entry %d: %w", ebr, e.boot, i+1, ErrCorrupt)
			}
			start := ebr + int64(e.start)
			if i >= 2 && int64(e.start)+int64(e.size) > ebrSize {
				continue // the kernel ignores such entries in slots 3 and 4
			}
			if e.start == 0 {
				return nil, fmt.Errorf("partition: a logical partition in the EBR at sector %d starts on the EBR itself: %w", ebr, ErrCorrupt)
			}
			if start+int64(e.size) > base+ext.Size/ss {
				return nil, fmt.Errorf("partition: logical partition %d (sectors %d+%d) runs past its extended partition %d (ends at sector %d): %w",
					*next, start, e.size, ext.Number, base+ext.Size/ss, ErrCorrupt)
			}
			if *next > maxPartitions {
				return nil, fmt.Errorf("partition: more than %d partitions: %w", maxPartitions, ErrCorrupt)
			}
			out = append(out, Partition{Number: *next, Start: start * ss, Size: int64(e.size) * ss,
				Type: fmt.Sprintf("%#02x", e.typ), Logical: true})
			*next++
		}
		link := -1
		for i, e := range es {
			if e.size != 0 && isExtended(e.typ) {
				link = i
				break
			}
		}
		if link < 0 {
			return out, nil
		}
		e := es[link]
		nextEBR := base + int64(e.start)
		if nextEBR+int64(e.size) > base+ext.Size/ss || e.start == 0 {
			return nil, fmt.Errorf("partition: the EBR at sector %d links to sectors %d+%d, outside its extended partition %d: %w",
				ebr, nextEBR, e.size, ext.Number, ErrCorrupt)
		}
		ebr, ebrSize = nextEBR, int64(e.size)
	}
}

// checkOverlaps refuses two partitions that share a byte.
func checkOverlaps(ps []Partition) error {
	s := append([]Partition(nil), ps...)
	sort.Slice(s, func(i, j int) bool { return s[i].Start < s[j].Start })
	for i := 1; i < len(s); i++ {
		if s[i].Start < s[i-1].Start+s[i-1].Size {
			return fmt.Errorf("partition: partitions %d and %d overlap: %w", s[i-1].Number, s[i].Number, ErrCorrupt)
		}
	}
	return nil
}

// gptHeader is the part of a GPT header we use (UEFI 2.x, 5.3.2).
type gptHeader struct {
	myLBA, altLBA              uint64
	firstUsable, lastUsable    uint64
	entriesLBA                 uint64
	numEntries, entrySize, crc uint32
}

var gptSignature = []byte("EFI PART")

func parseGPT(ctx context.Context, r Reader) (*Table, error) {
	size := r.Size()
	var errs []string
	for _, ss := range []int64{512, 4096} {
		if size < 3*ss {
			continue
		}
		sig := make([]byte, 8)
		if err := readFull(ctx, r, sig, ss); err != nil {
			return nil, fmt.Errorf("partition: reading the GPT header: %w", err)
		}
		last := uint64(size/ss - 1)
		primaryHasSig := bytes.Equal(sig, gptSignature)
		if !primaryHasSig && ss == 4096 {
			break // nothing says the disk has 4 KiB sectors
		}
		h, ents, err := readGPT(ctx, r, ss, 1, last)
		if err == nil {
			return gptTable(h, ents, ss, false, size)
		}
		primaryErr := err
		// The kernel and parted fall back on the backup at the last LBA.
		h, ents, err = readGPT(ctx, r, ss, last, last)
		if err == nil {
			return gptTable(h, ents, ss, true, size)
		}
		errs = append(errs, fmt.Sprintf("at %d-byte sectors: primary: %v; backup: %v", ss, primaryErr, err))
		if primaryHasSig {
			break
		}
	}
	if len(errs) == 0 {
		return nil, fmt.Errorf("partition: a protective MBR, but the image is too small for a GPT: %w", ErrCorrupt)
	}
	return nil, fmt.Errorf("partition: a protective MBR, but no valid GPT header (%s): %w", errs[0], ErrCorrupt)
}

// readGPT reads and checks the header at lba and its entry array, as the
// kernel's is_gpt_valid checks them.
func readGPT(ctx context.Context, r Reader, ss int64, lba, last uint64) (gptHeader, []byte, error) {
	buf := make([]byte, ss)
	if err := readFull(ctx, r, buf, int64(lba)*ss); err != nil {
		return gptHeader{}, nil, fmt.Errorf("reading LBA %d: %w", lba, err)
	}
	if !bytes.Equal(buf[:8], gptSignature) {
		return gptHeader{}, nil, fmt.Errorf("no \"EFI PART\" signature at LBA %d", lba)
	}
	le := binary.LittleEndian
	hsize := le.Uint32(buf[12:])
	if hsize < gptHeaderMin || int64(hsize) > ss {
		return gptHeader{}, nil, fmt.Errorf("header size %d (want %d to %d)", hsize, gptHeaderMin, ss)
	}
	stored := le.Uint32(buf[16:])
	hdr := append([]byte(nil), buf[:hsize]...)
	le.PutUint32(hdr[16:], 0)
	if got := crc32.ChecksumIEEE(hdr); got != stored {
		return gptHeader{}, nil, fmt.Errorf("header CRC32 %#08x, stored %#08x", got, stored)
	}
	h := gptHeader{myLBA: le.Uint64(buf[24:]), altLBA: le.Uint64(buf[32:]),
		firstUsable: le.Uint64(buf[40:]), lastUsable: le.Uint64(buf[48:]),
		entriesLBA: le.Uint64(buf[72:]), numEntries: le.Uint32(buf[80:]), entrySize: le.Uint32(buf[84:]), crc: le.Uint32(buf[88:])}
	switch {
	case h.myLBA != lba:
		return h, nil, fmt.Errorf("header says it is at LBA %d, read at %d", h.myLBA, lba)
	case h.firstUsable > last || h.lastUsable > last:
		return h, nil, fmt.Errorf("usable LBAs %d-%d past the last LBA %d", h.firstUsable, h.lastUsable, last)
	case h.lastUsable < h.firstUsable:
		return h, nil, fmt.Errorf("last usable LBA %d before the first %d", h.lastUsable, h.firstUsable)
	case h.entrySize != gptEntrySize:
		return h, nil, fmt.Errorf("entry size %d (want %d)", h.entrySize, gptEntrySize)
	case h.numEntries == 0:
		return h, nil, fmt.Errorf("no partition entries")
	case uint64(h.numEntries)*gptEntrySize > maxEntryArray:
		return h, nil, fmt.Errorf("%d partition entries: more than the kernel reads (%d bytes)", h.numEntries, maxEntryArray)
	case h.entriesLBA == 0 || h.entriesLBA > last:
		return h, nil, fmt.Errorf("entry array at LBA %d, outside the disk (last LBA %d)", h.entriesLBA, last)
	}
	arrayBytes := int64(h.numEntries) * gptEntrySize
	if int64(h.entriesLBA)*ss+arrayBytes > r.Size() {
		return h, nil, fmt.Errorf("entry array (LBA %d, %d bytes) runs past the end of the image", h.entriesLBA, arrayBytes)
	}
	ents := make([]byte, arrayBytes)
	if err := readFull(ctx, r, ents, int64(h.entriesLBA)*ss); err != nil {
		return h, nil, fmt.Errorf("reading the entry array: %w", err)
	}
	if got := crc32.ChecksumIEEE(ents); got != h.crc {
		return h, nil, fmt.Errorf("entry array CRC32 %#08x, stored %#08x", got, h.crc)
	}
	return h, ents, nil
}

func gptTable(h gptHeader, ents []byte, ss int64, backup bool, size int64) (*Table, error) {
	t := &Table{Scheme: GPT, SectorSize: int(ss), BackupUsed: backup}
	le := binary.LittleEndian
	for i := 0; i < int(h.numEntries); i++ {
		e := ents[i*gptEntrySize : (i+1)*gptEntrySize]
		if [16]byte(e[:16]) == [16]byte{} {
			continue // an unused entry: no type GUID
		}
		n := i + 1
		first, last := le.Uint64(e[32:]), le.Uint64(e[40:])
		if n > maxPartitions {
			return nil, fmt.Errorf("partition: GPT entry %d is used; the kernel numbers no partition above %d: %w", n, maxPartitions, ErrCorrupt)
		}
		if last < first {
			return nil, fmt.Errorf("partition: GPT partition %d ends (LBA %d) before it starts (LBA %d): %w", n, last, first, ErrCorrupt)
		}
		if first < h.firstUsable || last > h.lastUsable {
			return nil, fmt.Errorf("partition: GPT partition %d (LBAs %d-%d) lies outside the usable LBAs %d-%d: %w",
				n, first, last, h.firstUsable, h.lastUsable, ErrCorrupt)
		}
		// lastUsable < size/ss, checked with the header: no overflow here.
		p := Partition{Number: n, Start: int64(first) * ss, Size: int64(last-first+1) * ss,
			Type: guidString(e[:16]), Name: utf16Name(e[56:128])}
		if p.Start+p.Size > size {
			return nil, fmt.Errorf("partition: GPT partition %d runs past the end of the image: %w", n, ErrCorrupt)
		}
		t.Partitions = append(t.Partitions, p)
	}
	if err := checkOverlaps(t.Partitions); err != nil {
		return nil, err
	}
	return t, nil
}

// guidString formats a GUID in its mixed-endian text form.
func guidString(b []byte) string {
	le := binary.LittleEndian
	return fmt.Sprintf("%08X-%04X-%04X-%04X-%X", le.Uint32(b[0:]), le.Uint16(b[4:]), le.Uint16(b[6:]), b[8:10], b[10:16])
}

func utf16Name(b []byte) string {
	u := make([]uint16, 0, len(b)/2)
	for i := 0; i+1 < len(b); i += 2 {
		c := binary.LittleEndian.Uint16(b[i:])
		if c == 0 {
			break
		}
		u = append(u, c)
	}
	return string(utf16.Decode(u))
}

func readFull(ctx context.Context, r Reader, p []byte, off int64) error {
	if off < 0 || off+int64(len(p)) > r.Size() {
		return fmt.Errorf("%d bytes at %d: past the end of the image (%d bytes): %w", len(p), off, r.Size(), ErrCorrupt)
	}
	n, err := r.ReadAt(ctx, p, off)
	if err == nil && n != len(p) {
		err = fmt.Errorf("short read: %d of %d bytes at %d", n, len(p), off)
	}
	return err
}
