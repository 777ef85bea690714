// Package probe opens an image by spec: it detects the format from magic
// bytes (or takes the one asked for) and hands the file to that format's
// package. It is the only place that knows every format.
package probe

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/null"
	"github.com/blockexport/blockexport/formats/qcow2"
	"github.com/blockexport/blockexport/formats/raw"
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

var qcow2Magic = []byte{'Q', 'F', 'I', 0xfb}

// ErrUsage marks errors in what the user typed (as opposed to what the
// image contains); the CLI exits 2 for them.
var ErrUsage = errors.New("usage")

// ParseFormat checks a --format value.
func ParseFormat(s string) (string, error) {
	switch s {
	case Auto, Raw, QCOW2, Null:
		return s, nil
	}
	return "", fmt.Errorf("%w: unknown format %q (want auto, raw, qcow2 or null)", ErrUsage, s)
}

// Detect reads the first bytes of r and names its format: qcow2 by its
// magic, raw otherwise.
func Detect(r io.ReaderAt) (string, error) {
	var head [4]byte
	n, err := r.ReadAt(head[:], 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return "", fmt.Errorf("probe: read header: %w", err)
	}
	if n == len(head) && bytes.Equal(head[:], qcow2Magic) {
		return QCOW2, nil
	}
	return Raw, nil
}

// Options say how to open an image.
type Options struct {
	Format   string // auto (default), raw, qcow2, null
	Writable bool
	// NullReadZeroes makes null-device reads return zeroes (default in the
	// CLI); off leaves read buffers untouched.
	NullReadZeroes bool
	Direct         bool        // O_DIRECT on the host file (--cache none)
	L2CacheSize    int64       // qcow2 L2 table cache in bytes; 0: default
	Backend        aio.Backend // aio engine for host files
	Logger         *slog.Logger
	// Lock takes QEMU's image locks, so that a VM, a qemu tool or another
	// export and this one cannot write one image at once (exports set it;
	// inspection does not, like qemu-img's --force-share).
	Lock bool
}

// Opened is an image with what the opener found out about it. Image is a
// named field, not embedded: front ends must get the format's own value,
// whose optional interfaces (formats.NoWaitReader, ...) a wrapper would
// hide.
type Opened struct {
	Image formats.Image
	// Format is the format in use; Probed says it was detected, not given.
	Format string
	Probed bool
}

// Open opens spec: a path, or "null:SIZE".
func Open(spec string, o Options) (*Opened, error) {
	format := o.Format
	if format == "" {
		format = Auto
	}
	if _, err := ParseFormat(format); err != nil {
		return nil, err
	}
	if sizeSpec, ok := strings.CutPrefix(spec, NullPrefix); ok && (format == Auto || format == Null) {
		size, err := ParseSize(sizeSpec)
		if err != nil {
			return nil, fmt.Errorf("%w: null device %q: %v", ErrUsage, spec, err)
		}
		img, err := null.New(spec, size, o.NullReadZeroes)
		if err != nil {
			return nil, err
		}
		return &Opened{Image: img, Format: Null}, nil
	}
	if format == Null {
		return nil, fmt.Errorf("%w: a null device is given as null:SIZE (e.g. null:1G), not %q", ErrUsage, spec)
	}

	probed := false
	if format == Auto {
		f, err := aio.OpenHostFile(spec, os.O_RDONLY)
		if err != nil {
			return nil, err
		}
		format, err = Detect(f)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", spec, err)
		}
		probed = true
	}
	switch format {
	case QCOW2:
		img, err := qcow2.Open(spec, qcow2.Options{L2CacheSize: o.L2CacheSize, Backend: o.Backend, Direct: o.Direct, Writable: o.Writable, Logger: o.Logger, Lock: o.Lock})
		if err != nil {
			return nil, err
		}
		return &Opened{Image: img, Format: QCOW2, Probed: probed}, nil
	case Raw:
		img, err := raw.Open(spec, raw.Options{Writable: o.Writable, Direct: o.Direct, Backend: o.Backend, Logger: o.Logger, Lock: o.Lock})
		if err != nil {
			return nil, err
		}
		return &Opened{Image: img, Format: Raw, Probed: probed}, nil
	}
	return nil, fmt.Errorf("%s: %w", spec, formats.ErrUnknownFormat)
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
		switch t[len(t)-1] {
		case 'k', 'K':
			shift = 10
		case 'm', 'M':
			shift = 20
		case 'g', 'G':
			shift = 30
		case 't', 'T':
			shift = 40
		case 'p', 'P':
			shift = 50
		case 'e', 'E':
			shift = 60
		}
		if shift > 0 {
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
