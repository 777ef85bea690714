package main

import (
	"context"
	"errors"
	"fmt"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/blockexport/blockexport/formats/drivers/qcow2"
	"github.com/blockexport/blockexport/formats/jobs/progress"
	"github.com/blockexport/blockexport/formats/jobs/stream"
	"github.com/blockexport/blockexport/formats/registry"
)

type streamFlags struct {
	progress string
	bar      bool
	parallel int
	src      sourceFlags
}

func streamCommand() *cobra.Command {
	var f streamFlags
	c := &cobra.Command{
		Use:   "stream [flags] OVERLAY",
		Short: "copy a qcow2 overlay's backing chain into it, then drop the backing file",
		Long: "Copy every range a qcow2 overlay does not hold, and its backing chain does, into\n" +
			"the overlay, then rewrite its header without the backing file, as QEMU's\n" +
			"block-stream job does (with no base). The copies are durable before the header\n" +
			"changes. Interrupted (SIGINT, SIGTERM: the copies so far are flushed; or killed),\n" +
			"a second run copies only what is still missing. Clusters a killed run leaked are\n" +
			"repaired first, as qemu-img check -r leaks would.",
		Example: "  blockexport stream -p overlay.qcow2\n" +
			"  blockexport stream --progress json overlay.qcow2 | tail -1",
		RunE: func(c *cobra.Command, args []string) error { return f.run(c, args) },
	}
	fs := c.Flags()
	fs.StringVar(&f.progress, "progress", "auto", "progress: bar (a rate and an ETA, on stderr), json (one JSON object per step on stdout), percent (qemu-img's \"    (P/100%)\\r\" on stdout), none, or auto (bar when stderr is a terminal, else none)")
	fs.BoolVarP(&f.bar, "progress-bar", "p", false, "the progress bar, terminal or not (--progress bar)")
	fs.IntVar(&f.parallel, "parallel", 4, "copy requests in flight (each holds up to 1 MiB)")
	f.src.register(c)
	f.src.registerTLS(c, "")
	completeWords(c, "progress", progress.Modes...)
	return c
}

func (f *streamFlags) run(c *cobra.Command, args []string) error {
	if len(args) != 1 {
		return usagef("stream: want one OVERLAY, got %d argument(s)", len(args))
	}
	overlay := args[0]
	mode := f.progress
	if f.bar {
		if c.Flags().Changed("progress") && mode != "bar" {
			return usagef("-p is --progress bar: drop one of -p and --progress %s", mode)
		}
		mode = "bar"
	}
	pm, err := progress.ParseMode(mode, c.ErrOrStderr())
	if err != nil {
		return usageError{err}
	}
	if f.parallel < 1 || f.parallel > 64 {
		return usagef("--parallel %d: want 1 to 64", f.parallel)
	}
	o, err := f.src.options()
	if err != nil {
		return err
	}
	o.Lock, o.Format, o.Writable, o.Backend, o.Logger = true, registry.QCOW2, true, "threads", warnLogger(c.ErrOrStderr())
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	// A run killed before may have leaked clusters (allocated, not yet
	// linked): give them back, so that the image checks clean once done.
	res, err := registry.Check(ctx, overlay, registry.Options{Lock: true, Format: registry.QCOW2, Backend: "threads"}, qcow2.RepairLeaks)
	if err != nil {
		if errors.Is(err, registry.ErrBadSpec) {
			return usageError{err}
		}
		if ctx.Err() != nil && errors.Is(err, context.Canceled) {
			return fmt.Errorf("stream %s interrupted before copying anything (while checking for leaked clusters); run it again", overlay)
		}
		return fmt.Errorf("stream: %w", err) // it names the image
	}
	if res.Corruptions > 0 || res.CheckErrors > 0 {
		return fmt.Errorf("stream %s: the image is damaged (%d corruptions): see blockexport check", overlay, res.Corruptions)
	}
	if res.LeaksFixed > 0 {
		fmt.Fprintf(c.ErrOrStderr(), "blockexport: stream: gave back %d leaked clusters (an interrupted run's)\n", res.LeaksFixed)
	}

	img, err := openImage(overlay, o)
	if err != nil {
		return err
	}
	closed := false
	defer func() {
		if !closed {
			img.Image.Close()
		}
	}()
	p := progress.New(pm, "stream", c.OutOrStdout(), c.ErrOrStderr())
	p.EveryStep = true
	var planned bool
	var done, total int64
	err = stream.Stream(ctx, img.Image, stream.StreamOptions{Parallel: f.parallel,
		Planned: func(n int64) { planned, total = true, n; p.Planned(n) },
		Progress: func(off, n, d, durable, t int64) {
			done = d
			p.Step(progress.Line{Offset: off, Length: n, Done: d, Durable: &durable, Total: t})
		}})
	// Everything copied is durable once the header has changed.
	p.Finish(err == nil, done)
	switch {
	case errors.Is(err, stream.ErrNoBackingFile):
		fmt.Fprintf(c.ErrOrStderr(), "blockexport: stream: %s has no backing file: nothing to stream\n", overlay)
		return nil
	case ctx.Err() != nil && errors.Is(err, context.Canceled) && !planned:
		return fmt.Errorf("stream %s interrupted before copying anything (while planning); run it again", overlay)
	case ctx.Err() != nil && errors.Is(err, context.Canceled):
		return fmt.Errorf("stream %s interrupted: %d of %d bytes copied and flushed; run it again to copy the rest", overlay, done, total)
	case err != nil:
		return fmt.Errorf("stream %s: %w", overlay, err)
	}
	closed = true
	if err := img.Image.Close(); err != nil {
		return fmt.Errorf("stream %s: %w", overlay, err)
	}
	if pm != progress.JSON {
		fmt.Fprintf(c.ErrOrStderr(), "blockexport: stream: %s copied %d bytes and no longer has a backing file\n", overlay, done)
	}
	return nil
}
