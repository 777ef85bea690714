package vmdk

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/formats/internal/driver"
)

// Subformats qemu-img creates, by its names (-o subformat=).
var subformats = []string{"monolithicSparse", "monolithicFlat", "twoGbMaxExtentSparse", "twoGbMaxExtentFlat", "streamOptimized"}

// adapterTypes are qemu-img's -o adapter_type values.
var adapterTypes = []string{"ide", "buslogic", "lsilogic", "legacyESX"}

// splitSize is the size of each extent of a twoGbMaxExtent image (VMware's
// constant, and QEMU's).
const splitSize = 0x80000000

// newGrainSectors and newGTEs are the geometry of every sparse extent
// qemu-img makes: 64 KiB grains, 512 entries a grain table.
const (
	newGrainSectors = 128
	newGTEs         = 512
)

// createSpec is a new image as qemu-img's -o options describe it.
type createSpec struct {
	size          int64
	subformat     string
	adapter       string
	hwVersion     string
	toolsVersion  string
	zeroedGrain   bool
	backing       string
	parentCID     uint32
	flat, split   bool
	compressed    bool
	descriptorCID uint32
}

// readCreateSpec reads qemu-img's vmdk -o options and refuses, in
// qemu-img's words, what it refuses, before any file is made.
func readCreateSpec(path string, o driver.CreateOptions) (createSpec, error) {
	bad := func(msg string, a ...any) error { return driver.BadOption("vmdk", msg, a...) }
	if err := o.UnknownKeys("vmdk", "subformat", "adapter_type", "hwversion", "toolsversion", "compat6", "zeroed_grain",
		"preallocation", "nocow", "extent_size_hint"); err != nil {
		return createSpec{}, err
	}
	s := createSpec{size: (o.Size + sectorSize - 1) &^ (sectorSize - 1), subformat: "monolithicSparse", adapter: "ide",
		toolsVersion: "2147483647", parentCID: 0xffffffff, descriptorCID: rand.Uint32()}
	if o.Size < 0 {
		return s, fmt.Errorf("vmdk: size %d: must not be negative", o.Size)
	}
	if o.ClusterSize != 0 {
		return s, bad("Invalid parameter 'cluster_size'")
	}
	if o.BackingFormat != "" && o.BackingFormat != "vmdk" {
		return s, bad("backing_file must be a vmdk image")
	}
	if v, ok := o.Keys["subformat"]; ok {
		if !slices.Contains(subformats, v) {
			return s, bad("invalid parameter value: %s", v)
		}
		s.subformat = v
	}
	if v, ok := o.Keys["adapter_type"]; ok {
		if !slices.Contains(adapterTypes, v) {
			return s, bad("invalid parameter value: %s", v)
		}
		s.adapter = v
	}
	compat6, err := o.BoolKey("vmdk", "compat6", false)
	if err != nil {
		return s, err
	}
	if s.zeroedGrain, err = o.BoolKey("vmdk", "zeroed_grain", false); err != nil {
		return s, err
	}
	// Options of the extent files, as qemu-img passes them to its file
	// driver: only what makes no difference to a plain file is taken.
	if v, ok := o.Keys["preallocation"]; ok && v != "off" {
		return s, bad("Parameter 'preallocation' value '%s' is not supported here (only preallocation=off)", v)
	}
	if nocow, err := o.BoolKey("vmdk", "nocow", false); err != nil {
		return s, err
	} else if nocow {
		return s, bad("Parameter 'nocow' is not supported here")
	}
	s.hwVersion = o.Keys["hwversion"]
	if s.hwVersion == "undefined" {
		s.hwVersion = ""
	}
	if v, ok := o.Keys["toolsversion"]; ok {
		s.toolsVersion = v
	}
	if compat6 {
		if s.hwVersion != "" {
			return s, bad("compat6 cannot be enabled with hwversion set")
		}
		s.hwVersion = "6"
	}
	if s.hwVersion == "" {
		s.hwVersion = "4"
	}
	s.split = strings.HasPrefix(s.subformat, "twoGbMaxExtent")
	s.flat = strings.HasSuffix(s.subformat, "Flat")
	s.compressed = s.subformat == "streamOptimized"
	if s.flat && o.BackingFile != "" {
		return s, bad("Flat image can't have backing file")
	}
	if s.flat && s.zeroedGrain {
		return s, bad("Flat image can't enable zeroed grain")
	}
	if s.size/sectorSize > maxSectors {
		return s, fmt.Errorf("vmdk: size %d is too large", o.Size)
	}
	if o.BackingFile != "" {
		s.backing = o.BackingFile
		name := o.BackingFile
		if !filepath.IsAbs(name) {
			name = filepath.Join(filepath.Dir(path), name)
		}
		if s.parentCID, err = readCID(name); err != nil {
			return s, fmt.Errorf("vmdk: Failed to read parent CID of %s: %w", o.BackingFile, err)
		}
	}
	return s, nil
}

