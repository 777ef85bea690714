// Package vpc reads, creates (create.go) and writes (write.go) Virtual
// PC / Hyper-V disk images (VHD; QEMU's name is vpc), fixed and dynamic,
// as QEMU 7.2's vpc driver does (block/vpc.c):
// a 512-byte footer ("conectix", at the start of a dynamic disk and at
// the end of every disk), a dynamic disk header ("cxsparse"), and a block
// allocation table (BAT) of 32-bit sector numbers, each naming a sector
// bitmap followed by the block's data.
//
// The virtual size is QEMU's: the footer's CHS geometry or its
// current_size, chosen by the creator application (see diskSectors).
//
// Differencing disks are read only (write over one through a qcow2
// overlay). A fixed disk is probed by its footer at the end of the file
// (ProbeTail), where QEMU 7.2 probes raw. Differencing disks are read
// with their parent, found through the parent locators (W2ru, a relative
// Windows path, then W2ku, an absolute one, then MacX, a file URL) by
// Options.OpenParent, which confines the name; a sector comes from the
// child where its block's sector bitmap has its bit, else from the
// parent, whose footer's unique id must be the one the child records.
// QEMU 7.2 reads a differencing disk without its parent (zeroes where the
// parent's data is). Every BAT entry is checked when the image opens: a
// block past the end of the file (QEMU refuses that too), over the
// footer, the dynamic header or the BAT, or over another block makes the
// image corrupt.
package vpc

import (
	"bytes"
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync/atomic"
	"unicode/utf16"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/blockmap"
)

// Errors callers branch on.
var (
	// ErrCorrupt: the metadata contradicts itself or the file.
	ErrCorrupt = errors.New("vpc: image is corrupt")
	// ErrUnsupported: a VHD this reader does not read (differencing).
	ErrUnsupported = errors.New("vpc: unsupported image")
)

const (
	footerSize   = 512
	dynHeaderLen = 1024
	typeFixed    = 2
	typeDynamic  = 3
	typeDiff     = 4
	unallocated  = 0xffffffff
	// maxSectors is QEMU's VHD_MAX_SECTORS (2040 GiB).
	maxSectors = 0xff000000
	// maxGeometry is the largest CHS geometry: a disk that has it is
	// sized by current_size whatever its creator.
	maxGeometry = 65535 * 16 * 255
	// maxTableEntries is QEMU's bound (INT_MAX / 4).
	maxTableEntries = (1<<31 - 1) / 4
)

// SizeCalc overrides how the virtual size is computed, as QEMU's
// force_size_calc runtime option does.
type SizeCalc int

const (
	SizeAuto        SizeCalc = iota // by creator application (QEMU's default)
	SizeCHS                         // force_size_calc=chs
	SizeCurrentSize                 // force_size_calc=current_size
)

// Options say how to read an image.
type Options struct {
	SizeCalc SizeCalc
	// Writable opens the image for writing: fixed and dynamic disks.
	Writable bool
	// OpenParent opens a differencing disk's parent by the name a parent
	// locator gives (the registry confines it to the image's directory)
	// and returns it with its name as shown; nil: differencing disks are
	// refused. A nil image with no error: parents are not opened (info
	// without the backing chain); reads then see zeroes.
	OpenParent func(name string) (formats.Image, string, error)
}

// Footer is the VHD footer's fields the reader uses.
type Footer struct {
	DataOffset  uint64
	CreatorApp  [4]byte
	CurrentSize uint64
	Cylinders   uint16
	Heads       uint8
	Sectors     uint8
	Type        uint32
	UUID        [16]byte
}

func parseFooter(b []byte) Footer {
	be := binary.BigEndian
	f := Footer{DataOffset: be.Uint64(b[16:]), CurrentSize: be.Uint64(b[48:]), Cylinders: be.Uint16(b[56:]),
		Heads: b[58], Sectors: b[59], Type: be.Uint32(b[60:])}
	copy(f.CreatorApp[:], b[28:32])
	copy(f.UUID[:], b[68:84])
	return f
}

