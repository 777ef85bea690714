package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"

	"github.com/spf13/cobra"

	"github.com/blockexport/blockexport/formats/jobs/convert"
	"github.com/blockexport/blockexport/formats/registry"
)

// Exit statuses of compare, qemu-img compare's.
const (
	compareSame      = 0
	compareDifferent = 1
	compareError     = 2
)

type compareFlags struct {
	inspectFlags
	formatB    string
	strict     bool
	quiet      bool
	progress   bool
	parallel   int
	cpuprofile string
}

func compareCommand() *cobra.Command {
	var f compareFlags
	c := &cobra.Command{
		Use:   "compare [flags] IMAGE1 IMAGE2",
		Short: "compare two images' contents, as qemu-img compare does",
		Long: "Compare the contents of IMAGE1 and IMAGE2 as qemu-img compare does, reading only\n" +
			"what block status does not show to be zeroes on either side. Images of different\n" +
			"sizes are the same when the larger one's extra part reads as zeroes (not with -s).\n" +
			"Exit status, as qemu-img compare's: 0 identical, 1 different (the first differing\n" +
			"offset is printed), 2 an error (or a usage error).\n" + imageHelp,
		Example: "  blockexport compare disk.vmdk disk.qcow2\n" +
			"  blockexport compare -s --output=json a.qcow2 b.qcow2",
	}
	fs := c.Flags()
	fs.StringVarP(&f.formatB, "second-format", "F", "auto", "IMAGE2's format (as -f is IMAGE1's)")
	fs.BoolVarP(&f.strict, "strict", "s", false, "strict: the sizes and the allocation (block status) must match too")
	fs.BoolVarP(&f.quiet, "quiet", "q", false, "print nothing; the exit status says it")
	fs.BoolVarP(&f.progress, "progress", "p", false, "show progress on stderr")
	fs.IntVarP(&f.parallel, "parallel", "m", 8, "reads in flight")
	fs.StringVar(&f.cpuprofile, "cpuprofile", "", "write a Go CPU profile to this file (for go tool pprof)")
	fs.MarkHidden("cpuprofile")
	f.register(c)
	completeWords(c, "second-format", append([]string{registry.Auto}, registry.FileFormats()...)...)
	c.SetFlagErrorFunc(func(c *cobra.Command, err error) error {
		fmt.Fprintf(c.ErrOrStderr(), "blockexport: %v\n", err)
		return exitStatus(compareError)
	})
	c.RunE = func(c *cobra.Command, args []string) error {
		err := compareCmd(c.OutOrStdout(), c.ErrOrStderr(), args, &f)
		if _, ok := err.(exitStatus); err != nil && !ok {
			// qemu-img compare exits 2 on any error, usage ones too.
			fmt.Fprintf(c.ErrOrStderr(), "blockexport: compare: %v\n", err)
			return exitStatus(compareError)
		}
		return err
	}
	return c
}

func compareCmd(stdout, stderr io.Writer, args []string, f *compareFlags) error {
	asJSON, err := f.out.json()
	if err != nil {
		return err
	}
	if len(args) != 2 {
		return usagef("want IMAGE1 IMAGE2, got %d argument(s)", len(args))
	}
	if f.parallel < 1 || f.parallel > 64 {
		return usagef("-m %d: want 1 to 64", f.parallel)
	}
	stopProfile, err := startCPUProfile(f.cpuprofile)
	if err != nil {
		return err
	}
	defer stopProfile()
	o, err := f.options()
	if err != nil {
		return err
	}
	a, err := openImage(args[0], o)
	if err != nil {
		return err // it names the image
	}
	defer a.Image.Close()
	if _, err := registry.ParseFormat(f.formatB); err != nil {
		return usageError{err}
	}
	o.Format = f.formatB
	b, err := openImage(args[1], o)
	if err != nil {
		return err
	}
	defer b.Image.Close()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	co := convert.CompareOptions{Strict: f.strict, Parallel: f.parallel}
	if f.progress && !asJSON {
		co.Progress = progressTo(stderr)
	}
	r, err := convert.Compare(ctx, a.Image, b.Image, co)
	if err != nil {
		return err
	}
	status := compareSame
	if !r.Identical {
		status = compareDifferent
	}
	switch {
	case f.quiet:
	case asJSON:
		j, err := json.Marshal(r)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "%s\n", j)
	default:
		for _, l := range r.Lines() {
			fmt.Fprintln(stdout, l)
		}
	}
	return exitStatus(status)
}