// readCID reads the CID of the vmdk image at name: from the descriptor
// a sparse file embeds, or from a descriptor file.
func readCID(name string) (uint32, error) {
	f, err := os.Open(name)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	head := make([]byte, sectorSize)
	if _, err := f.ReadAt(head, 0); err != nil && !errors.Is(err, io.EOF) {
		return 0, err
	}
	var at, n int64 = 0, descSize
	if [4]byte(head[:4]) == magic {
		h := parseHeader(head)
		if h.descOffset == 0 || h.descOffset > maxSectors {
			return 0, fmt.Errorf("%w: no embedded descriptor", ErrCorrupt)
		}
		at = int64(h.descOffset) * sectorSize
		n = min(int64(h.descSize)*sectorSize, descSize)
	}
	text := make([]byte, n)
	k, err := f.ReadAt(text, at)
	if err != nil && !errors.Is(err, io.EOF) {
		return 0, err
	}
	var d descriptor
	if err := parseCIDs(string(text[:k]), &d); err != nil {
		return 0, err
	}
	return d.cid, nil
}

// descriptorText is the descriptor qemu-img writes, byte for byte.
func (s createSpec) descriptorText(extentLines string) string {
	heads := int64(16)
	if s.adapter != "ide" {
		// The heads VMware gives disks on a SCSI adapter (QEMU's note).
		heads = 255
	}
	parent := ""
	if s.backing != "" {
		parent = `parentFileNameHint="` + s.backing + `"`
	}
	return fmt.Sprintf("# Disk DescriptorFile\nversion=1\nCID=%x\nparentCID=%x\ncreateType=\"%s\"\n%s\n# Extent description\n%s\n"+
		"# The Disk Data Base\n#DDB\n\nddb.virtualHWVersion = \"%s\"\nddb.geometry.cylinders = \"%d\"\nddb.geometry.heads = \"%d\"\n"+
		"ddb.geometry.sectors = \"63\"\nddb.adapterType = \"%s\"\nddb.toolsVersion = \"%s\"\n",
		s.descriptorCID, s.parentCID, s.subformat, parent, extentLines, s.hwVersion, s.size/(63*heads*sectorSize), heads,
		s.adapter, s.toolsVersion)
}

// extentNames are the files of a new image at path, as qemu-img names
// them: the descriptor (or the monolithic sparse file) first, then the
// extents, "NAME-flat.vmdk" or "NAME-s001.vmdk"/"NAME-f001.vmdk"...
func (s createSpec) extentNames(path string) []string {
	names := []string{path}
	if !s.flat && !s.split || s.size == 0 {
		return names // qemu-img makes no extent of 0 bytes
	}
	dir, base := filepath.Split(path)
	prefix, postfix := base, ""
	if i := strings.LastIndexByte(base, '.'); i >= 0 {
		prefix, postfix = base[:i], base[i:]
	}
	if !s.split {
		return append(names, dir+prefix+"-flat"+postfix)
	}
	kind := byte('s')
	if s.flat {
		kind = 'f'
	}
	for i := int64(1); (i-1)*splitSize < s.size; i++ {
		names = append(names, fmt.Sprintf("%s%s-%c%03d%s", dir, prefix, kind, i, postfix))
	}
	return names
}

