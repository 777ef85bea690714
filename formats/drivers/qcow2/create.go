package qcow2

import (
	"encoding/binary"
	"fmt"
	"math/bits"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/formats/internal/driver"
)

// CreateOptions describe a new image (driver.CreateOptions: what every
// format that creates images is told).
type CreateOptions = driver.CreateOptions

// readCreateKeys moves qemu-img's qcow2 -o options from o.Keys into o's
// fields, refusing what this writer does not make in qemu-img's words.
func readCreateKeys(o CreateOptions) (CreateOptions, error) {
	bad := func(k, v string) error {
		return driver.BadOption("qcow2", "Parameter '%s' does not accept value '%s'", k, v)
	}
	for k, v := range o.Keys {
		switch k {
		case "cluster_size":
			n, err := parseSizeSuffix(v)
			if err != nil {
				return o, bad(k, v)
			}
			o.ClusterSize = n
		case "compression_type":
			if v != "zlib" && v != "zstd" {
				return o, bad(k, v)
			}
			o.CompressionType = v
		case "lazy_refcounts":
			lazy, err := o.BoolKey("qcow2", k, false)
			if err != nil {
				return o, err
			}
			o.LazyRefcounts = lazy
		case "preallocation":
			if v != "off" {
				return o, driver.BadOption("qcow2", "Parameter 'preallocation' value '%s' is not supported here (only preallocation=off)", v)
			}
		case "compat":
			if v != "1.1" && v != "v3" {
				return o, driver.BadOption("qcow2", "Parameter 'compat' value '%s' is not supported here (images are created as compat=1.1)", v)
			}
		case "refcount_bits":
			if v != "16" {
				return o, driver.BadOption("qcow2", "Parameter 'refcount_bits' value '%s' is not supported here (refcounts are 16 bits)", v)
			}
		case "encryption", "encrypt.format", "data_file", "data_file_raw", "extended_l2":
			return o, driver.BadOption("qcow2", "Parameter '%s' is not supported here", k)
		default:
			return o, driver.BadOption("qcow2", "Invalid parameter '%s'", k)
		}
	}
	o.Keys = nil
	return o, nil
}

// parseSizeSuffix reads a size as bytes or with qemu-img's b, k, M, G,
// T suffixes.
func parseSizeSuffix(v string) (int64, error) {
	if n, err := strconv.ParseInt(v, 10, 64); err == nil && n >= 0 {
		return n, nil
	}
	if v == "" {
		return 0, strconv.ErrSyntax
	}
	shift := strings.IndexByte("bkmgt", strings.ToLower(v[len(v)-1:])[0])
	if shift < 0 {
		return 0, strconv.ErrSyntax
	}
	n, err := strconv.ParseInt(v[:len(v)-1], 10, 64)
	if err != nil || n < 0 || n > 1<<40 {
		return 0, strconv.ErrSyntax
	}
	return n << (10 * shift), nil
}

// DefaultClusterSize is qemu-img's.
const DefaultClusterSize = 64 << 10

// createRefcountOrder gives 16-bit refcounts, as qemu-img does.
const createRefcountOrder = 4

