package vdi

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"

	"github.com/blockexport/blockexport/formats/internal/driver"
)

// headerText is what QEMU writes at the top of the images it makes; the
// text is not read by anyone (VirtualBox writes its own).
const headerText = "<<< QEMU VM Virtual Disk Image >>>\n"

// Create makes a new VDI image at path as `qemu-img create -f vdi` does
// (QEMU 7.2's vdi_co_do_create): a 512-byte header, the block map at
// 0x200 padded to a sector, the data after it; the size rounded up to a
// sector; dynamic (every entry unallocated) or, with static=on, every
// block allocated in order over a sparse file. The -o keys are
// qemu-img's: static, and the file's preallocation (off, falloc, full:
// QEMU creates the file empty, so they change nothing), nocow and
// extent_size_hint (hints to the host, not taken here). Every refusal
// comes before the file is made (qemu-img leaves an empty file for some).
func Create(path string, o driver.CreateOptions) error {
	static, err := o.BoolKey("vdi", "static", false)
	if err != nil {
		return err
	}
	if err := createHostKeys(o); err != nil {
		return err
	}
	if o.ClusterSize != 0 {
		return driver.BadOption("vdi", "Invalid parameter 'cluster_size'")
	}
	if err := o.UnknownKeys("vdi", "static", "preallocation", "nocow", "extent_size_hint"); err != nil {
		return err
	}
	if o.BackingFile != "" {
		return driver.BadOption("vdi", "Backing file not supported for file format 'vdi'")
	}
	if o.Size < 0 {
		return fmt.Errorf("vdi: size %d is negative", o.Size)
	}
	size := uint64(o.Size+sectorSize-1) &^ (sectorSize - 1)
	if size > maxDiskSize {
		return driver.BadOption("vdi", "Unsupported VDI image size (size is 0x%x, max supported is 0x%x)", size, uint64(maxDiskSize))
	}
	head, bmap, fileSize := layout(size, static)
	f, err := driver.CreateFile("vdi", path, o.Force)
	if err != nil {
		return err
	}
	err = writeNew(f, head, bmap, fileSize)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(path)
		if errors.Is(err, syscall.EFBIG) {
			return fmt.Errorf("vdi: %s: The image size is too large for file format 'vdi': %w", path, err)
		}
		return fmt.Errorf("vdi: create %s: %w", path, err)
	}
	return nil
}

// createHostKeys checks the -o keys QEMU hands to the file it creates.
func createHostKeys(o driver.CreateOptions) error {
	switch p, ok := o.Keys["preallocation"]; {
	case !ok, p == "off", p == "falloc", p == "full":
	case p == "metadata":
		return driver.BadOption("vdi", "Unsupported preallocation mode: metadata")
	default:
		return driver.BadOption("vdi", "invalid parameter value: %s", p)
	}
	if _, err := o.BoolKey("vdi", "nocow", false); err != nil {
		return err
	}
	if v, ok := o.Keys["extent_size_hint"]; ok && !isQemuSize(v) {
		return driver.BadOption("vdi", "Parameter 'extent_size_hint' expects a non-negative number below 2^64")
	}
	return nil
}

// isQemuSize says whether s reads as a size to QEMU: a number with an
// optional k, M, G, T, P or E suffix (or b for bytes).
func isQemuSize(s string) bool {
	s = strings.TrimRight(s, "bkKMGTPE")
	if s == "" {
		return false
	}
	v, err := strconv.ParseFloat(s, 64)
	return err == nil && v >= 0
}

// layout is a new image's header, block map (padded to a sector) and
// file size.
func layout(size uint64, static bool) (head, bmap []byte, fileSize int64) {
	blocks := (size + blockSize - 1) / blockSize
	mapSize := (4*blocks + sectorSize - 1) &^ (sectorSize - 1)
	le := binary.LittleEndian
	head = make([]byte, headerSize)
	copy(head, headerText)
	le.PutUint32(head[64:], signature)
	le.PutUint32(head[68:], version11)
	le.PutUint32(head[72:], 0x180) // the header's size past the pre-header
	imageType := uint32(1)         // dynamic
	if static {
		imageType = typeStatic
	}
	le.PutUint32(head[76:], imageType)
	le.PutUint32(head[offBmapField:], headerSize)
	le.PutUint32(head[offBmapField+4:], uint32(headerSize+mapSize))
	le.PutUint32(head[offBmapField+20:], sectorSize)
	le.PutUint64(head[offBmapField+28:], size)
	le.PutUint32(head[offBmapField+36:], blockSize)
	le.PutUint32(head[offBmapField+44:], uint32(blocks))
	bmap = make([]byte, mapSize)
	for i := range blocks {
		e := uint32(unallocated)
		if static {
			e = uint32(i)
		}
		le.PutUint32(bmap[4*i:], e)
	}
	if static {
		le.PutUint32(head[allocatedField:], uint32(blocks))
	}
	// The image's UUID and its last snapshot's, random (version 4), in
	// VirtualBox's byte order: the first three fields little-endian.
	for _, at := range []int{offBmapField + 52, offBmapField + 68} {
		u := head[at : at+16]
		rand.Read(u)
		u[7] = u[7]&0x0f | 0x40
		u[8] = u[8]&0x3f | 0x80
	}
	fileSize = int64(headerSize + mapSize)
	if static {
		fileSize += int64(blocks) * blockSize
	}
	return head, bmap, fileSize
}

func writeNew(f *os.File, head, bmap []byte, fileSize int64) error {
	if _, err := f.WriteAt(head, 0); err != nil {
		return err
	}
	if _, err := f.WriteAt(bmap, headerSize); err != nil {
		return err
	}
	if err := f.Truncate(fileSize); err != nil {
		return err
	}
	return f.Sync()
}
