// Package driver is the contract between a format driver and the
// registry: what a driver offers (Format, one value per package) and how
// the registry hands it a file (Options). A format is its package plus
// its Format in the registry's list; nothing else names it.
package driver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"slices"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
)

// Repair modes of a check (qemu-img check -r): what Check may fix.
const (
	RepairNone  = 0
	RepairLeaks = 1
	RepairAll   = 3 // leaks, refcounts too low, COPIED flags, rebuilds
)

// Options say how the registry opens an image file of any format; a
// driver takes what applies to it.
type Options struct {
	// Name is the image's path as given: relative names the image holds
	// are relative to its directory, and info shows names built from it.
	Name     string
	Writable bool
	// EditBitmaps: opened to edit its persistent dirty bitmaps (qcow2).
	EditBitmaps bool
	// Direct: the file is O_DIRECT (behind aio.Aligned): no page cache.
	Direct bool
	// CacheSize is the metadata table cache in bytes (qcow2 L2 tables,
	// vmdk grain tables); 0: the driver's default.
	CacheSize int64
	// DecodedCacheSize is the cache of decompressed clusters or grains in
	// bytes; 0: the driver's default.
	DecodedCacheSize int64
	Logger           *slog.Logger
	// OpenBacking opens the backing file an image header names (qcow2).
	OpenBacking formats.BackingOpener
	// OpenFile opens a file the image names to read as part of it (a
	// vmdk extent), confined by the registry; it returns the file and its
	// name as shown. nil: such images are refused.
	OpenFile func(name string) (aio.File, string, error)
	// OpenParent opens the image the image names as its parent (a vmdk
	// delta's, a VHD or VHDX differencing disk's), in the same format,
	// confined by the registry; it returns the image (nil: parents are
	// not opened, as for info without the chain) and its name as shown.
	// nil: such images are refused.
	OpenParent func(name string) (formats.Image, string, error)
	// Shown is a name the image holds as a message may show it (a URL
	// without its secrets); nil: as it is.
	Shown func(string) string
}

// Format is one format of image files: the registry entry. A format QEMU
// probes and this program does not read has Probe and nothing else: it is
// recognised so that it is refused by name, not taken for raw.
type Format struct {
	Name string
	// Probe scores a file as QEMU's bdrv_probe does: head is its first
	// ProbeHead bytes (zero past the end of a shorter file), path its name
	// (dmg goes by its suffix). 0: not this format; 100: its magic; raw
	// says 1 to anything, so that any magic wins over it.
	Probe func(head []byte, path string) int
	// ProbeTail recognises a file of this format by its last
	// ProbeTailSize bytes and its size, where QEMU probes raw (no magic
	// at the head: a fixed VHD has its footer at the end only). nil: none.
	ProbeTail func(tail []byte, size int64) bool
	// Lock is what QEMU's driver locks for such a file (see aio.Lock).
	Lock func(writable, backing bool) aio.Lock
	// Open makes the image of f, which it owns from then on (a failed
	// Open closes it). nil: a format this program does not read.
	Open func(ctx context.Context, f aio.File, o Options) (formats.Image, error)
	// Check checks the image of f as qemu-img check does, repairing what
	// repair allows; f is closed. nil: the format has no checks.
	Check func(ctx context.Context, f aio.File, o Options, repair int) (formats.CheckResult, error)
	// RepairWrites: a repairing check writes the file (it is opened
	// writable); otherwise a repair only takes the writer's lock.
	RepairWrites bool
	// Writable: images open for writing; otherwise a writable open is
	// refused before any open, pointing to a qcow2 overlay.
	Writable bool
	// Create makes a new, empty image at path; nil: the format is not
	// created here.
	Create func(path string, o CreateOptions) error
	// CreateBacking: Create records a backing file (CreateOptions'
	// BackingFile); otherwise one is refused before it is opened.
	CreateBacking bool
	// Compress: a conversion may store the format's clusters compressed
	// (convert -c), as QEMU's block_driver_can_compress says of its
	// driver; otherwise -c is refused before anything is made.
	Compress bool
	// CreateKeys are the -o options that mean something to Create, as
	// help lists them ("subformat=monolithicSparse|streamOptimized").
	CreateKeys []string
}