// Create writes a new, empty version 3 image at path: the header (with the
// backing file and a backing format extension), the refcount table, the
// refcount blocks that count the metadata, and a zeroed L1 table, in that
// order, as qemu-img lays them out.
func Create(path string, o CreateOptions) error {
	o, err := readCreateKeys(o)
	if err != nil {
		return err
	}
	cs := o.ClusterSize
	if cs == 0 {
		cs = DefaultClusterSize
	}
	if cs < 1<<minClusterBits || cs > 1<<maxClusterBits || cs&(cs-1) != 0 {
		return fmt.Errorf("qcow2: cluster size %d: must be a power of two from 512 to 2 MiB", cs)
	}
	if o.Size < 0 || o.Size%512 != 0 {
		return fmt.Errorf("qcow2: size %d: must be a multiple of 512 bytes", o.Size)
	}
	if o.Size > maxVirtualSize {
		return fmt.Errorf("qcow2: size %d is too large", o.Size)
	}
	if len(o.BackingFile) > maxBackingNameLen {
		return fmt.Errorf("qcow2: backing file name longer than %d bytes", maxBackingNameLen)
	}
	var compType byte
	switch o.CompressionType {
	case "", "zlib":
	case "zstd":
		compType = compressionZstd
	default:
		return fmt.Errorf("qcow2: compression type %q: want zlib or zstd", o.CompressionType)
	}
	l2Entries := cs / 8
	l1Size := (o.Size + cs*l2Entries - 1) / (cs * l2Entries)
	if l1Size*8 > maxL1Bytes {
		return fmt.Errorf("qcow2: size %d needs an L1 table over %d bytes; use a larger cluster size", o.Size, maxL1Bytes)
	}

	// The header cluster: header, extensions, backing file name.
	const headerLen = 112 // v3 with the compression type field
	hdr := make([]byte, cs)
	be := binary.BigEndian
	ext := hdr[headerLen:headerLen]
	if o.BackingFormat != "" {
		ext = be.AppendUint32(ext, extBackingFmt)
		ext = be.AppendUint32(ext, uint32(len(o.BackingFormat)))
		ext = append(ext, o.BackingFormat...)
		for len(ext)%8 != 0 {
			ext = append(ext, 0)
		}
	}
	ext = be.AppendUint64(ext, 0) // end of extensions
	backingOff := int64(0)
	if o.BackingFile != "" {
		backingOff = int64(headerLen + len(ext))
		if backingOff+int64(len(o.BackingFile)) > cs {
			return fmt.Errorf("qcow2: backing file name does not fit in a %d-byte cluster", cs)
		}
		copy(hdr[backingOff:], o.BackingFile)
	}

	// Clusters: header, refcount table (t), refcount blocks (b), L1 (l).
	perBlock := cs * 8 / (1 << createRefcountOrder)
	l := (l1Size*8 + cs - 1) / cs // none for an empty image, as qemu-img does
	t, b := int64(1), int64(1)
	for {
		total := 1 + t + b + l
		nb := (total + perBlock - 1) / perBlock
		nt := (nb*8 + cs - 1) / cs
		if nb == b && nt == t {
			break
		}
		b, t = nb, nt
	}
	rtOff, rbOff, l1Off := cs, cs*(1+t), cs*(1+t+b)
	total := 1 + t + b + l

	copy(hdr, magic[:])
	be.PutUint32(hdr[hdrVersion:], 3)
	be.PutUint64(hdr[hdrBackingOffset:], uint64(backingOff))
	be.PutUint32(hdr[hdrBackingSize:], uint32(len(o.BackingFile)))
	be.PutUint32(hdr[hdrClusterBits:], uint32(bits.Len64(uint64(cs))-1))
	be.PutUint64(hdr[hdrSize:], uint64(o.Size))
	be.PutUint32(hdr[hdrL1Size:], uint32(l1Size))
	be.PutUint64(hdr[hdrL1Offset:], uint64(l1Off))
	be.PutUint64(hdr[hdrRefcountOffset:], uint64(rtOff))
	be.PutUint32(hdr[hdrRefcountClusters:], uint32(t))
	// No snapshots, no feature bits.
	be.PutUint32(hdr[hdrRefcountOrder:], createRefcountOrder)
	be.PutUint32(hdr[hdrHeaderLength:], headerLen)
	// Compression type (zlib: 0, no feature bit), then padding.
	if compType != compressionZlib {
		hdr[hdrCompressionType] = compType
		be.PutUint64(hdr[hdrIncompatible:], incCompressionTyp)
	}
	if o.LazyRefcounts {
		be.PutUint64(hdr[hdrCompatible:], compatLazyRefcounts)
	}

	rt := make([]uint64, t*cs/8)
	for i := range b {
		rt[i] = uint64(rbOff + i*cs)
	}
	blocks := make([]byte, b*cs)
	for c := range total {
		setRefcount(blocks, c, 1<<createRefcountOrder, 1)
	}

	f, err := driver.CreateFile("qcow2", path, o.Force)
	if err != nil {
		return err
	}
	err = writeNew(f, []hostWrite{{0, hdr}, {rtOff, encodeTable(rt)}, {rbOff, blocks}}, total*cs)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(path)
		return fmt.Errorf("qcow2: create %s: %w", path, err)
	}
	return nil
}

func writeNew(f *os.File, parts []hostWrite, size int64) error {
	for _, p := range parts {
		if _, err := f.WriteAt(p.buf, p.off); err != nil {
			return err
		}
	}
	if err := f.Truncate(size); err != nil {
		return err
	}
	return unix.Fsync(int(f.Fd()))
}