// checksumOK: the one's complement of the byte sum with the checksum
// field (bytes 64..68) taken as zero.
func checksumOK(b []byte) bool {
	var sum uint32
	for i, c := range b[:footerSize] {
		if i < 64 || i >= 68 {
			sum += uint32(c)
		}
	}
	return ^sum == binary.BigEndian.Uint32(b[64:])
}

// diskSectors is QEMU's vpc_open size rule: Virtual PC and QEMU's "qemu"
// size a disk by its CHS geometry; Hyper-V ("win "), QEMU's "qem2",
// Disk2vhd ("d2v "), XenConverter ("CTXS") and XenServer ("tap\0") by
// current_size; a disk of the largest geometry by current_size always.
func diskSectors(f Footer, calc SizeCalc) uint64 {
	chs := uint64(f.Cylinders) * uint64(f.Heads) * uint64(f.Sectors)
	useCHS := true
	switch string(f.CreatorApp[:]) {
	case "win ", "qem2", "d2v ", "CTXS", "tap\x00":
		useCHS = false
	}
	if calc == SizeCHS {
		useCHS = true
	}
	if !useCHS || chs == maxGeometry || calc == SizeCurrentSize {
		return f.CurrentSize / 512
	}
	return chs
}

// Image is an open VHD image.
type Image struct {
	blockmap.Map // reads, tries, lends and extents, from locate
	f            aio.File
	footer       Footer
	// footerRaw is the footer as read (the copy at the start of a
	// dynamic disk): what an allocation writes at the file's new end.
	footerRaw []byte
	// footerAtEnd: the footer was found at the end of the file only.
	footerAtEnd bool
	size        int64
	fixed       bool
	// Dynamic disks: block size, bitmap size (both bytes) and the BAT
	// entries of the blocks that hold the disk, read with atomic loads
	// (an allocation stores one while reads go on); where the BAT lies
	// and how far the metadata and blocks reach (metaEnd).
	blockSize  int64
	bitmapSize int64
	bat        []uint32
	batOff     int64
	metaEnd    int64
	// w is the write state; nil when opened read-only.
	w *writer
	// Differencing disks: the parent (nil when not opened) and its name
	// as the locator gives it and as shown.
	diff                   bool
	parent                 formats.Image
	parentName, parentFull string
}

// Backing returns a differencing disk's parent, or nil.
func (img *Image) Backing() formats.Image { return img.parent }

// New opens the VHD image of f, which it owns from now on (Close closes
// it; so does a failed New).
func New(ctx context.Context, f aio.File, o Options) (*Image, error) {
	img, err := open(ctx, f, o)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: %w", f.Name(), err)
	}
	img.Map = blockmap.Map{Format: "vpc", End: img.size, Locate: img.locate, Backing: img.parent, File: f}
	if o.Writable {
		if err := img.openWriter(ctx); err != nil {
			img.Close()
			return nil, fmt.Errorf("%s: %w", f.Name(), err)
		}
	}
	return img, nil
}

