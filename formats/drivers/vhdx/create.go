package vhdx

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"math/bits"
	"os"
	"strconv"
	"strings"
	"syscall"
	"unicode/utf16"

	"github.com/blockexport/blockexport/formats/internal/driver"
)

// creator is the file identifier's creator field (UTF-16, informational).
const creator = "blockexport"

// createLayout is where a new image's parts lie, as QEMU 7.2's
// vhdx_co_create places them (measured with qemu-img 7.2): the header
// section, the log right after it, the BAT after the log (whole MiB), the
// metadata region (1 MiB) after the BAT, and the data from 5 MiB past the
// metadata region's start.
type createLayout struct {
	size, blockSize, logSize   uint64
	fixed, zeroBlocks          bool
	batOff, batLen, metaOff    uint64
	dataOff, fileSize, entries uint64
}

// Create makes a new VHDX image at path as `qemu-img create -f vhdx`
// does: its -o keys subformat (dynamic, fixed), block_size (0: by the
// size, rounded up to a MiB, at most 256 MiB, a power of two), log_size
// (rounded up to a MiB, below 4 GiB), block_state_zero (on: every BAT
// entry ZERO, QEMU's default), and the file's preallocation, nocow and
// extent_size_hint (hints QEMU hands the file; nothing here). The log is
// empty. Every refusal comes before the file is made, in qemu-img's words
// (qemu-img leaves an empty file for some).
func Create(path string, o driver.CreateOptions) error {
	l, err := createOptions(o)
	if err != nil {
		return err
	}
	f, err := driver.CreateFile("vhdx", path, o.Force)
	if err != nil {
		return err
	}
	err = l.write(f)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(path)
		if errors.Is(err, syscall.EFBIG) {
			return fmt.Errorf("vhdx: %s: The image size is too large for file format 'vhdx': %w", path, err)
		}
		return fmt.Errorf("vhdx: create %s: %w", path, err)
	}
	return nil
}

// createOptions reads and checks the -o keys and lays the image out.
func createOptions(o driver.CreateOptions) (createLayout, error) {
	var l createLayout
	switch s := o.Keys["subformat"]; s {
	case "", "dynamic":
	case "fixed":
		l.fixed = true
	default:
		return l, driver.BadOption("vhdx", "Parameter 'subformat' does not accept value '%s'", s)
	}
	bs, err := sizeKey(o, "block_size", 0)
	if err != nil {
		return l, err
	}
	logSize, err := sizeKey(o, "log_size", mib)
	if err != nil {
		return l, err
	}
	if l.zeroBlocks, err = o.BoolKey("vhdx", "block_state_zero", true); err != nil {
		return l, err
	}
	switch p, ok := o.Keys["preallocation"]; {
	case !ok, p == "off", p == "falloc", p == "full":
	case p == "metadata":
		return l, driver.BadOption("vhdx", "Unsupported preallocation mode: metadata")
	default:
		return l, driver.BadOption("vhdx", "invalid parameter value: %s", p)
	}
	if _, err := o.BoolKey("vhdx", "nocow", false); err != nil {
		return l, err
	}
	if _, err := sizeKey(o, "extent_size_hint", 0); err != nil {
		return l, err
	}
	if o.ClusterSize != 0 {
		return l, driver.BadOption("vhdx", "Invalid parameter 'cluster_size'")
	}
	if err := o.UnknownKeys("vhdx", "subformat", "block_size", "log_size", "block_state_zero", "preallocation", "nocow", "extent_size_hint"); err != nil {
		return l, err
	}
	if o.BackingFile != "" {
		return l, driver.BadOption("vhdx", "Backing file not supported for file format 'vhdx'")
	}
	if o.Size < 0 {
		return l, fmt.Errorf("vhdx: size %d is negative", o.Size)
	}
	l.size = uint64(o.Size)
	if l.size > maxImageSize {
		return l, driver.BadOption("vhdx", "Image size too large; max of 64TB")
	}
	// QEMU rounds the log up to a MiB, then refuses none and 4 GiB.
	logSize = (logSize + mib - 1) &^ (mib - 1)
	switch {
	case logSize == 0:
		return l, driver.BadOption("vhdx", "Log size must be a multiple of 1 MB")
	case logSize >= 4<<30:
		return l, driver.BadOption("vhdx", "Log size must be smaller than 4 GB")
	}
	// QEMU rounds up first, wrapping as a uint64: a size within a MiB of
	// 2^64 becomes 0, which picks the size's default, as 0 does.
	bs = (bs + mib - 1) &^ (mib - 1)
	if bs == 0 {
		switch {
		case l.size > 32<<40:
			bs = 64 * mib
		case l.size > 100<<30:
			bs = 32 * mib
		case l.size > 1<<30:
			bs = 16 * mib
		default:
			bs = 8 * mib
		}
	}
	bs = min(bs, blockSizeMax)
	if bs&(bs-1) != 0 {
		return l, driver.BadOption("vhdx", "Block size must be a power of two")
	}
	l.blockSize, l.logSize = bs, logSize
	// The BAT's entries as QEMU counts them, in 32 bits: an empty disk
	// wraps to 2^32-1 >> the chunk ratio's bits, and QEMU makes its BAT
	// region that large (64 MiB at 8 MiB blocks); so does this.
	chunk := uint32(sectorsPerChunk * 512 / bs)
	blocks := uint32((l.size + bs - 1) / bs)
	l.entries = uint64(blocks + (blocks-1)>>bits.TrailingZeros32(chunk))
	l.batOff = headerSection + logSize
	l.batLen = (l.entries*8 + mib - 1) &^ (mib - 1)
	l.metaOff = l.batOff + l.batLen
	l.dataOff = l.metaOff + 5*mib
	l.fileSize = l.dataOff
	if l.fixed {
		l.fileSize += l.size
	}
	return l, nil
}

