package main

import (
	"errors"
	"fmt"
	"io"
	"path/filepath"

	"github.com/blockexport/blockexport/formats/probe"
	"github.com/blockexport/blockexport/formats/qcow2"
	"github.com/blockexport/blockexport/formats/raw"
)

const createSynopsis = `create [flags] IMAGE [SIZE]

Create a new, empty image, as qemu-img create does. SIZE takes qemu-img's
suffixes (k, M, G, T); with --backing it defaults to the backing file's size.
An existing IMAGE is an error unless --force is given.`

func runCreate(args []string, stdout, _ io.Writer) error {
	fs := newFlagSet("create", createSynopsis, stdout)
	format := fs.StringP("format", "f", "raw", "image format: raw or qcow2")
	clusterSize := fs.String("cluster-size", "64k", "qcow2 cluster size, a power of two from 512 to 2M")
	backing := fs.StringP("backing", "b", "", "qcow2 backing file (a relative name is relative to IMAGE's directory)")
	backingFormat := fs.StringP("backing-format", "F", "", "format of the backing file: raw or qcow2 (default: detected)")
	force := fs.Bool("force", false, "overwrite IMAGE if it exists")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() < 1 || fs.NArg() > 2 {
		return usagef("create: want IMAGE [SIZE], got %d argument(s)", fs.NArg())
	}
	path := fs.Arg(0)
	size := int64(-1)
	if fs.NArg() == 2 {
		n, err := probe.ParseSize(fs.Arg(1))
		if err != nil {
			return usagef("create: %v", err)
		}
		size = n
	}
	switch *format {
	case probe.Raw:
		if *backing != "" || fs.Changed("cluster-size") {
			return usagef("create: --backing and --cluster-size are qcow2 options")
		}
		if size < 0 {
			return usagef("create: a raw image needs a SIZE")
		}
		return raw.Create(path, size, *force)
	case probe.QCOW2:
	default:
		return usagef("create: unknown format %q (want raw or qcow2)", *format)
	}
	cs, err := probe.ParseSize(*clusterSize)
	if err != nil {
		return usagef("create: --cluster-size: %v", err)
	}
	o := qcow2.CreateOptions{Size: size, ClusterSize: cs, BackingFile: *backing, BackingFormat: *backingFormat, Force: *force}
	if *backing != "" {
		// Open the backing file as a later open will (relative to the
		// image), for its format and size.
		bpath := *backing
		if !filepath.IsAbs(bpath) {
			bpath = filepath.Join(filepath.Dir(path), bpath)
		}
		bf := *backingFormat
		if bf == "" {
			bf = probe.Auto
		}
		if bf != probe.Auto && bf != probe.Raw && bf != probe.QCOW2 {
			return usagef("create: --backing-format %q (want raw or qcow2)", bf)
		}
		b, err := probe.Open(bpath, probe.Options{Format: bf, Backend: "threads"})
		if err != nil {
			if errors.Is(err, probe.ErrBadSpec) {
				return usageError{err}
			}
			return fmt.Errorf("create: backing file: %w", err)
		}
		o.BackingFormat = b.Format
		if size < 0 {
			o.Size = b.Image.Size()
		}
		b.Image.Close()
	} else if *backingFormat != "" {
		return usagef("create: --backing-format without --backing")
	}
	if o.Size < 0 {
		return usagef("create: a qcow2 image without a backing file needs a SIZE")
	}
	if o.Size%512 != 0 {
		return usagef("create: size %d is not a multiple of 512 bytes", o.Size)
	}
	return qcow2.Create(path, o)
}
