package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strings"

	"github.com/spf13/cobra"

	"github.com/blockexport/blockexport/formats/jobs/measure"
	"github.com/blockexport/blockexport/formats/registry"
)

// qemuStyle makes a verb that mirrors a qemu-img verb whose every failure,
// usage ones included, exits 1: the flag errors and the command's errors
// are printed as one line each (an error with Reports as the messages
// qemu-img prints, each after the program's name) and the status is 1.
func qemuStyle(c *cobra.Command, run func(c *cobra.Command, args []string) error) {
	fail := func(c *cobra.Command, err error) error {
		var m interface{ Reports() []string }
		if errors.As(err, &m) {
			for _, l := range m.Reports() {
				fmt.Fprintf(c.ErrOrStderr(), "blockexport: %s\n", l)
			}
		} else {
			fmt.Fprintf(c.ErrOrStderr(), "blockexport: %v\n", err)
		}
		return exitStatus(exitRuntime)
	}
	c.SetFlagErrorFunc(fail)
	c.RunE = func(c *cobra.Command, args []string) error {
		err := run(c, args)
		if _, ok := err.(exitStatus); err == nil || ok {
			return err
		}
		return fail(c, err)
	}
}

func qemuRefusal(lines ...string) error { return &measure.Error{Messages: lines} }

type measureFlags struct {
	inspectFlags
	target, createOpts, size string
	forceShare               bool
}

func measureCommand() *cobra.Command {
	var f measureFlags
	c := &cobra.Command{
		Use:   "measure [flags] [--size SIZE | IMAGE]",
		Short: "how large a raw or qcow2 image converted from IMAGE (or of SIZE) will be, as qemu-img measure",
		Long: "Print the size a " + registry.OrList(measuredFormats()) + " image converted from IMAGE needs (required size) and\n" +
			"takes fully allocated, with qemu-img measure's numbers, output and exit status\n" +
			"(0, or 1 on any error). Only IMAGE's allocation is read, never its data.\n" +
			"A qcow2 target from a qcow2 v3 source also says the space its persistent\n" +
			"bitmaps take. -o takes the target's creation options (cluster_size, compat,\n" +
			"refcount_bits, preallocation, extended_l2, backing_file, ...).\n" + imageHelp,
		Example: "  blockexport measure --output=json -O qcow2 disk.vmdk\n" +
			"  blockexport measure -O qcow2 -o cluster_size=2M --size 1T",
	}
	fs := c.Flags()
	fs.StringVarP(&f.target, "target-format", "O", "raw", "the target's format: "+registry.OrList(measuredFormats()))
	fs.StringVarP(&f.createOpts, "options", "o", "", "the target's creation options, key=value[,key=value...] as qemu-img's -o")
	fs.StringVar(&f.size, "size", "", "measure an empty image of SIZE instead of IMAGE")
	fs.BoolVarP(&f.forceShare, "force-share", "U", false, "accepted for qemu-img's sake: images are always opened without locks here")
	f.register(c)
	completeWords(c, "target-format", measuredFormats()...)
	qemuStyle(c, func(c *cobra.Command, args []string) error { return measureCmd(c.OutOrStdout(), args, &f) })
	return c
}

func measureCmd(stdout io.Writer, args []string, f *measureFlags) error {
	if f.out.output != "human" && f.out.output != "json" {
		return qemuRefusal("--output must be used with human or json as argument.")
	}
	asJSON := f.out.output == "json" || f.out.asJSON
	if len(args) > 1 {
		return qemuRefusal("At most one filename argument is allowed.")
	}
	if f.size != "" && len(args) == 1 {
		return qemuRefusal("--size N cannot be used together with a filename.")
	}
	if f.size == "" && len(args) == 0 {
		return qemuRefusal("Either --size N or one filename must be specified.")
	}
	// Measured as qemu-img 7.2 measures: raw and qcow2 targets only.
	switch {
	case f.target == registry.Raw || f.target == registry.QCOW2:
	case f.target == "file" || slices.Contains(registry.KnownFormats(), f.target):
		return qemuRefusal(fmt.Sprintf("Block driver '%s' does not support size measurement", f.target))
	default:
		return qemuRefusal(fmt.Sprintf("Unknown file format '%s'", f.target))
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	t := measure.Target{Format: f.target, Options: f.createOpts}
	var r measure.Result
	if f.size != "" {
		n, err := cvtnum("image size", f.size, 0, 1<<63-1)
		if err != nil {
			return err
		}
		if r, err = measure.Measure(ctx, measure.Source{}, n, t); err != nil {
			return err
		}
	} else {
		o, err := f.options()
		if err != nil {
			return err
		}
		img, err := openImage(args[0], o)
		if err != nil {
			return err
		}
		defer img.Image.Close()
		if r, err = measure.Measure(ctx, measure.Source{Image: img.Image, Format: img.Format}, 0, t); err != nil {
			return err
		}
	}
	if asJSON {
		fmt.Fprintln(stdout, r.JSON())
	} else {
		fmt.Fprintln(stdout, strings.Join(r.Lines(), "\n"))
	}
	return nil
}

// measuredFormats are the targets measure sizes: qemu-img 7.2's raw and
// qcow2 (its other formats do not support size measurement).
func measuredFormats() []string { return []string{registry.QCOW2, registry.Raw} }
