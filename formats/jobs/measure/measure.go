// Package measure answers `qemu-img measure`: how large a raw or qcow2
// image converted from a source (or created empty at a size) will be, as
// the required size (what the source's data needs) and the fully
// allocated size (every cluster written). The numbers are QEMU 7.2's, by
// its own arithmetic (raw_measure, qcow2_measure), so that scripts and
// clouds that size a target from one get the same target from the other.
//
// Only the source's block status is read, never its data: a 64 GiB
// sparse image is measured by walking its allocation.
package measure

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/qcow2"
	"github.com/blockexport/blockexport/formats/registry"
)

// Result is what qemu-img measure prints. Bitmaps is set only where QEMU
// prints "bitmaps size": a qcow2 v3 target measured from a source that
// can hold persistent bitmaps.
type Result struct {
	Required       int64
	FullyAllocated int64
	Bitmaps        *int64
}

// Lines are qemu-img measure's human output.
func (r Result) Lines() []string {
	l := []string{fmt.Sprintf("required size: %d", r.Required), fmt.Sprintf("fully allocated size: %d", r.FullyAllocated)}
	if r.Bitmaps != nil {
		l = append(l, fmt.Sprintf("bitmaps size: %d", *r.Bitmaps))
	}
	return l
}

// JSON is qemu-img measure --output=json, byte for byte: QEMU's JSON
// printer, four-space indent, its key order, no trailing newline.
func (r Result) JSON() string {
	var b strings.Builder
	b.WriteString("{\n")
	if r.Bitmaps != nil {
		fmt.Fprintf(&b, "    \"bitmaps\": %d,\n", *r.Bitmaps)
	}
	fmt.Fprintf(&b, "    \"required\": %d,\n    \"fully-allocated\": %d\n}", r.Required, r.FullyAllocated)
	return b.String()
}

// BitmapSource is an image that may carry persistent dirty bitmaps
// (qcow2); ok false says its format version cannot.
type BitmapSource interface {
	PersistentBitmaps(ctx context.Context) (bitmaps []qcow2.BitmapInfo, ok bool, err error)
}

// Target is the image to measure for: its format and its -o options.
type Target struct {
	Format  string // "raw" or "qcow2"
	Options string // qemu-img's -o: key=value[,key=value...]
}

// Error is a refusal worded as qemu-img words it: one entry for each
// message it reports (each printed after the program's name; an entry
// may span lines).
type Error struct{ Messages []string }

func (e *Error) Error() string { return strings.Join(e.Messages, "\n") }

// Reports are the messages, one each.
func (e *Error) Reports() []string { return e.Messages }

func refuse(lines ...string) error { return &Error{Messages: lines} }

// Source is the image measured and its format's name.
type Source struct {
	Image  formats.Image
	Format string
}

// Measure measures target for src, or for an empty image of size bytes
// when src.Image is nil.
func Measure(ctx context.Context, source Source, size int64, t Target) (Result, error) {
	src := source.Image
	opts, err := parseOptions(t.Options)
	if err != nil {
		return Result{}, err
	}
	switch t.Format {
	case "raw":
		if err := known(opts, "raw", "size", "preallocation", "nocow", "extent_size_hint"); err != nil {
			return Result{}, err
		}
		if src != nil {
			size = src.Size()
		}
		n := measureRoundUp(size, 512)
		return Result{Required: n, FullyAllocated: n}, nil
	case "qcow2":
		return measureQcow2(ctx, source, size, opts)
	}
	return Result{}, refuse(fmt.Sprintf("Block driver '%s' does not support size measurement", t.Format))
}

type option struct{ key, value string }

