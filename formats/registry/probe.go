// Package registry is the one list of formats (registry.go: each
// driver's entry) and the opener: it opens the host file (through aio,
// O_DIRECT behind aio.Aligned for --cache none, with the format's image
// locks), detects the format from magic bytes (or takes the one asked
// for), and hands the file to that format's driver with openers for the
// files the image names, which come back here. It is the only place that
// knows every format: a driver knows its own.
package registry

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/null"
	"github.com/blockexport/blockexport/formats/drivers/qcow2"
	"github.com/blockexport/blockexport/formats/internal/driver"
	"github.com/blockexport/blockexport/formats/protocols/nbd"
)

// Format names accepted by --format.
const (
	Auto  = "auto"
	Raw   = "raw"
	QCOW2 = "qcow2"
	Null  = "null"
)

// NullPrefix starts an image spec that names a null device: "null:1G".
const NullPrefix = "null:"

// ErrBadSpec marks an IMAGE argument or format name that cannot be right
// whatever the files hold (a front end reports it as a usage error).
// Messages made here say what is wrong in plain words (badSpec) and do
// not repeat its text.
var ErrBadSpec = errors.New("refused")

// specError is a usage mistake about IMAGE or --format: errors.Is finds
// ErrBadSpec in it, and its text is the message alone.
type specError struct{ msg string }

func (e *specError) Error() string        { return e.msg }
func (e *specError) Is(target error) bool { return target == ErrBadSpec }

func badSpec(format string, a ...any) error { return &specError{fmt.Sprintf(format, a...)} }

// ParseFormat checks a --format value.
func ParseFormat(s string) (string, error) {
	if s == Auto || s == Null {
		return s, nil
	}
	ff, ok := lookupFormat(s)
	if ok && ff.Open != nil {
		return s, nil
	}
	if ok {
		return "", badSpec("--format %s: %s images are not supported yet (want %s; convert the image: qemu-img convert -f %s -O qcow2 IMAGE OUT.qcow2)", s, s, OrList(Formats()), s)
	}
	return "", badSpec("unknown format %q (want %s)", s, OrList(Formats()))
}

// Options say how to open an image.
type Options struct {
	Format   string // auto (default), null or a format read here (Formats)
	Writable bool
	// EditBitmaps opens a writable qcow2 image to edit its persistent
	// dirty bitmaps (the bitmap verb): none is marked in use at open.
	EditBitmaps bool
	// NullReadZeroes makes null-device reads return zeroes (default in the
	// CLI); off leaves read buffers untouched.
	NullReadZeroes bool
	Direct         bool  // O_DIRECT on the host file (--cache none)
	L2CacheSize    int64 // qcow2 L2 table cache in bytes; 0: default
	// DecodedCacheSize is the cache of decompressed qcow2 clusters and
	// vmdk streamOptimized grains, in bytes per image; 0: the format's
	// default.
	DecodedCacheSize int64
	Backend          aio.Backend // aio engine for host files
	Logger           *slog.Logger
	// Lock takes QEMU's image locks, so that a VM, a qemu tool or another
	// export and this one cannot write one image at once (exports set it;
	// inspection does not, like qemu-img's --force-share).
	Lock bool
	// NBD says how to reach images named by NBD URIs (the image itself or
	// a backing file).
	NBD NBDOptions
	// Remote says how to read images named by http(s):// URLs (the image
	// itself or a backing file).
	Remote RemoteOptions
	// NoBacking opens no backing file (QEMU's BDRV_O_NO_BACKING, as
	// qemu-img info without --backing-chain): the image describes itself
	// from its own metadata, and a missing or unreachable backing file is
	// no error. Its reads of what the backing file holds would be zeroes,
	// so only a command that reads no data sets it.
	NoBacking bool
	// RelatedDirs are directories, besides an image's own, that files an
	// image names (VMDK extents and parents, VHD/VHDX parents) may lie in
	// (see related.go); by default only the image's directory.
	RelatedDirs []string
}

// NBDOptions are the client settings for NBD URIs.
type NBDOptions struct {
	// Connections to open where the server allows several.
	Connections int
	// ReconnectTimeout: how long requests wait for a lost connection to
	// come back (0: they fail at once).
	ReconnectTimeout time.Duration
	// TLS files for nbds URIs (see nbd.TLSFiles).
	TLS nbd.TLSFiles
}

