package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/blockexport/blockexport/formats/drivers/qcow2"
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
	fs.StringVar(&f.progress, "progress", "auto", "progress: bar (a rate and an ETA), json (one line per step), none, or auto (bar when stdout is a terminal, else json)")
	fs.BoolVarP(&f.bar, "progress-bar", "p", false, "the progress bar, terminal or not (--progress bar)")
	fs.IntVar(&f.parallel, "parallel", 4, "copy requests in flight (each holds up to 1 MiB)")
	f.src.register(c)
	f.src.registerTLS(c, "")
	completeWords(c, "progress", "auto", "bar", "json", "none")
	return c
}

func (f *streamFlags) run(c *cobra.Command, args []string) error {
	if len(args) != 1 {
		return usagef("stream: want one OVERLAY, got %d argument(s)", len(args))
	}
	overlay := args[0]
	out := c.OutOrStdout()
	mode := f.progress
	if f.bar {
		if c.Flags().Changed("progress") && mode != "bar" {
			return usagef("-p is --progress bar: drop one of -p and --progress %s", mode)
		}
		mode = "bar"
	}
	switch mode {
	case "auto":
		mode = "json"
		if fd, ok := out.(*os.File); ok && term.IsTerminal(int(fd.Fd())) {
			mode = "bar"
		}
	case "bar", "json", "none":
	default:
		return usagef("unknown --progress %q (want auto, bar, json or none)", f.progress)
	}
	if f.parallel < 1 || f.parallel > 64 {
		return usagef("--parallel %d: want 1 to 64", f.parallel)
	}
	nbdOpts, err := f.src.options()
	if err != nil {
		return err
	}
	remoteOpts, err := f.src.remote()
	if err != nil {
		return err
	}
	o := registry.Options{Lock: true, Format: registry.QCOW2, Writable: true, Backend: "threads", NBD: nbdOpts,
		Logger: warnLogger(c.ErrOrStderr()), RelatedDirs: f.src.allowDirs, Remote: remoteOpts}
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
	p := newStreamProgress(mode, out)
	err = stream.Stream(ctx, img.Image, stream.StreamOptions{Parallel: f.parallel, Planned: p.planned, Progress: p.step})
	p.finish(err == nil)
	switch {
	case errors.Is(err, stream.ErrNoBackingFile):
		fmt.Fprintf(c.ErrOrStderr(), "blockexport: stream: %s has no backing file: nothing to stream\n", overlay)
		return nil
	case ctx.Err() != nil && errors.Is(err, context.Canceled) && !p.wasPlanned:
		return fmt.Errorf("stream %s interrupted before copying anything (while planning); run it again", overlay)
	case ctx.Err() != nil && errors.Is(err, context.Canceled):
		return fmt.Errorf("stream %s interrupted: %d of %d bytes copied and flushed; run it again to copy the rest", overlay, p.done, p.total)
	case err != nil:
		return fmt.Errorf("stream %s: %w", overlay, err)
	}
	closed = true
	if err := img.Image.Close(); err != nil {
		return fmt.Errorf("stream %s: %w", overlay, err)
	}
	if mode != "json" {
		fmt.Fprintf(c.ErrOrStderr(), "blockexport: stream: %s copied %d bytes and no longer has a backing file\n", overlay, p.done)
	}
	return nil
}

// streamProgress shows a stream's progress: a bar, or one JSON object a
// line.
type streamProgress struct {
	mode        string
	out         io.Writer
	bar         *progressbar.ProgressBar
	enc         *json.Encoder
	start       time.Time
	done, total int64
	wasPlanned  bool // planned was called: total is known
}

func newStreamProgress(mode string, out io.Writer) *streamProgress {
	return &streamProgress{mode: mode, out: out, enc: json.NewEncoder(out), start: time.Now()}
}

// streamStep is a JSON progress line.
type streamStep struct {
	Event  string `json:"event"`
	Offset int64  `json:"offset,omitempty"`
	Length int64  `json:"length,omitempty"`
	Done   int64  `json:"done"`
	// Durable: of done, the bytes a flush has made durable, which a
	// rerun after a kill will not copy again.
	Durable int64   `json:"durable"`
	Total   int64   `json:"total"`
	Rate    float64 `json:"bytes-per-second"`
	ETA     float64 `json:"eta-seconds"`
}

func (p *streamProgress) planned(total int64) {
	p.total, p.wasPlanned = total, true
	switch p.mode {
	case "bar":
		p.bar = progressbar.NewOptions64(total, progressbar.OptionSetWriter(p.out), progressbar.OptionShowBytes(true),
			progressbar.OptionSetPredictTime(true), progressbar.OptionShowCount(), progressbar.OptionSetDescription("stream"),
			progressbar.OptionThrottle(100*time.Millisecond), progressbar.OptionFullWidth(),
			progressbar.OptionOnCompletion(func() { fmt.Fprintln(p.out) }))
	case "json":
		p.enc.Encode(streamStep{Event: "planned", Total: total})
	}
}

func (p *streamProgress) step(off, n, done, durable, total int64) {
	p.done = done
	switch p.mode {
	case "bar":
		p.bar.Set64(done)
	case "json":
		s := streamStep{Event: "step", Offset: off, Length: n, Done: done, Durable: durable, Total: total}
		if el := time.Since(p.start).Seconds(); el > 0 && done > 0 {
			s.Rate = float64(done) / el
			s.ETA = float64(total-done) / s.Rate
		}
		p.enc.Encode(s)
	}
}

func (p *streamProgress) finish(ok bool) {
	switch p.mode {
	case "bar":
		if p.bar != nil {
			if ok {
				p.bar.Finish()
			} else {
				fmt.Fprintln(p.out)
			}
		}
	case "json":
		if ok {
			// Everything copied is durable once the header has changed.
			p.enc.Encode(streamStep{Event: "completed", Done: p.done, Durable: p.done, Total: p.total})
		}
	}
}
