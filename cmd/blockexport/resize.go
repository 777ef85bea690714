package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/blockexport/blockexport/formats/jobs/resize"
	"github.com/blockexport/blockexport/formats/registry"
)

type resizeFlags struct {
	format, prealloc string
	shrink, quiet    bool
}

func resizeCommand() *cobra.Command {
	var f resizeFlags
	c := &cobra.Command{
		Use:   "resize [flags] IMAGE [+|-]SIZE",
		Short: "change a " + registry.OrList(resizedFormats()) + " image's virtual size, as qemu-img resize",
		Long: "Set IMAGE's virtual size to SIZE, or grow or shrink it by SIZE with a + or -\n" +
			"sign, as qemu-img resize does, with its messages and exit status (0, or 1 on any\n" +
			"error). SIZE takes qemu-img's suffixes (k, M, G, T, P, E); a -SIZE needs no --.\n" +
			"Shrinking drops the data past the new end and needs --shrink. --preallocation\n" +
			"allocates the grown part: falloc reserves it, full writes zeroes (raw), and\n" +
			"for qcow2 every mode allocates the new clusters.",
		Example: "  blockexport resize disk.qcow2 +10G\n" +
			"  blockexport resize -f raw --shrink disk.img 4G",
		// The last argument is the size and may start with "-", so the
		// flags are parsed once it is taken off, as qemu-img does.
		DisableFlagParsing: true,
	}
	fs := c.Flags()
	fs.StringVarP(&f.format, "format", "f", "auto", "image format: "+registry.OrList(resizedFormats())+" (default: detected)")
	fs.StringVar(&f.prealloc, "preallocation", "off", "allocate the grown part: off, metadata (qcow2), falloc or full")
	fs.BoolVar(&f.shrink, "shrink", false, "allow the size to shrink (the data past the new end is lost)")
	fs.BoolVarP(&f.quiet, "quiet", "q", false, "print nothing on success")
	completeWords(c, "format", resizedFormats()...)
	completeWords(c, "preallocation", resize.PreallocOff, resize.PreallocMetadata, resize.PreallocFalloc, resize.PreallocFull)
	qemuStyle(c, func(c *cobra.Command, args []string) error {
		if len(args) < 2 {
			for _, a := range args {
				if a == "--help" || a == "-h" {
					return c.Help()
				}
			}
			return qemuRefusal("Not enough arguments\nTry 'blockexport --help' for more information")
		}
		if err := c.Flags().Parse(args[:len(args)-1]); err != nil {
			if errors.Is(err, pflag.ErrHelp) {
				return c.Help()
			}
			return err
		}
		if help, _ := c.Flags().GetBool("help"); help {
			return c.Help()
		}
		if c.Flags().NArg() != 1 {
			return qemuRefusal("Expecting image file name and size\nTry 'blockexport --help' for more information")
		}
		return f.run(c, c.Flags().Arg(0), args[len(args)-1])
	})
	return c
}

func (f *resizeFlags) run(c *cobra.Command, path, sizeArg string) error {
	req := resize.Request{Prealloc: f.prealloc, Shrink: f.shrink}
	s := sizeArg
	switch {
	case len(s) > 0 && s[0] == '+':
		req.Sign, s = 1, s[1:]
	case len(s) > 0 && s[0] == '-':
		req.Sign, s = -1, s[1:]
	}
	n, err := registry.ParseQemuSize(s)
	switch {
	case errors.Is(err, registry.ErrSizeRange):
		return qemuRefusal(fmt.Sprintf("Value '%s' is out of range for parameter 'size'", s))
	case err != nil || s == "" || s[0] == '+' || s[0] == '-':
		return qemuRefusal("Parameter 'size' expects a non-negative number below 2^64\n" +
			"Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, peta-\n" +
			"and exabytes, respectively.")
	}
	req.Size = n
	if err := resize.CheckPrealloc(f.prealloc); err != nil {
		return err
	}
	switch {
	case f.format == registry.Auto, slices.Contains(registry.WritableFormats(), f.format):
	default:
		if _, err := registry.ParseFormat(f.format); err != nil {
			return qemuRefusal(fmt.Sprintf("Could not open '%s': Unknown driver '%s'", path, f.format))
		}
		return fmt.Errorf("resize: %s images are not resized here (want %s)", f.format, registry.OrList(resizedFormats()))
	}
	img, err := openImage(path, registry.Options{Format: f.format, Writable: true, Lock: true, Backend: "threads",
		Logger: warnLogger(os.Stderr)})
	if err != nil {
		return err
	}
	if err := resize.Resize(context.Background(), img.Image, img.Format, req); err != nil {
		img.Image.Close()
		return err
	}
	// The close stores the dirty bitmaps at the new size: its failure
	// leaves them in use, which the user must hear of.
	if err := img.Image.Close(); err != nil {
		return fmt.Errorf("resize %s: close: %w", path, err)
	}
	if l, ok := img.Image.(interface{ BitmapsLost() error }); ok && l.BitmapsLost() != nil {
		// qemu-img's words at its close, and its exit status: the resize
		// stands, the bitmaps are left in use.
		fmt.Fprintf(c.ErrOrStderr(), "blockexport: Lost persistent bitmaps during inactivation of node '%s': %v\n", path, l.BitmapsLost())
	}
	if !f.quiet {
		fmt.Fprintln(c.OutOrStdout(), "Image resized.")
	}
	return nil
}

// resizedFormats are the formats resize changes: raw and qcow2 (QEMU's
// vmdk driver does not resize either).
func resizedFormats() []string { return []string{registry.QCOW2, registry.Raw} }