// Opened is an image with what the opener found out about it.
type Opened struct {
	Image formats.Image
	// Format is the format in use; Probed says it was detected, not given.
	Format string
	Probed bool
	// ProbeNote says where probing differed from QEMU's ("": nowhere).
	ProbeNote string
	// Hosts are the local files the image reads (the image file, its
	// backing files and extents), closed with the image: a front end may
	// tune how they are read (aio.SetDropBehind) before it serves.
	Hosts []aio.File
}

// Open opens spec: a path, or "null:SIZE".
func Open(spec string, o Options) (*Opened, error) {
	format := cmp.Or(o.Format, Auto)
	if _, err := ParseFormat(format); err != nil {
		return nil, err
	}
	if sizeSpec, ok := strings.CutPrefix(spec, NullPrefix); ok && (format == Auto || format == Null) {
		size, err := ParseSize(sizeSpec)
		if err != nil {
			return nil, badSpec("null device %q: %v", spec, err)
		}
		img, err := null.New(spec, size, o.NullReadZeroes)
		if err != nil {
			return nil, err
		}
		return &Opened{Image: img, Format: Null}, nil
	}
	if format == Null {
		return nil, badSpec("a null device is given as null:SIZE (e.g. null:1G), not %q", spec)
	}
	if nbd.IsURI(spec) {
		img, err := openNBD(spec, format, o, o.Writable, false)
		if err != nil {
			return nil, err
		}
		return &Opened{Image: img, Format: Raw}, nil // nothing probed: an export is raw bytes
	}
	c := newChain(o)
	img, name, err := c.open(spec, format, o.Writable, false)
	if err != nil {
		return nil, err
	}
	op := &Opened{Image: img, Format: name, Probed: format == Auto, Hosts: c.hosts}
	if c.probedByTail != "" {
		op.ProbeNote = fmt.Sprintf("%s: recognised by its footer at the end of the file, where qemu-img 7.2 probes raw and shows the footer as the disk's last sector (give qemu-img -f %s)", name, name)
	}
	return op, nil
}

// ErrNoChecks is Check on a format that has no checks (qemu-img check's
// "This image format does not support checks", exit 63).
var ErrNoChecks = driver.ErrNoChecks

// Check checks the image spec as `qemu-img check` does, through its
// format's check (qcow2 through its refcounts, repairing what repair
// allows: qcow2.RepairLeaks, qcow2.RepairAll), under the image locks a
// writer would conflict with (a check refuses an image someone writes, a
// repair one anybody uses). A format without checks (raw, vpc), a null
// device or an NBD export: once it opens, ErrNoChecks, as qemu-img check
// says it (exit 63) with or without -r. Backing files are not opened: a
// check is of the image's own file.
func Check(ctx context.Context, spec string, o Options, repair int) (formats.CheckResult, error) {
	format := cmp.Or(o.Format, Auto)
	if _, err := ParseFormat(format); err != nil {
		return formats.CheckResult{}, err
	}
	if IsRemote(spec) {
		return checkRemote(ctx, spec, o, repair)
	}
	if !nbd.IsURI(spec) && !(strings.HasPrefix(spec, NullPrefix) && format == Auto) && format != Null {
		if format == Auto {
			var err error
			if format, _, err = detect(spec); err != nil {
				return formats.CheckResult{}, err
			}
		}
		if ff, _ := lookupFormat(format); ff.Check != nil {
			return checkLocal(ctx, spec, ff, o, repair)
		}
	}
	img, err := Open(spec, Options{Format: format, Backend: o.Backend, Lock: o.Lock, RelatedDirs: o.RelatedDirs, NoBacking: true})
	if err != nil {
		return formats.CheckResult{}, err
	}
	img.Image.Close()
	return formats.CheckResult{}, fmt.Errorf("%s: %w", Shown(spec), ErrNoChecks)
}

