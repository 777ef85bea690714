package main

import (
	"context"
	"errors"
	"fmt"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/qcow2"
	"github.com/blockexport/blockexport/formats/jobs/commit"
	"github.com/blockexport/blockexport/formats/jobs/progress"
	"github.com/blockexport/blockexport/formats/jobs/rebase"
	"github.com/blockexport/blockexport/formats/registry"
)

type rebaseFlags struct {
	format, cache, srcCache string
	backing, backingFormat  string
	bar, quiet, unsafe      bool
	parallel                int
}

func rebaseCommand() *cobra.Command {
	var f rebaseFlags
	c := &cobra.Command{
		Use:   "rebase [-f FMT] [-t CACHE] [-T SRC_CACHE] [-p] [-q] [-u] [-b BACKING_FILE [-F BACKING_FMT]] FILENAME",
		Short: "change a qcow2 image's backing file, as qemu-img rebase",
		Long: "Change the backing file of a qcow2 image, as qemu-img rebase. Safe mode (the\n" +
			"default) first copies into FILENAME every cluster it does not hold where its old\n" +
			"backing chain and BACKING_FILE read differently, so that it reads the same; -u\n" +
			"only rewrites the name and format. -b '' makes the image stand alone. A relative\n" +
			"BACKING_FILE is relative to FILENAME's directory. The data is durable before the\n" +
			"header changes; interrupted (SIGINT, SIGTERM: exit 130) or killed, the image\n" +
			"still reads the same over its old backing file.",
		Example: "  blockexport rebase -b base.qcow2 -F qcow2 overlay.qcow2\n" +
			"  blockexport rebase -u -b moved/base.raw -F raw overlay.qcow2\n" +
			"  blockexport rebase -p -b '' overlay.qcow2",
		RunE: func(c *cobra.Command, args []string) error { return f.run(c, args) },
	}
	fs := c.Flags()
	fs.StringVarP(&f.format, "format", "f", "", "the image's format (qcow2; default: detected)")
	fs.StringVarP(&f.cache, "cache", "t", "writeback", "cache mode of FILENAME: none (O_DIRECT), writeback, writethrough, directsync, unsafe")
	fs.StringVarP(&f.srcCache, "source-cache", "T", "writeback", "cache mode of the backing files (the same values)")
	fs.StringVarP(&f.backing, "backing", "b", "", "the new backing file ('' for none)")
	fs.StringVarP(&f.backingFormat, "backing-format", "F", "", "the new backing file's format")
	fs.BoolVarP(&f.bar, "progress", "p", false, "print qemu-img's progress, \"    (P/100%)\\r\", on stdout")
	fs.BoolVarP(&f.quiet, "quiet", "q", false, "no progress")
	fs.BoolVarP(&f.unsafe, "unsafe", "u", false, "only rewrite the backing file's name and format")
	fs.IntVar(&f.parallel, "parallel", 8, "chunks of 2 MiB compared and copied at once")
	completeWords(c, "format", registry.QCOW2)
	completeWords(c, "cache", cacheModes...)
	completeWords(c, "source-cache", cacheModes...)
	return c
}

// cacheModes are qemu-img's -t and -T values.
var cacheModes = []string{"none", "writeback", "writethrough", "directsync", "unsafe"}

// directCache says whether a cache mode bypasses the host's page cache.
func directCache(mode string) (bool, error) {
	switch mode {
	case "none", "directsync":
		return true, nil
	case "writeback", "writethrough", "unsafe":
		return false, nil
	}
	return false, fmt.Errorf("Invalid cache option: %s", mode)
}

