package registry

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/qcow2"
	"github.com/blockexport/blockexport/formats/drivers/raw"
	"github.com/blockexport/blockexport/formats/drivers/vdi"
	"github.com/blockexport/blockexport/formats/drivers/vhdx"
	"github.com/blockexport/blockexport/formats/drivers/vmdk"
	"github.com/blockexport/blockexport/formats/drivers/vpc"
)

// ErrUnsupportedFormat marks an image in a format QEMU reads and this
// program does not (yet): it is refused by name, never served as raw
// bytes (a guest write would land in the container's metadata).
var ErrUnsupportedFormat = errors.New("images are not supported yet")

// fileFormat is one format of image files: the registry entry. A format
// QEMU probes and this program does not read has probe and no open: it is
// recognised so that it is refused, not taken for raw. Adding a reader is
// filling in its entry's lock and open.
type fileFormat struct {
	name string
	// probe scores a file as QEMU's bdrv_probe does: head is its first
	// probeHead bytes (zero past the end of a shorter file), path its name
	// (dmg goes by its suffix). 0: not this format; 100: its magic; raw
	// says 1 to anything, so any magic wins over it.
	probe func(head []byte, path string) int
	// lock is what QEMU's driver locks for such a file (see aio.Lock).
	lock func(writable, backing bool) aio.Lock
	// open makes the image of f, which it owns from then on; nil: a format
	// this program does not read.
	open func(f aio.File, c *chain, writable bool) (formats.Image, error)
}

// probeHead is how much of a file detection reads: QEMU's
// BLOCK_PROBE_BUF_SIZE. A shorter file is read as if padded with zeroes,
// as QEMU's block layer reads past the end of a file.
const probeHead = 2048

// fileFormats is the registry: every format QEMU 7.2's qemu-img probes
// for in a file, the ones read here first. Probing takes the highest
// score; on a tie the earlier entry.
func fileFormats() []fileFormat {
	return []fileFormat{
		{name: QCOW2, probe: probeQCOW2,
			lock: func(w, _ bool) aio.Lock { return qcow2.Lock(w) },
			open: func(f aio.File, c *chain, w bool) (formats.Image, error) {
				img, err := qcow2.New(f, qcow2.Options{L2CacheSize: c.o.L2CacheSize, DecodedCacheSize: c.o.DecodedCacheSize, Direct: c.o.Direct, Writable: w,
					Logger: c.o.Logger, OpenBacking: c.openBacking})
				if err != nil {
					return nil, err // not a nil *qcow2.Image in an interface
				}
				return img, nil
			}},
		{name: Raw, probe: func([]byte, string) int { return 1 }, lock: raw.Lock,
			open: func(f aio.File, c *chain, w bool) (formats.Image, error) {
				img, err := raw.New(f, raw.Options{Writable: w, Direct: c.o.Direct})
				if err != nil {
					return nil, err
				}
				return img, nil
			}},
		// QEMU reads these; we recognise them (block/*.c, *_probe).
		{name: "qcow", probe: probeQCOW1},
		{name: "vmdk", probe: probeVMDK, lock: vmdk.Lock,
			open: func(f aio.File, c *chain, w bool) (formats.Image, error) {
				if w {
					f.Close()
					return nil, vmdk.WritableError(f.Name())
				}
				name := f.Name()
				img, err := vmdk.New(context.Background(), f, vmdk.Options{Name: name, Direct: c.o.Direct,
					GTCacheSize: c.o.L2CacheSize, DecodedCacheSize: c.o.DecodedCacheSize,
					OpenExtent: func(n string) (aio.File, string, error) { return c.openRelated(name, n) },
					OpenParent: func(n string) (formats.Image, string, error) { return c.openRelatedImage(name, n, "vmdk") }})
				if err != nil {
					return nil, err
				}
				return img, nil
			}},
		{name: "vhdx", probe: probeVHDX,
			lock: func(bool, bool) aio.Lock { return vhdx.Lock(false) }, // -w is refused by open, not by a lock conflict
			open: func(f aio.File, c *chain, w bool) (formats.Image, error) {
				name := f.Name()
				img, err := vhdx.New(context.Background(), f, vhdx.Options{Writable: w,
					OpenParent: func(n string) (formats.Image, string, error) { return c.openRelatedImage(name, n, "vhdx") }})
				if err != nil {
					return nil, err
				}
				return img, nil
			}},
		{name: "vpc", probe: probeVPC,
			lock: func(bool, bool) aio.Lock { return vpc.Lock(false) }, // as vdi's
			open: func(f aio.File, c *chain, w bool) (formats.Image, error) {
				if w {
					f.Close()
					return nil, readOnlyFormat(f.Name(), "vpc")
				}
				name := f.Name()
				img, err := vpc.New(f, vpc.Options{
					OpenParent: func(n string) (formats.Image, string, error) { return c.openRelatedImage(name, n, "vpc") }})
				if err != nil {
					return nil, err
				}
				return img, nil
			}},
		{name: "vdi", probe: probeVDI,
			// Never writable: a -w open is refused by open with a pointer
			// to an overlay, not by a lock conflict first.
			lock: func(bool, bool) aio.Lock { return vdi.Lock(false) },
			open: func(f aio.File, _ *chain, w bool) (formats.Image, error) {
				if w {
					f.Close()
					return nil, readOnlyFormat(f.Name(), "vdi")
				}
				img, err := vdi.New(f)
				if err != nil {
					return nil, err
				}
				return img, nil
			}},
		{name: "qed", probe: probeQED},
		{name: "parallels", probe: probeParallels},
		{name: "bochs", probe: probeBochs},
		{name: "cloop", probe: probeCloop},
		{name: "dmg", probe: probeDMG},
		{name: "luks", probe: probeLUKS},
	}
}