// sizeKey reads the -o key as a QEMU size (def when absent).
func sizeKey(o driver.CreateOptions, key string, def uint64) (uint64, error) {
	v, ok := o.Keys[key]
	if !ok {
		return def, nil
	}
	n, ok, inRange := parseQemuSize(v)
	switch {
	case !ok:
		return 0, driver.BadOption("vhdx", "Parameter '%s' expects a non-negative number below 2^64", key)
	case !inRange:
		return 0, driver.BadOption("vhdx", "Value '%s' is out of range for parameter '%s'", v, key)
	}
	return n, nil
}

// parseQemuSize reads a size as QEMU's qemu_strtosz: leading blanks, an
// optional +, a decimal number (a fraction only before a suffix) or a 0x
// hexadecimal one, one optional suffix b, k, M, G, T, P or E (powers of
// 1024). ok: the syntax holds; inRange: the value is below 2^64.
func parseQemuSize(s string) (n uint64, ok, inRange bool) {
	s = strings.TrimLeft(s, " \t\n\v\f\r")
	s = strings.TrimPrefix(s, "+")
	shift := 0
	if s != "" {
		if i := strings.IndexByte("bkmgtpe", lower(s[len(s)-1])); i >= 0 {
			shift, s = 10*i, s[:len(s)-1]
		}
	}
	hex := strings.HasPrefix(s, "0x") || strings.HasPrefix(s, "0X")
	digits := s
	if hex {
		digits = s[2:]
	}
	if digits == "" || strings.Trim(digits, "0123456789abcdefABCDEF.") != "" || !hex && strings.ContainsAny(digits, "abcdefABCDEF") {
		return 0, false, false
	}
	if strings.Contains(digits, ".") {
		if hex || shift == 0 {
			return 0, false, false
		}
		v, err := strconv.ParseFloat(digits, 64)
		if err != nil {
			return 0, false, false
		}
		f := v * float64(uint64(1)<<shift)
		return uint64(f), true, f < 1<<64
	}
	base := 10
	if hex {
		base = 16
	}
	v, err := strconv.ParseUint(digits, base, 64)
	if err != nil {
		return 0, true, false
	}
	if shift > 0 && v > (1<<64-1)>>shift {
		return 0, true, false
	}
	return v << shift, true, true
}

func lower(c byte) byte {
	if c >= 'A' && c <= 'Z' {
		return c + 'a' - 'A'
	}
	return c
}

// putChecksum stores the CRC-32C of buf (its field at 4 zero) at 4.
func putChecksum(buf []byte) {
	binary.LittleEndian.PutUint32(buf[4:], 0)
	binary.LittleEndian.PutUint32(buf[4:], crc32.Checksum(buf, castagnoli))
}