func (f *rebaseFlags) run(c *cobra.Command, args []string) error {
	if len(args) != 1 {
		return errors.New("Expecting one image file name")
	}
	name := args[0]
	if !f.unsafe && !c.Flags().Changed("backing") {
		return errors.New("Must specify backing file (-b) or use unsafe mode (-u)")
	}
	direct, err := directCache(f.cache)
	if err != nil {
		return err
	}
	if _, err := directCache(f.srcCache); err != nil {
		return err
	}
	if f.parallel < 1 || f.parallel > 64 {
		return usagef("--parallel %d: want 1 to 64", f.parallel)
	}
	format := f.format
	if format == "" {
		format = registry.Auto
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	o := registry.Options{Format: format, Writable: true, Lock: true, Direct: direct, Backend: "threads",
		Logger: warnLogger(c.ErrOrStderr()), NoBacking: f.unsafe}
	if !f.unsafe {
		// The chain is opened once without locks first, so that a loop in
		// it is named as one, not as our own lock on a file seen twice.
		ro := o
		ro.Writable, ro.Lock = false, false
		img, err := openImage(name, ro)
		if err != nil {
			return fmt.Errorf("Could not open '%s': %w", name, err)
		}
		img.Image.Close()
	}
	img, err := openImage(name, o)
	if err != nil {
		return fmt.Errorf("Could not open '%s': %w", name, err)
	}
	defer img.Image.Close()
	q, ok := img.Image.(*qcow2.Image)
	if !ok {
		return fmt.Errorf("Could not change the backing file to '%s': Operation not supported", f.backing)
	}
	if f.backing != "" && f.backingFormat == "" {
		if !f.unsafe {
			// Opened first, as qemu-img does: a missing file is said first.
			nb, err := openNewBacking(name, f.backing, "", o)
			if err != nil {
				return err
			}
			nb.Close()
		}
		return fmt.Errorf("Could not change the backing file to '%s': backing format must be specified", f.backing)
	}
	if !f.unsafe {
		var nb formats.Image
		if f.backing != "" {
			if nb, err = openNewBacking(name, f.backing, f.backingFormat, o); err != nil {
				return err
			}
			defer nb.Close()
		}
		p := progress.New(f.progressMode(), "rebase", c.OutOrStdout(), c.ErrOrStderr())
		_, err = rebase.Copy(ctx, q, nb, rebase.Options{Parallel: f.parallel, Granularity: q.Info().ClusterSize,
			SharedDepth: depthInChain(q, nb, f.backingFormat),
			Progress:    func(done, total int64) { p.Update(done, total) }})
		p.Finish(err == nil, -1)
		switch {
		case ctx.Err() != nil && errors.Is(err, context.Canceled):
			fmt.Fprintf(c.ErrOrStderr(), "blockexport: rebase %s interrupted: it still names its old backing file and reads the same; run it again\n", name)
			return exitStatus(exitInterrupted)
		case err != nil:
			return fmt.Errorf("Error while rebasing %s: %w", name, err)
		}
	}
	if err := q.SetBacking(ctx, f.backing, f.backingFormat); err != nil {
		return fmt.Errorf("Could not change the backing file to '%s': %w", f.backing, err)
	}
	if err := q.Flush(ctx); err != nil {
		return fmt.Errorf("rebase %s: %w", name, err)
	}
	return nil
}

func (f *rebaseFlags) progressMode() progress.Mode {
	if f.bar && !f.quiet {
		return progress.Percent
	}
	return progress.None
}

// openNewBacking opens backing, as the image named image would name it (a
// relative name is relative to its directory), read-only.
func openNewBacking(image, backing, format string, o registry.Options) (formats.Image, error) {
	path := backing
	if !filepath.IsAbs(path) && !strings.Contains(path, "://") {
		path = filepath.Join(filepath.Dir(image), backing)
	}
	if format == "" {
		format = registry.Auto
	}
	o.Format, o.Writable, o.NoBacking, o.Direct = format, false, false, false
	nb, err := registry.Open(path, o)
	if err != nil {
		return nil, fmt.Errorf("Could not open new backing file '%s': %w", path, err)
	}
	return nb.Image, nil
}

// depthInChain is the depth of the image newBacking in img's backing
// chain, where the chain holds the same file in the same format; 0 when
// it does not (or newBacking is nil).
func depthInChain(img, newBacking formats.Image, format string) int {
	if newBacking == nil {
		return 0
	}
	want := newBacking.Info().Filename
	layer := img
	for depth := 1; ; depth++ {
		l, ok := layer.(formats.Layered)
		if !ok || l.Backing() == nil {
			return 0
		}
		layer = l.Backing()
		info := layer.Info()
		if info.Format == format && commit.SameFile(info.Filename, want) {
			return depth
		}
	}
}