func open(ctx context.Context, f aio.File, o Options) (*Image, error) {
	size, err := aio.FileSize(f)
	if err != nil {
		return nil, err
	}
	buf := make([]byte, footerSize)
	if _, err := f.ReadAt(ctx, buf, 0); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("vpc: read footer: %w", err)
	}
	atEnd := false
	if !bytes.HasPrefix(buf, []byte("conectix")) {
		// A fixed disk has its footer only at the end.
		if size < footerSize {
			return nil, fmt.Errorf("%w: file of %d bytes is too small for a VHD footer", ErrCorrupt, size)
		}
		if _, err := f.ReadAt(ctx, buf, size-footerSize); err != nil {
			return nil, fmt.Errorf("vpc: read footer: %w", err)
		}
		if !bytes.HasPrefix(buf, []byte("conectix")) {
			return nil, fmt.Errorf("%w: no VHD footer (\"conectix\") at the start or the end", ErrCorrupt)
		}
		atEnd = true
	}
	if !checksumOK(buf) {
		return nil, fmt.Errorf("%w: incorrect footer checksum", ErrCorrupt)
	}
	ft := parseFooter(buf)
	sectors := diskSectors(ft, o.SizeCalc)
	if sectors > maxSectors {
		return nil, fmt.Errorf("%w: %d sectors is over the VHD maximum of %d (2040 GiB)", ErrUnsupported, sectors, uint64(maxSectors))
	}
	img := &Image{f: f, footer: ft, footerRaw: buf, footerAtEnd: atEnd, size: int64(sectors) * 512}
	switch {
	case ft.Type == typeFixed:
		// QEMU reads any disk whose footer says fixed as the file's
		// bytes; they must be there (QEMU reads zeroes past the end).
		img.fixed = true
		room := size
		if atEnd {
			room -= footerSize
		}
		if img.size > room {
			return nil, fmt.Errorf("%w: a fixed disk of %d bytes in a file with room for %d", ErrCorrupt, img.size, room)
		}
		return img, nil
	case atEnd:
		// QEMU opens a dynamic footer found only at the end with no BAT
		// and reads zeroes: the file has lost its head.
		return nil, fmt.Errorf("%w: a type %d disk's footer is only at the end of the file (no dynamic header)", ErrCorrupt, ft.Type)
	case ft.Type == typeDiff:
		if o.Writable {
			return nil, fmt.Errorf("%w: differencing disks are read here, not written; to write, export a qcow2 overlay on it: blockexport create -f qcow2 -b %s -F vpc overlay.qcow2",
				formats.ErrReadOnly, f.Name())
		}
		if o.OpenParent == nil {
			return nil, fmt.Errorf("%w: differencing disk, and no way to open its parent here", ErrUnsupported)
		}
		img.diff = true
	}
	hdr, err := img.loadBAT(ctx, size)
	if err != nil {
		return nil, err
	}
	if img.diff {
		if err := img.openParent(ctx, hdr, size, o.OpenParent); err != nil {
			return nil, err
		}
	}
	return img, nil
}

// Parent locator platform codes.
const (
	platW2ru = 0x57327275 // relative Windows path, UTF-16LE
	platW2ku = 0x57326b75 // absolute Windows path, UTF-16LE
	platMacX = 0x4d616358 // file URL, UTF-8
)

// maxLocator bounds a locator's data: a path.
const maxLocator = 4096

// openParent finds the parent through the locators, in the order the
// VHD specification gives, opens it and checks its unique id.
func (img *Image) openParent(ctx context.Context, hdr []byte, size int64, open func(string) (formats.Image, string, error)) error {
	be := binary.BigEndian
	var want [16]byte
	copy(want[:], hdr[40:56])
	names := map[uint32]string{}
	for k := 0; k < 8; k++ {
		e := hdr[576+24*k:]
		code, length, off := be.Uint32(e), be.Uint32(e[8:]), be.Uint64(e[16:])
		if code == 0 || length == 0 {
			continue
		}
		if length > maxLocator || off > uint64(size) || uint64(size)-off < uint64(length) {
			return fmt.Errorf("%w: parent locator %d [%#x, +%d) is not inside the file", ErrCorrupt, k, off, length)
		}
		b := make([]byte, length)
		if _, err := img.f.ReadAt(ctx, b, int64(off)); err != nil {
			return fmt.Errorf("vpc: read parent locator: %w", err)
		}
		switch code {
		case platW2ru, platW2ku:
			u := make([]uint16, len(b)/2)
			for i := range u {
				u[i] = binary.LittleEndian.Uint16(b[2*i:])
			}
			n := strings.TrimRight(string(utf16.Decode(u)), "\x00")
			n = strings.ReplaceAll(n, "\\", "/")
			if code == platW2ru {
				n = strings.TrimPrefix(n, "./")
			}
			names[code] = n
		case platMacX:
			names[code] = strings.TrimPrefix(strings.TrimRight(string(b), "\x00"), "file://")
		}
	}
	var firstErr error
	for _, code := range []uint32{platW2ru, platW2ku, platMacX} {
		n, ok := names[code]
		if !ok || n == "" {
			continue
		}
		if code == platW2ku && len(n) >= 2 && n[1] == ':' {
			continue // a Windows drive path names nothing here
		}
		p, shown, err := open(n)
		if err != nil {
			if errors.Is(err, unix.ENOENT) && firstErr == nil {
				firstErr = err
				continue // the next locator may name it
			}
			return fmt.Errorf("vpc: parent %s: %w", n, err)
		}
		img.parentName, img.parentFull = n, shown
		if p == nil {
			return nil // parents not opened (info without the chain)
		}
		if pv, ok := p.(*Image); !ok || pv.footer.UUID != want {
			p.Close()
			return fmt.Errorf("%w: parent %s is not the disk the differencing disk was made on (unique id differs)", ErrCorrupt, shown)
		}
		img.parent = p
		return nil
	}
	if firstErr != nil {
		return fmt.Errorf("vpc: parent of a differencing disk: %w", firstErr)
	}
	return fmt.Errorf("%w: differencing disk without a usable parent locator", ErrCorrupt)
}

