package main

import (
	"context"
	"fmt"
	"io"
	"math"
	"os"
	"os/signal"
	"slices"
	"strings"

	"github.com/spf13/cobra"

	"github.com/blockexport/blockexport/formats/jobs/dd"
	"github.com/blockexport/blockexport/formats/registry"
)

type ddFlags struct {
	inspectFlags
	target     string
	forceShare bool
}

func ddCommand() *cobra.Command {
	var f ddFlags
	c := &cobra.Command{
		Use:   "dd [flags] [bs=BLOCK_SIZE] [count=BLOCKS] [skip=BLOCKS] if=INPUT of=OUTPUT",
		Short: "copy a range of blocks of an image into a new " + registry.OrList(registry.CreatableFormats()) + " image, as qemu-img dd",
		Long: "Copy INPUT into a new OUTPUT as qemu-img dd does, with its operands, messages and\n" +
			"exit status (0, or 1 on any error): bs= is the block size (default 512, at most\n" +
			"2^31-1), skip= the blocks skipped at INPUT's start, count= the blocks copied\n" +
			"counted from INPUT's start, as qemu-img counts them. OUTPUT is created (an\n" +
			"existing file is replaced) with the size copied. A skip past INPUT's end is\n" +
			"warned about and leaves OUTPUT empty, as in qemu-img.\n" + imageHelp,
		Example: "  blockexport dd -O qcow2 bs=1M count=64 if=disk.vmdk of=head.qcow2",
	}
	fs := c.Flags()
	fs.StringVarP(&f.target, "target-format", "O", registry.Raw, "OUTPUT's format: "+registry.OrList(registry.CreatableFormats()))
	fs.BoolVarP(&f.forceShare, "force-share", "U", false, "accepted for qemu-img's sake: INPUT is always opened without locks here")
	formatFlag(c, &f.format, formatUsage)
	f.src.register(c)
	completeWords(c, "target-format", registry.CreatableFormats()...)
	qemuStyle(c, func(c *cobra.Command, args []string) error { return f.run(c.ErrOrStderr(), args) })
	return c
}

func (f *ddFlags) run(stderr io.Writer, args []string) error {
	req := dd.Request{BlockSize: 512}
	var in, out string
	var haveIn, haveOut bool
	for _, a := range args {
		name, value, ok := strings.Cut(a, "=")
		if !ok {
			return qemuRefusal("unrecognized operand " + a)
		}
		var err error
		switch name {
		case "bs":
			req.BlockSize, err = cvtnum("bs", value, 1, math.MaxInt32)
		case "count":
			req.Count, err = cvtnum("count", value, 0, math.MaxInt64)
			req.HasCount = true
		case "skip":
			req.Skip, err = cvtnum("skip", value, 0, math.MaxInt64)
			req.HasSkip = true
		case "if":
			in, haveIn = value, true
		case "of":
			out, haveOut = value, true
		default:
			return qemuRefusal("unrecognized operand " + name)
		}
		if err != nil {
			return err
		}
	}
	if !haveIn || !haveOut {
		return qemuRefusal("Must specify both input and output files")
	}
	o, err := f.options()
	if err != nil {
		return err
	}
	src, err := openImage(in, o)
	if err != nil {
		return err
	}
	defer src.Image.Close()
	// The formats created here are the registry's; the others qemu-img
	// knows are refused by name.
	switch {
	case slices.Contains(registry.CreatableFormats(), f.target):
	case slices.Contains(registry.KnownFormats(), f.target):
		return fmt.Errorf("dd: %s output is not written here (want %s)", f.target, registry.OrList(registry.CreatableFormats()))
	default:
		return qemuRefusal("Unknown file format")
	}
	plan := req.Plan(src.Image.Size())
	// qemu-img creates the output with its size in whole sectors.
	size := (plan.OutputSize + 511) &^ 511
	if err := registry.Create(out, f.target, registry.CreateOptions{Size: size, Force: true}); err != nil {
		return qemuRefusal(fmt.Sprintf("%s: error while creating output image: %v", out, err))
	}
	dst, err := openImage(out, registry.Options{Format: f.target, Writable: true, Lock: true, Backend: "threads"})
	if err != nil {
		return err
	}
	defer dst.Image.Close()
	if plan.SkipPastEnd {
		fmt.Fprintf(stderr, "blockexport: %s: cannot skip to specified offset\n", in)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	return dd.Copy(ctx, src.Image, dst.Image, plan, req.BlockSize)
}
