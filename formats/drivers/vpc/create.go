package vpc

import (
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/blockexport/blockexport/formats/internal/driver"
)

// The layout QEMU 7.2 creates: a dynamic disk has its footer copy at 0,
// the dynamic header at 512, the BAT at 1536 (whole sectors) and the
// footer after it; blocks of 2 MiB are appended as they are written.
const (
	createHeaderOff = footerSize
	createBATOff    = footerSize + dynHeaderLen
	createBlockSize = 2 << 20
	// vhdEpoch is the footer's timestamp origin, 2000-01-01 00:00:00 UTC.
	vhdEpoch = 946684800
	// noOffset is a fixed disk's data offset and the dynamic header's
	// (QEMU writes all 64 bits: Microsoft's tools expect that).
	noOffset = 1<<64 - 1
)

// geometry is the VHD specification's CHS for a number of sectors (as
// QEMU's calculate_geometry, which may round down).
func geometry(sectors uint64) (cyls uint16, heads, secs uint8) {
	var cylsTimesHeads uint64
	if sectors >= 65535*16*63 {
		secs, heads = 255, 16
		cylsTimesHeads = sectors / 255
	} else {
		secs = 17
		cylsTimesHeads = sectors / 17
		h := max((cylsTimesHeads+1023)/1024, 4)
		if cylsTimesHeads >= h*1024 || h > 16 {
			secs, h = 31, 16
			cylsTimesHeads = sectors / 31
		}
		if cylsTimesHeads >= h*1024 {
			secs, h = 63, 16
			cylsTimesHeads = sectors / 63
		}
		heads = uint8(h)
	}
	return uint16(cylsTimesHeads / uint64(heads)), heads, secs
}

// createGeometry is the geometry and the number of sectors of a new disk
// of size bytes, as QEMU 7.2's vpc_co_create picks them: with force_size
// the largest geometry (which says "size by current_size"); otherwise the
// first geometry at or above the size (so a conversion never truncates),
// and the size when even the largest geometry is smaller.
func createGeometry(size int64, force bool) (cyls uint16, heads, secs uint8, sectors uint64, err error) {
	want := uint64(size) / 512
	if force {
		cyls, heads, secs = 65535, 16, 255
	} else {
		want = min(want, maxGeometry)
		for i := uint64(0); want > uint64(cyls)*uint64(heads)*uint64(secs); i++ {
			cyls, heads, secs = geometry(want + i)
		}
	}
	sectors = uint64(cyls) * uint64(heads) * uint64(secs)
	if sectors == maxGeometry {
		sectors = uint64(size) / 512
		if sectors > maxSectors {
			return 0, 0, 0, 0, driver.BadOption("vpc", "The image size is too large for file format 'vpc' (the most is 2040 GiB)")
		}
	}
	return cyls, heads, secs, sectors, nil
}

// newFooter is the footer QEMU 7.2 writes for a new disk: "qemu" as the
// creator (sized by its geometry), "qem2" with force_size (sized by
// current_size), Virtual PC 2007's version, a random unique id.
func newFooter(typ uint32, cyls uint16, heads, secs uint8, sectors uint64, force bool, now time.Time) ([]byte, error) {
	b := make([]byte, footerSize)
	be := binary.BigEndian
	copy(b, "conectix")
	be.PutUint32(b[8:], 2)           // features: reserved, always set
	be.PutUint32(b[12:], 0x00010000) // format version
	if typ == typeDynamic {
		be.PutUint64(b[16:], createHeaderOff)
	} else {
		be.PutUint64(b[16:], noOffset)
	}
	be.PutUint32(b[24:], uint32(now.Unix()-vhdEpoch))
	if force {
		copy(b[28:], "qem2")
	} else {
		copy(b[28:], "qemu")
	}
	be.PutUint32(b[32:], 0x00050003) // Virtual PC 2007
	copy(b[36:], "Wi2k")
	be.PutUint64(b[40:], sectors*512) // original size
	be.PutUint64(b[48:], sectors*512) // current size
	be.PutUint16(b[56:], cyls)
	b[58], b[59] = heads, secs
	be.PutUint32(b[60:], typ)
	if _, err := rand.Read(b[68:84]); err != nil {
		return nil, fmt.Errorf("vpc: unique id: %w", err)
	}
	b[68+6] = b[68+6]&0x0f | 0x40 // version 4 (random), as qemu_uuid_generate
	b[68+8] = b[68+8]&0x3f | 0x80
	setChecksum(b, 64)
	return b, nil
}

// setChecksum stores at b[at:] the one's complement of the byte sum of b
// with that field taken as zero (footer and dynamic header alike).
func setChecksum(b []byte, at int) {
	binary.BigEndian.PutUint32(b[at:], 0)
	var sum uint32
	for _, c := range b {
		sum += uint32(c)
	}
	binary.BigEndian.PutUint32(b[at:], ^sum)
}