// checkLocal checks the local image file spec in format ff: writable
// when a repair writes, under the writer's lock for any repair.
func checkLocal(ctx context.Context, spec string, ff driver.Format, o Options, repair int) (formats.CheckResult, error) {
	lock := o.lock(ff.Lock, repair != driver.RepairNone, false)
	writable := repair != driver.RepairNone && ff.RepairWrites
	f, err := aio.Open(spec, aio.Options{Backend: o.Backend, Writable: writable, Logger: o.Logger, Lock: lock})
	if err != nil {
		return formats.CheckResult{}, fmt.Errorf("%s: %w", ff.Name, err)
	}
	o.NoBacking = true
	c := newChain(o)
	if err := c.enter(f.Fd(), spec); err != nil {
		f.Close()
		return formats.CheckResult{}, err
	}
	return ff.Check(ctx, f, c.driverOptions(f, ff.Name, false), repair)
}

// maxChainDepth bounds backing chains; QEMU has no fixed limit, but a chain
// this deep is a loop we failed to see or an attack.
const maxChainDepth = 256

// chain opens an image and its backing files, refusing a chain that loops
// (the same file twice, by device and inode, whatever the names) or grows
// absurdly deep.
type chain struct {
	o     Options
	seen  map[[2]uint64]string
	depth int
	// related counts the files opened by name (openRelated).
	related int
	// remoteParent is the remote image whose format is being opened (and
	// so whose backing file openBacking is asked for), "" while a local
	// image's is: a remote image's backing string is held to its origin.
	remoteParent string
	// hosts are the local files opened for the image (itself, backing
	// files, extents), for Opened.Hosts.
	hosts []aio.File
	// probedByTail is the image's format when it was found at the end of
	// the file, where QEMU probes raw (for Opened.ProbeNote).
	probedByTail string
}