// loadBAT reads the dynamic header and the BAT with QEMU's checks, then
// checks every entry against the file and the other structures.
func (img *Image) loadBAT(ctx context.Context, size int64) ([]byte, error) {
	hdrOff := img.footer.DataOffset
	if hdrOff < footerSize || hdrOff > uint64(size) || uint64(size)-hdrOff < dynHeaderLen {
		return nil, fmt.Errorf("%w: dynamic header at %#x is not inside the file (%d bytes)", ErrCorrupt, hdrOff, size)
	}
	h := make([]byte, dynHeaderLen)
	if _, err := img.f.ReadAt(ctx, h, int64(hdrOff)); err != nil {
		return nil, fmt.Errorf("vpc: read dynamic header: %w", err)
	}
	if !bytes.HasPrefix(h, []byte("cxsparse")) {
		return nil, fmt.Errorf("%w: invalid dynamic header magic", ErrCorrupt)
	}
	be := binary.BigEndian
	batOff := be.Uint64(h[16:])
	entries := uint64(be.Uint32(h[28:]))
	bs := uint64(be.Uint32(h[32:]))
	if bs < 512 || bs&(bs-1) != 0 {
		return nil, fmt.Errorf("%w: invalid block size %d", ErrCorrupt, bs)
	}
	img.blockSize, img.batOff = int64(bs), int64(batOff)
	img.bitmapSize = int64((bs/(8*512) + 511) &^ 511)
	total := uint64(img.size)
	switch {
	case total/bs > 0xffffffff:
		return nil, fmt.Errorf("%w: too many blocks", ErrCorrupt)
	case entries*bs < total:
		return nil, fmt.Errorf("%w: BAT of %d entries too small for %d bytes", ErrCorrupt, entries, total)
	case entries > maxTableEntries:
		return nil, fmt.Errorf("%w: BAT of %d entries is too large", ErrCorrupt, entries)
	}
	batLen := entries * 4
	if batOff < footerSize || batOff > uint64(size) || uint64(size)-batOff < batLen {
		return nil, fmt.Errorf("%w: BAT [%#x, +%d) is not inside the file (%d bytes)", ErrCorrupt, batOff, batLen, size)
	}
	if batOff < hdrOff+dynHeaderLen && hdrOff < batOff+batLen {
		return nil, fmt.Errorf("%w: BAT at %#x overlaps the dynamic header at %#x", ErrCorrupt, batOff, hdrOff)
	}
	raw := make([]byte, batLen) // inside the file: bounded by its size
	if _, err := img.f.ReadAt(ctx, raw, int64(batOff)); err != nil {
		return nil, fmt.Errorf("vpc: read BAT: %w", err)
	}
	// Regions no block may overlap: the footer copy, the dynamic header,
	// the BAT (to a whole sector, where QEMU puts the first block).
	type region struct{ start, end int64 }
	used := []region{{0, footerSize}, {int64(hdrOff), int64(hdrOff) + dynHeaderLen},
		{int64(batOff), int64((batOff + batLen + 511) &^ 511)}}
	needed := (total + bs - 1) / bs
	img.bat = make([]uint32, needed)
	for i := uint64(0); i < entries; i++ {
		e := be.Uint32(raw[4*i:])
		if i < needed {
			img.bat[i] = e
		}
		if e == unallocated {
			continue
		}
		start := int64(e) * 512
		end := start + img.bitmapSize + img.blockSize
		if end > size { // QEMU refuses this too ("the image has been truncated")
			return nil, fmt.Errorf("%w: block %d at %#x ends past the end of the file (%d bytes)", ErrCorrupt, i, start, size)
		}
		used = append(used, region{start, end})
	}
	slices.SortFunc(used, func(a, b region) int { return cmp.Compare(a.start, b.start) })
	for k := 1; k < len(used); k++ {
		if used[k].start < used[k-1].end {
			return nil, fmt.Errorf("%w: a block at %#x overlaps metadata or another block at %#x", ErrCorrupt, used[k].start, used[k-1].start)
		}
	}
	for _, r := range used {
		img.metaEnd = max(img.metaEnd, r.end)
	}
	return h, nil
}