// write writes the image: the data area is a hole (a fixed disk's file
// is sized, not filled), then the metadata region and the BAT, then the
// region tables, and the headers last, so that the file is a VHDX image
// only once everything they point at is in place.
func (l createLayout) write(f *os.File) error {
	le := binary.LittleEndian
	if err := f.Truncate(int64(l.fileSize)); err != nil {
		return err
	}
	// The metadata table (64 KiB) and its items in the next 4 KiB.
	meta := make([]byte, metaTableSize+4096)
	copy(meta, "metadata")
	le.PutUint16(meta[10:], 5)
	var page83 [16]byte
	rand.Read(page83[:])
	flags := uint32(0)
	if l.fixed {
		flags = 1 // LeaveBlocksAllocated
	}
	items := []struct {
		guid  [16]byte
		value []byte
		flags uint32
	}{
		{guidFileParams, le.AppendUint32(le.AppendUint32(nil, uint32(l.blockSize)), flags), 4},
		{guidVirtualSize, le.AppendUint64(nil, l.size), 6},
		{guidPage83, page83[:], 6},
		{guidLogicalSector, le.AppendUint32(nil, 512), 6},
		{guidPhysSector, le.AppendUint32(nil, 512), 6},
	}
	at := uint32(metaTableSize)
	for i, it := range items {
		e := meta[32+32*i:]
		copy(e, it.guid[:])
		le.PutUint32(e[16:], at)
		le.PutUint32(e[20:], uint32(len(it.value)))
		le.PutUint32(e[24:], it.flags)
		copy(meta[at:], it.value)
		at += uint32(len(it.value))
	}
	if _, err := f.WriteAt(meta, int64(l.metaOff)); err != nil {
		return err
	}
	// The BAT, written whole where an entry is not zero (QEMU writes it
	// then, and leaves a dynamic disk's all-NOT_PRESENT BAT a hole).
	if l.zeroBlocks || l.fixed {
		bat := make([]byte, l.batLen)
		chunk := sectorsPerChunk * 512 / l.blockSize
		blocks := (l.size + l.blockSize - 1) / l.blockSize
		for b := range blocks {
			e := uint64(blockZero)
			if !l.zeroBlocks {
				off := (l.dataOff + b*l.blockSize + mib - 1) &^ (mib - 1)
				e = off | blockFullyPresent
			}
			le.PutUint64(bat[8*batIndex(b, chunk):], e)
		}
		if _, err := f.WriteAt(bat, int64(l.batOff)); err != nil {
			return err
		}
	}
	// Two identical region tables: the BAT, then the metadata region.
	rt := make([]byte, regionSize)
	copy(rt, "regi")
	le.PutUint32(rt[8:], 2)
	for i, r := range []struct {
		guid     [16]byte
		off, len uint64
	}{{guidBAT, l.batOff, l.batLen}, {guidMetadata, l.metaOff, mib}} {
		e := rt[16+32*i:]
		copy(e, r.guid[:])
		le.PutUint64(e[16:], r.off)
		le.PutUint32(e[24:], uint32(r.len))
	}
	putChecksum(rt)
	for _, off := range []int64{region1Offset, region2Offset} {
		if _, err := f.WriteAt(rt, off); err != nil {
			return err
		}
	}
	if err := f.Sync(); err != nil {
		return err
	}
	// The file identifier and the two headers, the second one ahead.
	id := make([]byte, 4096)
	copy(id, "vhdxfile")
	for i, c := range utf16.Encode([]rune(creator)) {
		le.PutUint16(id[8+2*i:], c)
	}
	if _, err := f.WriteAt(id, 0); err != nil {
		return err
	}
	var seqb [8]byte
	rand.Read(seqb[:])
	seq := le.Uint64(seqb[:]) >> 2 // room to count up
	var guids [32]byte             // file write and data write GUIDs
	rand.Read(guids[:])
	for i, off := range []int64{header1Offset, header2Offset} {
		h := make([]byte, headerSize)
		copy(h, "head")
		le.PutUint64(h[8:], seq+uint64(i))
		copy(h[16:48], guids[:])
		le.PutUint16(h[66:], 1)
		le.PutUint32(h[68:], uint32(l.logSize))
		le.PutUint64(h[72:], headerSection)
		putChecksum(h)
		if _, err := f.WriteAt(h, off); err != nil {
			return err
		}
	}
	return f.Sync()
}
