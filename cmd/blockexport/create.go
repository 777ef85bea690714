package main

import (
	"errors"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/blockexport/blockexport/formats/drivers/qcow2"
	"github.com/blockexport/blockexport/formats/registry"
)

type createFlags struct {
	format, clusterSize    string
	backing, backingFormat string
	force                  bool
	// s3Endpoint and s3PathStyle reach an s3:// backing file, whose
	// size and format are read.
	s3Endpoint  string
	s3PathStyle bool
}

func createCommand() *cobra.Command {
	var f createFlags
	c := &cobra.Command{
		Use:   "create [flags] IMAGE [SIZE]",
		Short: "create a new " + registry.OrList(registry.WritableFormats()) + " image",
		Long: "Create a new, empty image, as qemu-img create does. SIZE takes qemu-img's\n" +
			"suffixes (k, M, G, T); with --backing it defaults to the backing file's size.\n" +
			"An existing IMAGE is an error unless --force is given.",
		Example: "  blockexport create -f qcow2 disk.qcow2 10G\n" +
			"  blockexport create -f qcow2 -b base.qcow2 -F qcow2 overlay.qcow2",
		RunE: f.run,
	}
	fs := c.Flags()
	fs.StringVarP(&f.format, "format", "f", "raw", "image format: "+registry.OrList(registry.WritableFormats()))
	fs.StringVar(&f.clusterSize, "cluster-size", "64k", "qcow2 cluster size, a power of two from 512 to 2M")
	fs.StringVarP(&f.backing, "backing", "b", "", "qcow2 backing file (a relative name is relative to IMAGE's directory)")
	fs.StringVarP(&f.backingFormat, "backing-format", "F", "", "format of the backing file: "+registry.OrList(registry.FileFormats())+" (default: detected)")
	fs.BoolVar(&f.force, "force", false, "overwrite IMAGE if it exists")
	fs.StringVar(&f.s3Endpoint, "s3-endpoint", "", "an s3:// backing file's S3-compatible endpoint (see fuse --s3-endpoint)")
	fs.BoolVar(&f.s3PathStyle, "s3-path-style", false, "an s3:// backing file: path-style addressing (see fuse --s3-path-style)")
	completeWords(c, "format", registry.WritableFormats()...)
	completeWords(c, "backing-format", registry.FileFormats()...)
	return c
}

func (f *createFlags) run(c *cobra.Command, args []string) error {
	if len(args) < 1 || len(args) > 2 {
		return usagef("create: want IMAGE [SIZE], got %d argument(s)", len(args))
	}
	path := args[0]
	size := int64(-1)
	if len(args) == 2 {
		n, err := registry.ParseSize(args[1])
		if err != nil {
			return usagef("create: %v", err)
		}
		size = n
	}
	switch f.format {
	case registry.Raw:
		if f.backing != "" || c.Flags().Changed("cluster-size") {
			return usagef("create: --backing and --cluster-size are qcow2 options")
		}
		if size < 0 {
			return usagef("create: a raw image needs a SIZE")
		}
		return registry.Create(path, registry.Raw, registry.CreateOptions{Size: size, Force: f.force})
	case registry.QCOW2:
	default:
		return usagef("create: unknown format %q (want %s)", f.format, registry.OrList(registry.WritableFormats()))
	}
	cs, err := registry.ParseSize(f.clusterSize)
	if err != nil {
		return usagef("create: --cluster-size: %v", err)
	}
	o := qcow2.CreateOptions{Size: size, ClusterSize: cs, BackingFile: f.backing, BackingFormat: f.backingFormat, Force: f.force}
	if f.backing != "" {
		// Any image format read here may be a backing file (vmdk...); a
		// null device may not.
		b, err := registry.OpenBackingFile(path, f.backing, f.backingFormat, registry.Options{Backend: "threads",
			Remote: registry.RemoteOptions{S3Endpoint: f.s3Endpoint, S3PathStyle: f.s3PathStyle}})
		if err != nil {
			if errors.Is(err, registry.ErrBadSpec) {
				return usageError{err}
			}
			return fmt.Errorf("create: backing file: %w", err)
		}
		o.BackingFormat = b.Format
		if size < 0 {
			o.Size = b.Image.Size()
		}
		b.Image.Close()
	} else if f.backingFormat != "" {
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