// FileFormats names the formats of image files read here, in the
// registry's order (qcow2, raw, then the read-only ones): what a backing
// file may be in.
func FileFormats() []string {
	var names []string
	for _, ff := range fileFormats() {
		if ff.open != nil {
			names = append(names, ff.name)
		}
	}
	return names
}

// Formats names what --format may say: auto, null and FileFormats.
func Formats() []string { return append([]string{Auto, Null}, FileFormats()...) }

// OrList says names as a message does: "a, b or c".
func OrList(names []string) string {
	if len(names) < 2 {
		return strings.Join(names, "")
	}
	return strings.Join(names[:len(names)-1], ", ") + " or " + names[len(names)-1]
}

// lookupFormat finds a format by name.
func lookupFormat(name string) (fileFormat, bool) {
	for _, ff := range fileFormats() {
		if ff.name == name {
			return ff, true
		}
	}
	return fileFormat{}, false
}

// probeFormat is the format QEMU would take a file for: the highest
// score (raw's 1 when nothing else matches).
func probeFormat(head []byte, path string) fileFormat {
	var best fileFormat
	score := 0
	for _, ff := range fileFormats() {
		if s := ff.probe(head, path); s > score {
			best, score = ff, s
		}
	}
	return best
}

// unsupported is the one-line refusal of an image in format name.
func unsupported(path, name string) error {
	if name == "dmg" { // probed by its name alone
		return fmt.Errorf("%s: %s %w (QEMU takes any file named *.dmg for one; give -f raw if it is raw, or convert it: qemu-img convert -f dmg -O qcow2 %s OUT.qcow2)", path, name, ErrUnsupportedFormat, path)
	}
	return fmt.Errorf("%s: %s %w (convert it: qemu-img convert -f %s -O qcow2 %s OUT.qcow2)", path, name, ErrUnsupportedFormat, name, path)
}

// readOnlyFormat is the one-line refusal of a writable open of an image
// in a format read here but not written (vdi, vpc): the way to write over
// one is a qcow2 overlay, as with QEMU.
func readOnlyFormat(path, name string) error {
	return fmt.Errorf("%s: %s images are read-only here; to write, export a qcow2 overlay on it: qemu-img create -f qcow2 -b %s -F %s OVERLAY.qcow2", path, name, path, name)
}