// parseOptions splits -o as QEMU's option parser does: "," separates,
// ",," is a comma in a value; the last of a repeated key wins.
func parseOptions(s string) ([]option, error) {
	var out []option
	for s != "" {
		var part strings.Builder
		for s != "" {
			i := strings.IndexByte(s, ',')
			if i < 0 {
				part.WriteString(s)
				s = ""
				break
			}
			if i+1 < len(s) && s[i+1] == ',' {
				part.WriteString(s[:i+1])
				s = s[i+2:]
				continue
			}
			part.WriteString(s[:i])
			s = s[i+1:]
			break
		}
		k, v, ok := strings.Cut(part.String(), "=")
		if !ok {
			v = "on" // QEMU's implied "on" for a bare key
		}
		out = append(out, option{k, v})
	}
	return out, nil
}

func known(opts []option, format string, keys ...string) error {
	for _, o := range opts {
		found := false
		for _, k := range keys {
			if o.key == k || (strings.HasSuffix(k, ".") && strings.HasPrefix(o.key, k)) {
				found = true
			}
		}
		if !found {
			return refuse(fmt.Sprintf("Invalid parameter '%s'", o.key), fmt.Sprintf("Invalid options for file format '%s'", format))
		}
	}
	return nil
}

func get(opts []option, key string) (string, bool) {
	v, ok := "", false
	for _, o := range opts {
		if o.key == key {
			v, ok = o.value, true
		}
	}
	return v, ok
}

func measureQcow2(ctx context.Context, source Source, size int64, opts []option) (Result, error) {
	src := source.Image
	if err := known(opts, "qcow2", "size", "compat", "backing_file", "backing_fmt", "encryption", "encrypt.",
		"cluster_size", "preallocation", "lazy_refcounts", "refcount_bits", "data_file", "data_file_raw",
		"extended_l2", "compression_type", "nocow", "extent_size_hint"); err != nil {
		return Result{}, err
	}
	t := qcow2.MeasureTarget{ClusterSize: 64 << 10, RefcountBits: 16}
	if v, ok := get(opts, "extended_l2"); ok {
		b, err := parseBool("extended_l2", v)
		if err != nil {
			return Result{}, badType(err, "qcow2")
		}
		t.ExtendedL2 = b
	}
	if v, ok := get(opts, "cluster_size"); ok {
		cs, err := parseOptionSize("cluster_size", v)
		if err != nil {
			return Result{}, badType(err, "qcow2")
		}
		if cs < 512 || cs > 2<<20 || cs&(cs-1) != 0 {
			return Result{}, refuse("Cluster size must be a power of two between 512 and 2048k")
		}
		t.ClusterSize = cs
	}
	version := 3
	if v, ok := get(opts, "compat"); ok {
		switch v {
		case "0.10", "v2":
			version = 2
		case "1.1", "v3":
		default:
			return Result{}, refuse(fmt.Sprintf("Invalid compatibility level: '%s'", v))
		}
	}
	if v, ok := get(opts, "refcount_bits"); ok {
		n, err := strconv.ParseUint(v, 0, 64)
		if err != nil {
			return Result{}, badType(refuse("Parameter 'refcount_bits' expects a number"), "qcow2")
		}
		if n == 0 || n > 64 || n&(n-1) != 0 {
			return Result{}, refuse("Refcount width must be a power of two and may not exceed 64 bits")
		}
		if version < 3 && n != 16 {
			return Result{}, refuse("Different refcount widths than 16 bits require compatibility level 1.1 or above (use compat=1.1 or greater)")
		}
		t.RefcountBits = int64(n)
	}
	full := false
	if v, ok := get(opts, "preallocation"); ok {
		switch v {
		case "off", "metadata":
		case "falloc", "full":
			full = true
		default:
			return Result{}, refuse("invalid parameter value: " + v)
		}
	}
	_, hasBacking := get(opts, "backing_file")

	virtual := int64(0)
	if src == nil {
		virtual = size
	} else if v, ok := get(opts, "size"); ok {
		n, err := parseOptionSize("size", v)
		if err != nil {
			return Result{}, badType(err, "qcow2")
		}
		virtual = n
	}
	virtual = measureRoundUp(virtual, t.ClusterSize)
	if err := t.CheckMeasureSize(virtual); err != nil {
		return Result{}, refuse(err.Error())
	}

	var required int64
	var bitmaps *int64
	if src != nil {
		ssize := measureRoundUp(src.Size(), 512) // bdrv_getlength counts whole sectors
		virtual = measureRoundUp(ssize, t.ClusterSize)
		if hasBacking || source.Format == "vhdx" {
			// Nothing says how much the new backing file shares with
			// the source: count every cluster, as QEMU does. QEMU's
			// vhdx driver has no block status, so QEMU counts every
			// cluster of a vhdx source as data.
			required = virtual
		} else {
			n, err := allocatedBytes(ctx, src, t.ClusterSize)
			if err != nil {
				return Result{}, err
			}
			required = n
		}
		if bs, ok := src.(BitmapSource); ok && version >= 3 {
			list, ok, err := bs.PersistentBitmaps(ctx)
			if err != nil {
				return Result{}, fmt.Errorf("measure: bitmaps: %w", err)
			}
			if ok {
				n := qcow2.BitmapsSize(list, src.Size(), t.ClusterSize)
				bitmaps = &n
			}
		}
	}
	if full {
		required = virtual
	}
	fa := t.FullyAllocated(virtual)
	return Result{Required: fa - virtual + required, FullyAllocated: fa, Bitmaps: bitmaps}, nil
}