// openNBD opens an image on an NBD server. What the server exports is
// the disk's bytes, raw: a qcow2 file is served as qcow2 by the server
// (qemu-nbd -f qcow2), not read as qcow2 through it.
//
// fromImage says the URI is a backing file an image names: untrusted, so
// it is parsed by nbd.ParseImageURI (no certificate files of its choosing)
// and its faults are the image's, not the command line's.
func openNBD(uri, format string, o Options, writable, fromImage bool) (formats.Image, error) {
	var addr nbd.Address
	var err error
	if fromImage {
		if format != Auto && format != Raw {
			return nil, fmt.Errorf("backing file %s is an NBD export, which is raw bytes; the image says its format is %q", uri, format)
		}
		if addr, err = nbd.ParseImageURI(uri); err != nil {
			return nil, err
		}
	} else {
		if format != Auto && format != Raw {
			return nil, badSpec("%s is an NBD export, which is raw bytes; format %q is not read over NBD (let the server open it: qemu-nbd -f %s)", uri, format, format)
		}
		if addr, err = nbd.ParseURI(uri); err != nil {
			return nil, badSpec("%v", err)
		}
	}
	no := nbd.Options{Writable: writable, Connections: o.NBD.Connections, ReconnectTimeout: o.NBD.ReconnectTimeout, Logger: o.Logger}
	if addr.TLS {
		if no.TLS, err = nbd.TLSConfig(addr, o.NBD.TLS); err != nil {
			return nil, err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	return driver.Image(nbd.Open(ctx, addr, no))
}

// openBacking is the formats.BackingOpener the chain's images get:
// backing files are read-only.
func (c *chain) openBacking(path, format string) (formats.Image, error) {
	if c.o.NoBacking {
		return nil, nil // no backing image: nil interface, not a nil pointer in one
	}
	format = cmp.Or(format, Auto)
	if c.remoteParent != "" {
		if err := c.o.Remote.backingAllowed(c.remoteParent, path); err != nil {
			return nil, err
		}
	}
	if nbd.IsURI(path) {
		if err := c.deeper(); err != nil { // a loop through a server cannot be seen; depth still bounds it
			return nil, err
		}
		return openNBD(path, format, c.o, false, true)
	}
	img, _, err := c.open(path, format, false, true)
	return img, err
}

// open opens path in format (Auto: detected) and returns the image and the
// format's name.
func (c *chain) open(path, format string, writable, backing bool) (formats.Image, string, error) {
	if IsRemote(path) {
		return c.openRemoteImage(path, format, writable, backing)
	}
	if format == Auto {
		var err error
		var byTail bool
		if format, byTail, err = detect(path); err != nil {
			return nil, "", err
		}
		if byTail && c.depth == 0 {
			c.probedByTail = format
		}
	} else if format == Raw {
		c.warnForcedRaw(path)
	}
	ff, ok := lookupFormat(format)
	if !ok {
		return nil, "", fmt.Errorf("%s: %w %q", path, formats.ErrUnknownFormat, format)
	}
	if ff.Open == nil {
		return nil, "", unsupported(path, ff.Name) // a backing format the image names
	}
	if writable && !ff.Writable {
		return nil, "", needsOverlay(path, ff.Name, ff.Name+" images are read here, not written")
	}
	lock := c.o.lock(ff.Lock, writable, backing)
	f, err := aio.Open(path, aio.Options{Backend: c.o.Backend, Writable: writable, Direct: c.o.Direct, Logger: c.o.Logger, Lock: lock})
	if err != nil {
		return nil, "", fmt.Errorf("%s: %w", format, err)
	}
	if err := c.enter(f.Fd(), path); err != nil {
		f.Close()
		return nil, "", err
	}
	c.hosts = append(c.hosts, f)
	if c.o.Direct {
		// Formats keep byte-granular metadata (qcow2's header fields,
		// compressed clusters); O_DIRECT wants whole blocks.
		f = aio.Aligned(f, aio.LogicalBlockSize(f.Fd()))
	}
	return c.openFormat(f, ff, writable, "")
}

// openFormat opens the image of f in format ff; remote is the URL of a
// remote image ("" for a local one), whose backing string is held to its
// origin.
func (c *chain) openFormat(f aio.File, ff driver.Format, writable bool, remote string) (formats.Image, string, error) {
	parent := c.remoteParent
	c.remoteParent = remote
	img, err := ff.Open(context.Background(), f, c.driverOptions(f, ff.Name, writable))
	c.remoteParent = parent
	if err != nil {
		if writable && errors.Is(err, formats.ErrReadOnly) {
			// A format written here refused this image for writing (a
			// variant it reads only): the answer is an overlay, as for a
			// format read only; the driver's error says why.
			return nil, "", needsOverlay(f.Name(), ff.Name, err.Error())
		}
		return nil, "", err
	}
	return img, ff.Name, nil
}

// driverOptions are what a driver is told when it opens f, an image in
// format: the cache sizes and the openers of the files it names, which
// come back here.
func (c *chain) driverOptions(f aio.File, format string, writable bool) driver.Options {
	name := f.Name()
	return driver.Options{Name: name, Writable: writable, EditBitmaps: writable && c.o.EditBitmaps, Direct: c.o.Direct, CacheSize: c.o.L2CacheSize,
		DecodedCacheSize: c.o.DecodedCacheSize, Logger: c.o.Logger, OpenBacking: c.openBacking, Shown: shownName,
		OpenFile:   func(n string) (aio.File, string, error) { return c.openRelated(name, n, writable) },
		OpenParent: func(n string) (formats.Image, string, error) { return c.openRelatedImage(name, n, format) }}
}

// newChain is the chain of one open.
func newChain(o Options) *chain { return &chain{o: o, seen: map[[2]uint64]string{}} }

// enter records a file of the chain.
func (c *chain) enter(fd int, path string) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("stat %s: %w", path, err)
	}
	id := [2]uint64{st.Dev, st.Ino}
	if prev, ok := c.seen[id]; ok {
		return fmt.Errorf("%w: backing chain loops: %s is %s again", qcow2.ErrCorrupt, path, prev)
	}
	c.seen[id] = path
	return c.deeper()
}

// deeper counts one more image in the chain, within maxChainDepth.
func (c *chain) deeper() error {
	if c.depth++; c.depth > maxChainDepth {
		return fmt.Errorf("%w: backing chain deeper than %d", qcow2.ErrCorrupt, maxChainDepth)
	}
	return nil
}

// LockFor is the image lock an open of a file in format takes (see
// aio.Lock), writable or as a backing file; false for a format not read
// here.
func LockFor(format string, writable, backing bool) (aio.Lock, bool) {
	ff, ok := lookupFormat(format)
	if !ok || ff.Lock == nil {
		return aio.Lock{}, false
	}
	return ff.Lock(writable, backing), true
}

// lock is the image lock an open takes (nil: none), as lockOf says for
// the format.
func (o Options) lock(lockOf func(writable, backing bool) aio.Lock, writable, backing bool) *aio.Lock {
	if !o.Lock {
		return nil
	}
	l := lockOf(writable, backing)
	return &l
}

