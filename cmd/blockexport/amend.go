package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats/drivers/qcow2"
	"github.com/blockexport/blockexport/formats/jobs/resize"
	"github.com/blockexport/blockexport/formats/registry"
)

type amendFlags struct {
	format                 string
	options                []string
	progress, quiet, force bool
}

func amendCommand() *cobra.Command {
	var f amendFlags
	c := &cobra.Command{
		Use:   "amend [flags] -o OPTIONS IMAGE",
		Short: "change a qcow2 image's compat level, refcount width or lazy refcounts in place, as qemu-img amend",
		Long: "Change the options of a qcow2 image in place, as qemu-img amend does, with its\n" +
			"messages and exit status (0, or 1 on any error): compat=0.10|1.1 (a downgrade\n" +
			"turns zero clusters into data and refuses what version 2 cannot hold),\n" +
			"refcount_bits=1..64, lazy_refcounts=on|off and size. backing_file and backing_fmt\n" +
			"are accepted only unchanged (use rebase). Every change leaves the image\n" +
			"consistent if the process is killed. -o help lists the options.",
		Example: "  blockexport amend -o compat=0.10 disk.qcow2\n" +
			"  blockexport amend -o refcount_bits=64,lazy_refcounts=off disk.qcow2",
	}
	fs := c.Flags()
	fs.StringVarP(&f.format, "format", "f", "auto", "image format: qcow2 (default: detected)")
	fs.StringArrayVarP(&f.options, "options", "o", nil, "`KEY=VALUE[,...]` to change (help: list them); given again, the lists join")
	fs.BoolVarP(&f.progress, "progress", "p", false, "show progress")
	fs.BoolVarP(&f.quiet, "quiet", "q", false, "print nothing but errors")
	fs.BoolVar(&f.force, "force", false, "accepted as qemu-img's (it allows unsafe changes; none here needs it)")
	completeWords(c, "format", registry.QCOW2)
	qemuStyle(c, f.run)
	return c
}

func (f *amendFlags) run(c *cobra.Command, args []string) error {
	for _, o := range f.options {
		if !validOptionList(o) {
			return qemuRefusal("Invalid option list: " + o)
		}
	}
	if len(f.options) == 0 {
		return qemuRefusal("Must specify options (-o)", "Try 'blockexport --help' for more information")
	}
	opts := strings.Join(f.options, ",")
	if isHelpOption(opts) {
		if len(args) == 0 && f.format == registry.Auto {
			return qemuRefusal("Expecting one image file name")
		}
		fmt.Fprint(c.OutOrStdout(), qcow2.AmendHelp)
		return nil
	}
	if len(args) != 1 {
		return qemuRefusal("Expecting one image file name")
	}
	path := args[0]
	showProgress := f.progress && !f.quiet
	stderr := c.ErrOrStderr()
	err := registry.Amend(context.Background(), path, f.format,
		registry.Options{Lock: true, Backend: "threads", Logger: warnLogger(os.Stderr)},
		registry.AmendRequest{
			Options: func() (qcow2.AmendOptions, error) {
				o, err := amendOptions(f.options)
				if err == nil && showProgress {
					fmt.Fprint(c.OutOrStdout(), "    (0.00/100%)\r")
				}
				return o, err
			},
			Resize: amendResizer(path),
			Report: func(line string) { fmt.Fprintln(stderr, line) },
		})
	if err != nil {
		return amendError(path, err)
	}
	if showProgress {
		fmt.Fprintln(c.OutOrStdout(), "    (100.00/100%)")
	}
	return nil
}

// amendOptions reads -o as qemu-img amend does once the image is open.
func amendOptions(list []string) (qcow2.AmendOptions, error) {
	parsed, err := registry.ParseCreateOptions(list)
	if err != nil {
		return qcow2.AmendOptions{}, err
	}
	o, err := qcow2.ParseAmendOptions(parsed.Keys)
	if err != nil {
		return o, err
	}
	if parsed.Size >= 0 {
		o.Size = parsed.Size
	}
	if parsed.BackingFile != "" {
		o.BackingFile = &parsed.BackingFile
	}
	if parsed.BackingFormat != "" {
		o.BackingFormat = &parsed.BackingFormat
	}
	return o, nil
}

// amendResizer changes the size as amend does: to exactly the size given,
// shrinking without asking (amend has no --shrink).
func amendResizer(path string) qcow2.Resizer {
	return func(ctx context.Context, size int64) error {
		img, err := registry.Open(path, registry.Options{Format: registry.QCOW2, Writable: true, Backend: "threads"})
		if err != nil {
			return err
		}
		err = resize.Resize(ctx, img.Image, img.Format, resize.Request{Size: uint64(size), Shrink: true, Prealloc: resize.PreallocOff})
		if cerr := img.Image.Close(); err == nil {
			err = cerr
		}
		return err
	}
}

// validOptionList is qemu-img's is_valid_option_list: not empty, not
// starting with a comma, and not ending in an odd run of them (",," is
// an escaped comma).
func validOptionList(s string) bool {
	if s == "" || s[0] == ',' {
		return false
	}
	trailing := len(s) - len(strings.TrimRight(s, ","))
	return trailing%2 == 0
}

// isHelpOption: -o help (or ?) anywhere in the list, as qemu-img's
// has_help_option.
func isHelpOption(opts string) bool {
	for _, kv := range strings.Split(opts, ",") {
		if kv == "help" || kv == "?" {
			return true
		}
	}
	return false
}

// amendError words err as qemu-img amend does.
func amendError(path string, err error) error {
	var refusal *qcow2.AmendError
	var open *qcow2.AmendOpenError
	switch {
	case errors.As(err, &refusal):
		lines := refusal.Lines
		for i := range lines {
			lines[i] = strings.ReplaceAll(lines[i], "'qemu-img ", "'blockexport ")
		}
		return qemuRefusal(lines...)
	case errors.Is(err, aio.ErrInUse):
		return qemuRefusal(fmt.Sprintf("Could not open '%s': Failed to get \"write\" lock", path),
			fmt.Sprintf("Is another process using the image [%s]?", path))
	case errors.As(err, &open):
		return qemuRefusal(fmt.Sprintf("Could not open '%s': %v", path, open.Err))
	case errors.Is(err, registry.ErrNoAmend):
		return qemuRefusal(err.Error())
	}
	return err
}
