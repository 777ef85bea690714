package registry

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"strings"

	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/qcow2"
	"github.com/blockexport/blockexport/formats/drivers/raw"
	"github.com/blockexport/blockexport/formats/drivers/vdi"
	"github.com/blockexport/blockexport/formats/drivers/vhdx"
	"github.com/blockexport/blockexport/formats/drivers/vmdk"
	"github.com/blockexport/blockexport/formats/drivers/vpc"
	"github.com/blockexport/blockexport/formats/internal/driver"
	"github.com/blockexport/blockexport/formats/protocols/nbd"
)

// ErrUnsupportedFormat marks an image in a format QEMU reads and this
// program does not (yet): it is refused by name, never served as raw
// bytes (a guest write would land in the container's metadata).
var ErrUnsupportedFormat = errors.New("images are not supported yet")

// probeHead is how much of a file detection reads (driver.ProbeHead).
const probeHead = driver.ProbeHead

// fileFormats is the registry, the one list of formats: every format
// QEMU 7.2's qemu-img probes for in a file, the ones read here first
// (each its package's Driver). Probing takes the highest score; on a tie
// the earlier entry. A format QEMU reads and this program does not has a
// probe only: it is recognised so that it is refused, not taken for raw.
func fileFormats() []driver.Format {
	return []driver.Format{
		qcow2.Driver(), raw.Driver(), {Name: "qcow", Probe: probeQCOW1},
		vmdk.Driver(), vhdx.Driver(), vpc.Driver(), vdi.Driver(),
		{Name: "qed", Probe: probeQED}, {Name: "parallels", Probe: probeParallels},
		{Name: "bochs", Probe: probeBochs}, {Name: "cloop", Probe: probeCloop},
		{Name: "dmg", Probe: probeDMG}, {Name: "luks", Probe: probeLUKS},
	}
}

// FileFormats names the formats of image files read here, in the
// registry's order (qcow2, raw, then the read-only ones): what a backing
// file may be in.
func FileFormats() []string { return names(func(ff driver.Format) bool { return ff.Open != nil }) }

// WritableFormats names the formats written here, which create and
// convert make (qcow2, raw).
func WritableFormats() []string { return names(func(ff driver.Format) bool { return ff.Writable }) }

// KnownFormats names every format in the registry, the ones recognised
// only to be refused included (qed, luks, ...): what qemu-img knows.
func KnownFormats() []string { return names(func(driver.Format) bool { return true }) }

// CreatableFormats names the formats create, convert -O and dd make.
func CreatableFormats() []string {
	return names(func(ff driver.Format) bool { return ff.Create != nil })
}

// ReadOnlyFormats names the formats read here and not written.
func ReadOnlyFormats() []string {
	return names(func(ff driver.Format) bool { return ff.Open != nil && !ff.Writable })
}

// UncheckedFormats names the formats read here that have no checks
// (qemu-img check exits 63 on them).
func UncheckedFormats() []string {
	return names(func(ff driver.Format) bool { return ff.Open != nil && ff.Check == nil })
}

func names(keep func(driver.Format) bool) []string {
	var n []string
	for _, ff := range fileFormats() {
		if keep(ff) {
			n = append(n, ff.Name)
		}
	}
	return n
}

// Formats names what --format may say: auto, null and FileFormats.
func Formats() []string { return append([]string{Auto, Null}, FileFormats()...) }

// OrList says names as a message does: "a, b or c".
func OrList(names []string) string { return list(names, " or ") }

// AndList says names as help does: "a, b and c".
func AndList(names []string) string { return list(names, " and ") }

func list(names []string, last string) string {
	if len(names) < 2 {
		return strings.Join(names, "")
	}
	return strings.Join(names[:len(names)-1], ", ") + last + names[len(names)-1]
}

// lookupFormat finds a format by name.
func lookupFormat(name string) (driver.Format, bool) {
	for _, ff := range fileFormats() {
		if ff.Name == name {
			return ff, true
		}
	}
	return driver.Format{}, false
}