func (img *Image) Size() int64 { return img.size }

// locate says where the bytes at off lie, to the end of their block: a
// fixed disk is the file's bytes (whose holes QEMU asks the file about);
// an unallocated block reads as zeroes (QEMU does not consult the sector
// bitmap on reads, and neither does this), or in a differencing disk as
// the parent. In an allocated block of a differencing disk, each sector
// is the child's where the block's bitmap (most significant bit first)
// has its bit, else the parent's: the bitmap is read from the file, so a
// try says it would wait.
func (img *Image) locate(ctx context.Context, off, n int64, try bool) (blockmap.Run, bool, error) {
	if img.fixed {
		return blockmap.Run{Kind: blockmap.Data, N: n, File: img.f, Host: off, Raw: true}, true, nil
	}
	in := off % img.blockSize
	r := blockmap.Run{Kind: blockmap.Zero, N: min(n, img.blockSize-in)}
	if img.diff {
		r.Kind = blockmap.Backing
	}
	e := atomic.LoadUint32(&img.bat[off/img.blockSize])
	if e == unallocated {
		return r, true, nil
	}
	host := int64(e)*512 + img.bitmapSize + in
	if !img.diff {
		r.Kind, r.File, r.Host = blockmap.Data, img.f, host
		return r, true, nil
	}
	if try {
		return r, false, nil
	}
	bitmap := make([]byte, img.bitmapSize)
	if _, err := img.f.ReadAt(ctx, bitmap, int64(e)*512); err != nil {
		return r, true, fmt.Errorf("vpc: read sector bitmap at %#x: %w", int64(e)*512, err)
	}
	bit := func(sec int64) bool { return bitmap[sec/8]&(0x80>>(sec%8)) != 0 }
	first := in / 512
	child := bit(first)
	sec := first + 1
	for sec < img.blockSize/512 && bit(sec) == child {
		sec++
	}
	r.N = min(r.N, sec*512-in)
	if child {
		r.Kind, r.File, r.Host = blockmap.Data, img.f, host
	}
	return r, true, nil
}

// Info is qemu-img info's: a dynamic disk's block size as cluster size,
// none for a fixed one, and no format-specific block (QEMU 7.2's vpc
// driver prints none).
func (img *Image) Info() formats.Info {
	i := formats.Info{Format: "vpc", Filename: img.f.Name(), VirtualSize: img.size, ActualSize: img.ActualSize(), RequestAlignment: 1,
		BackingFilename: img.parentName, FullBackingFilename: img.parentFull}
	if img.parentName != "" {
		i.BackingFilenameFormat = "vpc"
	}
	if !img.fixed {
		i.ClusterSize = img.blockSize
	}
	return i
}

func (img *Image) Close() error {
	if img.parent != nil {
		img.parent.Close()
	}
	var err error
	if img.w != nil {
		err = img.trimTail() // no writes are in flight: the footer ends the file
	}
	if cerr := img.f.Close(); err == nil {
		err = cerr
	}
	return err
}