// Create makes a new, empty image at path as qemu-img create -f vmdk
// does: the descriptor, and the extent files beside it (sparse extents
// with their header, grain directory and redundant one, and zeroed grain
// tables; flat extents as holes of their size). A failed Create removes
// what it made.
func Create(path string, o driver.CreateOptions) error {
	s, err := readCreateSpec(path, o)
	if err != nil {
		return err
	}
	names := s.extentNames(path)
	var made []string
	defer func() {
		if err != nil {
			for _, n := range made {
				os.Remove(n)
			}
		}
	}()
	var lines strings.Builder
	if !s.flat && !s.split {
		// monolithicSparse, streamOptimized: one sparse file, the
		// descriptor embedded at sector 1.
		fmt.Fprintf(&lines, "RW %d SPARSE \"%s\"\n", s.size/sectorSize, filepath.Base(path))
		f, err := driver.CreateFile("vmdk", path, o.Force)
		if err != nil {
			return err
		}
		made = append(made, path)
		err = s.writeSparse(f, s.size, []byte(s.descriptorText(lines.String())))
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("vmdk: create %s: %w", path, err)
		}
		return nil
	}
	for i, name := range names[1:] {
		n := min(s.size-int64(i)*splitSize, splitSize)
		if !s.split {
			n = s.size
		}
		if s.flat {
			fmt.Fprintf(&lines, "RW %d FLAT \"%s\" 0\n", n/sectorSize, filepath.Base(name))
		} else {
			fmt.Fprintf(&lines, "RW %d SPARSE \"%s\"\n", n/sectorSize, filepath.Base(name))
		}
		f, err := driver.CreateFile("vmdk", name, o.Force)
		if err != nil {
			return err
		}
		made = append(made, name)
		if s.flat {
			err = f.Truncate(n)
			if err == nil {
				err = unix.Fsync(int(f.Fd()))
			}
		} else {
			err = s.writeSparse(f, n, nil)
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("vmdk: create %s: %w", name, err)
		}
	}
	// The descriptor last: an image whose extents failed names none.
	f, err := driver.CreateFile("vmdk", path, o.Force)
	if err != nil {
		return err
	}
	made = append(made, path)
	text := s.descriptorText(lines.String())
	_, err = f.WriteAt([]byte(text), 0)
	if err == nil {
		err = f.Truncate(int64(len(text)))
	}
	if err == nil {
		err = unix.Fsync(int(f.Fd()))
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("vmdk: create %s: %w", path, err)
	}
	return nil
}

// sparseLayout is where a new sparse extent of capacity bytes keeps its
// metadata, in sectors, as QEMU's vmdk_init_extent lays it out: header,
// 20 sectors of descriptor, the redundant grain directory and its grain
// tables, the grain directory and its grain tables, then the grains from
// a grain boundary on.
type sparseLayout struct {
	gdSectors, gtSectors, gtCount int64
	rgd, gd, grains               int64
}

func newSparseLayout(capacity int64) sparseLayout {
	grains := (capacity/sectorSize + newGrainSectors - 1) / newGrainSectors
	l := sparseLayout{gtSectors: newGTEs * 4 / sectorSize, gtCount: (grains + newGTEs - 1) / newGTEs}
	l.gdSectors = (l.gtCount*4 + sectorSize - 1) / sectorSize
	l.rgd = 1 + 20
	l.gd = l.rgd + l.gdSectors + l.gtSectors*l.gtCount
	end := l.gd + l.gdSectors + l.gtSectors*l.gtCount
	l.grains = (end + newGrainSectors - 1) / newGrainSectors * newGrainSectors
	return l
}

// writeSparse writes a new sparse extent of capacity bytes into f (and
// desc, the embedded descriptor, at sector 1), and syncs it.
func (s createSpec) writeSparse(f *os.File, capacity int64, desc []byte) error {
	l := newSparseLayout(capacity)
	version, flags := uint32(1), uint32(flagRGD|flagNLDetect)
	var algo uint16
	switch {
	case s.compressed:
		version, flags, algo = 3, flags|flagCompress|flagMarker, compressDeflate
	case s.zeroedGrain:
		version = 2
	}
	if s.zeroedGrain {
		flags |= flagZeroGrain
	}
	le := binary.LittleEndian
	h := make([]byte, sectorSize)
	copy(h, magic[:])
	le.PutUint32(h[4:], version)
	le.PutUint32(h[8:], flags)
	le.PutUint64(h[12:], uint64(capacity/sectorSize))
	le.PutUint64(h[20:], newGrainSectors)
	le.PutUint64(h[28:], 1)  // descriptor offset
	le.PutUint64(h[36:], 20) // descriptor sectors
	le.PutUint32(h[44:], newGTEs)
	le.PutUint64(h[48:], uint64(l.rgd))
	le.PutUint64(h[56:], uint64(l.gd))
	le.PutUint64(h[64:], uint64(l.grains))
	copy(h[73:], "\n \r\n") // the newline-detection bytes
	le.PutUint16(h[77:], algo)
	if len(desc) > 20*sectorSize {
		return fmt.Errorf("descriptor of %d bytes does not fit in 20 sectors", len(desc))
	}
	if _, err := f.WriteAt(h, 0); err != nil {
		return err
	}
	if len(desc) > 0 {
		if _, err := f.WriteAt(desc, sectorSize); err != nil {
			return err
		}
	}
	if err := f.Truncate(l.grains * sectorSize); err != nil {
		return err
	}
	gd := make([]byte, l.gdSectors*sectorSize)
	for _, at := range []int64{l.rgd, l.gd} {
		for i := range l.gtCount {
			le.PutUint32(gd[4*i:], uint32(at+l.gdSectors+i*l.gtSectors))
		}
		if _, err := f.WriteAt(gd, at*sectorSize); err != nil {
			return err
		}
	}
	return unix.Fsync(int(f.Fd()))
}