// probeFormat is the format QEMU would take a file for: the highest
// score (raw's 1 when nothing else matches).
func probeFormat(head []byte, path string) driver.Format {
	var best driver.Format
	score := 0
	for _, ff := range fileFormats() {
		if s := ff.Probe(head, path); s > score {
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

// ErrNeedsOverlay marks a writable open of an image that is read here and
// not written: a format read-only here (vmdk, vhdx, vpc, vdi) or an object
// in remote storage. The way to write over one is a qcow2 overlay, as
// with QEMU. It is an open error (exit 1), as QEMU's for a read-only
// image opened for writing.
var ErrNeedsOverlay = errors.New("read-only here")

// overlayError is the one refusal of a writable open that an overlay
// answers: what is read-only, and the command that makes the overlay.
type overlayError struct {
	source, format, why string
}

func (e *overlayError) Error() string {
	return fmt.Sprintf("%s: %s; to write, export a qcow2 overlay on it: blockexport create -f qcow2 -b %s -F %s overlay.qcow2",
		e.source, e.why, e.source, e.format)
}

func (e *overlayError) Is(target error) bool {
	return target == ErrNeedsOverlay || target == formats.ErrReadOnly
}

// needsOverlay refuses a writable open of source, an image in format
// (the probed one when none was given), for the reason why.
func needsOverlay(source, format, why string) error {
	return &overlayError{source: source, format: format, why: why}
}

// CreateOptions describe a new image (Create).
type CreateOptions = driver.CreateOptions

// Create makes a new, empty image at path in format, one of
// WritableFormats.
func Create(path, format string, o CreateOptions) error {
	ff, ok := lookupFormat(format)
	if !ok || ff.Create == nil {
		return badSpec("%s images are not created here (want %s)", format, OrList(CreatableFormats()))
	}
	if err := ff.Create(path, o); err != nil {
		if errors.Is(err, driver.ErrBadOption) {
			return &specError{err.Error()}
		}
		return err
	}
	return nil
}

// CreateKeysHelp lists each creatable format's -o options for help:
// "qcow2: cluster_size, ...; vmdk: subformat=...".
func CreateKeysHelp() string {
	var parts []string
	for _, ff := range fileFormats() {
		if ff.Create != nil && len(ff.CreateKeys) > 0 {
			parts = append(parts, ff.Name+": "+strings.Join(ff.CreateKeys, ", "))
		}
	}
	return strings.Join(parts, "; ")
}

// CreatesBacking says whether format's Create records a backing file.
func CreatesBacking(format string) bool {
	ff, ok := lookupFormat(format)
	return ok && ff.CreateBacking
}

// Compresses says whether convert -c may write format (its driver takes
// compressed clusters).
func Compresses(format string) bool {
	ff, ok := lookupFormat(format)
	return ok && ff.Compress
}

// ParseCreateOptions reads qemu-img's -o (key=value, comma separated,
// ",," a comma in a value; a bare key is key=on, "nokey" key=off;
// repeatable, a later key wins) into what
// Create takes: size (-1 when not given), backing_file and backing_fmt
// here, every other key in Keys for the format to read or refuse.
func ParseCreateOptions(opts []string) (CreateOptions, error) {
	o := CreateOptions{Size: -1}
	for _, opt := range opts {
		for _, kv := range splitKeyval(opt) {
			k, v, ok := strings.Cut(kv, "=")
			if !ok {
				// QemuOpts: a bare key is KEY=on, "noKEY" KEY=off
				// (-o subformat=fixed,force_size).
				v = "on"
				if rest, isNo := strings.CutPrefix(k, "no"); isNo {
					k, v = rest, "off"
				}
			}
			switch k {
			case "size":
				n, err := ParseQemuSize(v)
				if err != nil || n > math.MaxInt64 {
					return o, badSpec("Parameter 'size' expects a non-negative number below 2^64")
				}
				o.Size = int64(n)
			case "backing_file":
				o.BackingFile = v
			case "backing_fmt":
				o.BackingFormat = v
			default:
				if o.Keys == nil {
					o.Keys = map[string]string{}
				}
				o.Keys[k] = v
			}
		}
	}
	return o, nil
}

// splitKeyval splits s at single commas; ",," is a comma (QEMU's keyval).
func splitKeyval(s string) []string {
	var out []string
	var cur strings.Builder
	for i := 0; i < len(s); i++ {
		switch {
		case s[i] == ',' && i+1 < len(s) && s[i+1] == ',':
			cur.WriteByte(',')
			i++
		case s[i] == ',':
			if cur.Len() > 0 {
				out = append(out, cur.String())
			}
			cur.Reset()
		default:
			cur.WriteByte(s[i])
		}
	}
	if cur.Len() > 0 {
		out = append(out, cur.String())
	}
	return out
}

// OpenBackingFile opens the backing file a new image at image is to name
// (backing as it will be recorded: a relative name is relative to the
// image's directory) in format ("": probed), as a later open of the image
// will, for its format and size. A format no backing file can be in is a
// bad spec.
func OpenBackingFile(image, backing, format string, o Options) (*Opened, error) {
	path := backing
	if !filepath.IsAbs(path) && !nbd.IsURI(path) && !IsRemote(path) {
		path = filepath.Join(filepath.Dir(image), path)
	}
	o.Format = cmp.Or(format, Auto)
	if _, err := ParseFormat(o.Format); err != nil || o.Format == Null {
		return nil, badSpec("backing file format -F %q (want %s)", o.Format, OrList(FileFormats()))
	}
	return Open(path, o)
}