// detect names the format of the file at path as QEMU would probe it,
// and refuses a format this program does not read. Where QEMU would say
// raw, a format whose structure lies at the end of the file (a fixed
// VHD's footer) is recognised there: byTail says so.
func detect(path string) (name string, byTail bool, err error) {
	head, err := readHead(path)
	if err != nil {
		return "", false, err
	}
	ff := probeFormat(head, path)
	if ff.Open == nil {
		return "", false, unsupported(path, ff.Name)
	}
	if ff.Name == Raw {
		if tf, ok := probeTail(path); ok {
			return tf.Name, true, nil
		}
	}
	return ff.Name, false, nil
}

// probeTail is the format whose ProbeTail recognises the end of the file
// at path; a file that cannot be read is left for the open to report.
func probeTail(path string) (driver.Format, bool) {
	f, err := aio.OpenHostFile(path, os.O_RDONLY)
	if err != nil {
		return driver.Format{}, false
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil || !fi.Mode().IsRegular() || fi.Size() < driver.ProbeTailSize {
		return driver.Format{}, false
	}
	tail := make([]byte, driver.ProbeTailSize)
	if _, err := f.ReadAt(tail, fi.Size()-driver.ProbeTailSize); err != nil {
		return driver.Format{}, false
	}
	return tailFormat(tail, fi.Size())
}

// tailFormat is the format whose ProbeTail recognises tail, the last
// driver.ProbeTailSize bytes of a file of size bytes.
func tailFormat(tail []byte, size int64) (driver.Format, bool) {
	for _, ff := range fileFormats() {
		if ff.ProbeTail != nil && ff.ProbeTail(tail, size) {
			return ff, true
		}
	}
	return driver.Format{}, false
}

// readHead reads the first probeHead bytes of the file at path, zero past
// its end.
func readHead(path string) ([]byte, error) {
	f, err := aio.OpenHostFile(path, os.O_RDONLY)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	head := make([]byte, probeHead)
	if _, err := f.ReadAt(head, 0); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%s: read header: %w", path, err)
	}
	return head, nil
}

// warnForcedRaw warns when a file given as raw has another format's
// magic: its metadata is then disk bytes to the guest (and with -w
// writable). QEMU opens it as asked, silently; the warning is ours. A
// file that cannot be read is left for the open to report.
func (c *chain) warnForcedRaw(path string) {
	if c.o.Logger == nil {
		return
	}
	head, err := readHead(path)
	if err != nil {
		return
	}
	ff := probeFormat(head, path)
	if tf, ok := probeTail(path); ok && ff.Name == Raw {
		ff = tf
	}
	if ff.Name != Raw {
		c.o.Logger.Warn(fmt.Sprintf("%s looks like a %s image, but its format is given as raw: its %s metadata is exported as disk bytes", path, ff.Name, ff.Name))
	}
}

// ParseSize parses a size the way qemu-img does: a number of bytes with an
// optional binary suffix (k/K, M, G, T, P, E, optionally followed by "iB"
// or "B"); a decimal fraction is allowed with a suffix ("1.5G").
func ParseSize(s string) (int64, error) {
	t := strings.TrimSpace(s)
	if t == "" {
		return 0, errors.New("empty size")
	}
	t = strings.TrimSuffix(strings.TrimSuffix(t, "B"), "i")
	shift := 0
	if len(t) > 0 {
		if i := strings.IndexByte("kmgtpe", t[len(t)-1]|0x20); i >= 0 {
			shift = 10 * (i + 1)
			t = t[:len(t)-1]
		}
	}
	if shift == 0 {
		n, err := strconv.ParseInt(t, 10, 64)
		if err != nil || n < 0 {
			return 0, fmt.Errorf("bad size %q", s)
		}
		return n, nil
	}
	f, err := strconv.ParseFloat(t, 64)
	if err != nil || f < 0 || strings.ContainsAny(t, "eEnN") {
		return 0, fmt.Errorf("bad size %q", s)
	}
	v := f * float64(int64(1)<<shift)
	if v >= 1<<63 {
		return 0, fmt.Errorf("size %q too large", s)
	}
	return int64(v), nil
}