// CreateOptions describe a new image; a format refuses what it cannot
// record (raw: a backing file, a cluster size).
type CreateOptions struct {
	Size        int64 // virtual size, a multiple of 512
	ClusterSize int64 // 0: the format's default
	// BackingFile is recorded as given (relative names are relative to
	// the image's directory); BackingFormat names its format.
	BackingFile   string
	BackingFormat string
	// Force replaces an existing file; otherwise one is an error.
	Force bool
	// CompressionType is "zlib" (or "") or "zstd": how compressed
	// clusters are compressed (qemu-img's -o compression_type).
	CompressionType string
	// LazyRefcounts sets the lazy_refcounts compatible feature bit, as
	// qemu-img's -o lazy_refcounts=on.
	LazyRefcounts bool
	// Keys are the -o options the fields above do not hold, by qemu-img's
	// names (vmdk's subformat, vpc's force_size, ...): the format reads
	// its own, and refuses the rest as qemu-img does (UnknownKeys).
	Keys map[string]string
}

// ErrBadOption marks a create option (-o) the format refuses: a mistake
// in the command line, refused before any file is made.
var ErrBadOption = errors.New("bad creation option")

// BadOption is a refused -o, in qemu-img's words.
func BadOption(format, msg string, a ...any) error {
	return fmt.Errorf("%s: %s%w", format, fmt.Sprintf(msg, a...), silent{ErrBadOption})
}

// silent wraps an error for errors.Is without adding to the message.
type silent struct{ error }

func (silent) Error() string   { return "" }
func (s silent) Unwrap() error { return s.error }

// UnknownKeys refuses any of o.Keys that is not one of known, in
// qemu-img's words ("Invalid parameter 'KEY'").
func (o CreateOptions) UnknownKeys(format string, known ...string) error {
	for _, k := range slices.Sorted(maps.Keys(o.Keys)) {
		if !slices.Contains(known, k) {
			return BadOption(format, "Invalid parameter '%s'", k)
		}
	}
	return nil
}

// BoolKey reads a qemu-img boolean option (on/off, true/false) of o.Keys;
// absent: def.
func (o CreateOptions) BoolKey(format, key string, def bool) (bool, error) {
	v, ok := o.Keys[key]
	if !ok {
		return def, nil
	}
	switch v {
	case "on", "true", "yes":
		return true, nil
	case "off", "false", "no":
		return false, nil
	}
	return false, BadOption(format, "Parameter '%s' expects 'on' or 'off'", key)
}

// Score is a probe's score: n for a file that has what the format's
// probe looks for (100 for its magic), else 0.
func Score(has bool, n int) int {
	if has {
		return n
	}
	return 0
}

// ProbeTailSize is how much of a file's end ProbeTail reads.
const ProbeTailSize = 512

// ProbeHead is how much of a file detection reads: QEMU's
// BLOCK_PROBE_BUF_SIZE. A shorter file is read as if padded with zeroes,
// as QEMU's block layer reads past the end of a file.
const ProbeHead = 2048

// MetadataLock is what a format with metadata locks (see aio.Lock):
// nobody else may write or resize the file, and a writable open holds
// write and resize itself.
func MetadataLock(writable, _ bool) aio.Lock {
	l := aio.Lock{Perm: aio.PermConsistentRead, Unshared: aio.PermWrite | aio.PermResize}
	if writable {
		l.Perm |= aio.PermWrite | aio.PermResize
	}
	return l
}

// ErrNoChecks is a check of a format that has no checks (qemu-img
// check's "This image format does not support checks", exit 63).
var ErrNoChecks = errors.New("this image format does not support checks")

// Image is img as a formats.Image, or the error: never a nil pointer in
// an interface.
func Image[T formats.Image](img T, err error) (formats.Image, error) {
	if err != nil {
		return nil, err
	}
	return img, nil
}

// CreateFile creates the file of a new image at path for format's Create:
// an existing file is refused unless force replaces it.
func CreateFile(format, path string, force bool) (*os.File, error) {
	flags := os.O_RDWR | os.O_CREATE | os.O_EXCL
	if force {
		flags = os.O_RDWR | os.O_CREATE | os.O_TRUNC
	}
	f, err := os.OpenFile(path, flags, 0o644)
	if errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("%s: %s exists; give --force to overwrite it", format, path)
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", format, err)
	}
	return f, nil
}