// newDynamicHeader is the dynamic header of a disk of entries blocks.
func newDynamicHeader(entries uint32) []byte {
	h := make([]byte, dynHeaderLen)
	be := binary.BigEndian
	copy(h, "cxsparse")
	be.PutUint64(h[8:], noOffset)
	be.PutUint64(h[16:], createBATOff)
	be.PutUint32(h[24:], 0x00010000)
	be.PutUint32(h[28:], entries)
	be.PutUint32(h[32:], createBlockSize)
	setChecksum(h, 36)
	return h
}

// createOptions are vpc's -o options, read and checked before any file
// is made.
type createOptions struct {
	fixed, force bool
}

func parseCreateOptions(o driver.CreateOptions) (createOptions, error) {
	var c createOptions
	switch {
	case o.BackingFile != "":
		return c, driver.BadOption("vpc", "Backing file not supported for file format 'vpc'")
	case o.ClusterSize != 0:
		return c, driver.BadOption("vpc", "Invalid parameter 'cluster_size'")
	case o.Size < 0:
		return c, driver.BadOption("vpc", "Image creation needs a size parameter")
	}
	// preallocation, extent_size_hint and nocow are the file protocol's
	// options, which qemu-img takes for any format; QEMU creates the
	// file empty before vpc writes it, so they change nothing here.
	if err := o.UnknownKeys("vpc", "subformat", "force_size", "preallocation", "extent_size_hint", "nocow"); err != nil {
		return c, err
	}
	switch v, ok := o.Keys["subformat"]; {
	case !ok || v == "dynamic":
	case v == "fixed":
		c.fixed = true
	default:
		return c, driver.BadOption("vpc", "Parameter 'subformat' does not accept value '%s'", v)
	}
	var err error
	if c.force, err = o.BoolKey("vpc", "force_size", false); err != nil {
		return c, err
	}
	if _, err := o.BoolKey("vpc", "nocow", false); err != nil {
		return c, err
	}
	if v, ok := o.Keys["preallocation"]; ok && v != "off" && v != "falloc" && v != "full" {
		return c, driver.BadOption("vpc", "invalid parameter value: %s", v)
	}
	if v, ok := o.Keys["extent_size_hint"]; ok && !isQemuSize(v) {
		return c, driver.BadOption("vpc", "Parameter 'extent_size_hint' expects a non-negative number below 2^64")
	}
	return c, nil
}

// isQemuSize says whether s is a size as QEMU writes one: a number with
// an optional k, M, G, T, P or E suffix.
func isQemuSize(s string) bool {
	s = strings.TrimRight(s, "kKmMgGtTpPeE")
	_, err := strconv.ParseFloat(s, 64)
	return err == nil && !strings.HasPrefix(s, "-")
}

// Create makes a new VHD at path as qemu-img 7.2 does: -o subformat
// (dynamic, the default, or fixed) and force_size (size the disk by the
// bytes asked for, not by the CHS geometry at or above them; what Azure
// wants of a fixed disk of a whole MiB).
func Create(path string, o driver.CreateOptions) error {
	c, err := parseCreateOptions(o)
	if err != nil {
		return err
	}
	cyls, heads, secs, sectors, err := createGeometry(o.Size, c.force)
	if err != nil {
		return err
	}
	typ := uint32(typeDynamic)
	if c.fixed {
		typ = typeFixed
	}
	ft, err := newFooter(typ, cyls, heads, secs, sectors, c.force, time.Now())
	if err != nil {
		return err
	}
	f, err := driver.CreateFile("vpc", path, o.Force)
	if err != nil {
		return err
	}
	err = writeNew(f, ft, c.fixed, sectors)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(path)
		return fmt.Errorf("vpc: create %s: %w", path, err)
	}
	return nil
}

// writeNew writes a new disk's structures into the empty file f: a fixed
// disk is its (sparse) bytes and the footer; a dynamic one the footer
// copy, the dynamic header, a BAT with no block and the footer.
func writeNew(f *os.File, ft []byte, fixed bool, sectors uint64) error {
	if fixed {
		// QEMU's file driver allocates the new file's first block (so
		// that O_DIRECT alignment can be probed on it): the same
		// allocation, which info's actual size shows.
		if _, err := f.WriteAt(make([]byte, min(4096, sectors*512)), 0); err != nil {
			return err
		}
		_, err := f.WriteAt(ft, int64(sectors)*512)
		return err
	}
	entries := (sectors*512 + createBlockSize - 1) / createBlockSize
	batLen := (entries*4 + 511) &^ 511
	bat := make([]byte, batLen)
	for i := range bat {
		bat[i] = 0xff
	}
	buf := append(append(append(append([]byte(nil), ft...), newDynamicHeader(uint32(entries))...), bat...), ft...)
	_, err := f.WriteAt(buf, 0)
	return err
}
