package main

import (
	"errors"
	"fmt"
	"slices"

	"github.com/spf13/cobra"

	"github.com/blockexport/blockexport/formats/registry"
)

type createFlags struct {
	format, clusterSize    string
	backing, backingFormat string
	options                []string
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
		Short: "create a new " + registry.OrList(registry.CreatableFormats()) + " image",
		Long: "Create a new, empty image, as qemu-img create does. SIZE takes qemu-img's\n" +
			"suffixes (k, M, G, T); with --backing it defaults to the backing file's size.\n" +
			"An existing IMAGE is an error unless --force is given.",
		Example: "  blockexport create -f qcow2 disk.qcow2 10G\n" +
			"  blockexport create -f qcow2 -b base.qcow2 -F qcow2 overlay.qcow2",
		RunE: f.run,
	}
	fs := c.Flags()
	fs.StringVarP(&f.format, "format", "f", "raw", "image format: "+registry.OrList(registry.CreatableFormats()))
	fs.StringVar(&f.clusterSize, "cluster-size", "", "qcow2 cluster size, a power of two from 512 to 2M (default 64k; -o cluster_size)")
	fs.StringVarP(&f.backing, "backing", "b", "", "backing file (a relative name is relative to IMAGE's directory)")
	fs.StringVarP(&f.backingFormat, "backing-format", "F", "", "format of the backing file: "+registry.OrList(registry.FileFormats())+" (default: detected)")
	fs.StringArrayVarP(&f.options, "options", "o", nil, "the format's creation options, as qemu-img's -o KEY=VALUE,...: size, backing_file, backing_fmt, and the format's own ("+registry.CreateKeysHelp()+")")
	fs.BoolVar(&f.force, "force", false, "overwrite IMAGE if it exists")
	fs.StringVar(&f.s3Endpoint, "s3-endpoint", "", "an s3:// backing file's S3-compatible endpoint (see fuse --s3-endpoint)")
	fs.BoolVar(&f.s3PathStyle, "s3-path-style", false, "an s3:// backing file: path-style addressing (see fuse --s3-path-style)")
	completeWords(c, "format", registry.CreatableFormats()...)
	completeWords(c, "backing-format", registry.FileFormats()...)
	return c
}

func (f *createFlags) run(c *cobra.Command, args []string) error {
	if len(args) < 1 || len(args) > 2 {
		return usagef("create: want IMAGE [SIZE], got %d argument(s)", len(args))
	}
	if !slices.Contains(registry.CreatableFormats(), f.format) {
		return usagef("create: unknown format %q (want %s)", f.format, registry.OrList(registry.CreatableFormats()))
	}
	path := args[0]
	o, err := registry.ParseCreateOptions(f.options)
	if err != nil {
		return usageError{fmt.Errorf("create: %w", err)}
	}
	o.Force = f.force
	if len(args) == 2 {
		// qemu-img: the SIZE argument wins over -o size.
		n, err := registry.ParseSize(args[1])
		if err != nil {
			return usagef("create: %v", err)
		}
		o.Size = n
	}
	if f.clusterSize != "" {
		if o.ClusterSize, err = registry.ParseSize(f.clusterSize); err != nil {
			return usagef("create: --cluster-size: %v", err)
		}
	}
	if f.backing != "" {
		o.BackingFile = f.backing
	}
	if f.backingFormat != "" {
		o.BackingFormat = f.backingFormat
	}
	if o.BackingFile != "" && !registry.CreatesBacking(f.format) {
		// A failure in qemu-img 7.2 (exit 1), not a usage error.
		return fmt.Errorf("create: Backing file not supported for file format '%s'", f.format)
	}
	if o.BackingFile != "" {
		// Any image format read here may be a backing file (vmdk...); a
		// null device may not.
		b, err := registry.OpenBackingFile(path, o.BackingFile, o.BackingFormat, registry.Options{Backend: "threads",
			Remote: registry.RemoteOptions{S3Endpoint: f.s3Endpoint, S3PathStyle: f.s3PathStyle}})
		if err != nil {
			if errors.Is(err, registry.ErrBadSpec) {
				return usageError{err}
			}
			return fmt.Errorf("create: backing file: %w", err)
		}
		o.BackingFormat = b.Format
		if o.Size < 0 {
			o.Size = b.Image.Size()
		}
		b.Image.Close()
	} else if o.BackingFormat != "" {
		return usagef("create: --backing-format without --backing")
	}
	switch {
	case o.Size < 0 && o.BackingFile == "":
		return usagef("create: a %s image without a backing file needs a SIZE", f.format)
	case f.format != registry.Raw:
		// Image formats count sectors: qemu-img rounds the size up.
		o.Size = (o.Size + 511) &^ 511
	}
	if err := registry.Create(path, f.format, o); err != nil {
		if errors.Is(err, registry.ErrBadSpec) {
			return usageError{fmt.Errorf("create: %w", err)}
		}
		return fmt.Errorf("create: %w", err)
	}
	return nil
}