// allocatedBytes counts the clusters of cs bytes the source's data
// touches, by QEMU's loop: block status over the whole chain, zero ranges
// skipped, a data range extended to the end of its cluster and counted
// from its start within the cluster (a range that begins mid-cluster
// after another ended there counts that cluster's head again, as QEMU
// does: the numbers must be QEMU's).
func allocatedBytes(ctx context.Context, src formats.Image, cs int64) (int64, error) {
	size := src.Size()
	var required int64
	for off := int64(0); off < size; {
		e, err := src.Extent(ctx, off, size-off)
		if err != nil {
			return 0, fmt.Errorf("measure: block status at %d: %w", off, err)
		}
		n := e.Start + e.Length - off
		if e.Start > off || n <= 0 {
			return 0, fmt.Errorf("measure: block status at %d answered [%d, +%d)", off, e.Start, e.Length)
		}
		if e.Data && !e.Zero {
			n = measureRoundUp(off+n, cs) - off
			required += off%cs + n
		}
		off += n
	}
	return required, nil
}

// badType adds the line QEMU adds when -o does not parse as the target's
// options.
func badType(err error, format string) error {
	var e *Error
	if errors.As(err, &e) {
		return refuse(append(e.Messages, fmt.Sprintf("Invalid options for file format '%s'", format))...)
	}
	return err
}

func parseBool(key, v string) (bool, error) {
	switch v {
	case "on", "yes", "true", "y":
		return true, nil
	case "off", "no", "false", "n":
		return false, nil
	}
	return false, refuse(fmt.Sprintf("Parameter '%s' expects 'on' or 'off'", key))
}

// parseOptionSize is QEMU's parse_option_size, with its wording.
func parseOptionSize(key, v string) (int64, error) {
	n, err := registry.ParseQemuSize(v)
	switch {
	case errors.Is(err, registry.ErrSizeRange):
		return 0, refuse(fmt.Sprintf("Value '%s' is out of range for parameter '%s'", v, key))
	case err != nil:
		return 0, refuse(fmt.Sprintf("Parameter '%s' expects a non-negative number below 2^64\n", key) +
			"Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, peta-\n" +
			"and exabytes, respectively.")
	}
	if n > 1<<63-1 {
		return 0, refuse(fmt.Sprintf("Value '%s' is out of range for parameter '%s'", v, key))
	}
	return int64(n), nil
}

func measureRoundUp(a, b int64) int64 { return (a + b - 1) / b * b }
