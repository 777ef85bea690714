package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/jobs/commit"
	"github.com/blockexport/blockexport/formats/jobs/progress"
	"github.com/blockexport/blockexport/formats/registry"
)

type commitFlags struct {
	format, cache, base, rate string
	keep, bar, quiet          bool
	parallel                  int
}

func commitCommand() *cobra.Command {
	var f commitFlags
	c := &cobra.Command{
		Use:   "commit [-f FMT] [-t CACHE] [-b BASE] [-d] [-p] [-q] [-r RATE_LIMIT] FILENAME",
		Short: "write an overlay's data into its backing file, as qemu-img commit",
		Long: "Write what FILENAME allocates into its backing file (or into BASE, further down its\n" +
			"backing chain, with every layer between), growing the backing file to FILENAME's\n" +
			"size when it is shorter; then empty FILENAME, unless -d (-b implies -d), as\n" +
			"qemu-img commit. The backing file is written only where FILENAME's layers hide\n" +
			"it, and made durable before FILENAME gives back a cluster: interrupted (SIGINT,\n" +
			"SIGTERM: exit 130) or killed at any point, FILENAME reads as before.",
		Example: "  blockexport commit overlay.qcow2\n" +
			"  blockexport commit -p -b base.qcow2 top.qcow2",
		RunE: func(c *cobra.Command, args []string) error { return f.run(c, args) },
	}
	fs := c.Flags()
	fs.StringVarP(&f.format, "format", "f", "", "FILENAME's format (qcow2; default: detected)")
	fs.StringVarP(&f.cache, "cache", "t", "unsafe", "cache mode: none (O_DIRECT), writeback, writethrough, directsync, unsafe")
	fs.StringVarP(&f.base, "base", "b", "", "the image of the backing chain to commit into (default: the backing file); implies -d")
	fs.BoolVarP(&f.keep, "keep", "d", false, "do not empty FILENAME afterwards")
	fs.BoolVarP(&f.bar, "progress", "p", false, "print qemu-img's progress, \"    (P/100%)\\r\", on stdout")
	fs.BoolVarP(&f.quiet, "quiet", "q", false, "no progress and no \"Image committed.\"")
	fs.StringVarP(&f.rate, "rate-limit", "r", "", "bytes a second at most (k, M, G suffixes)")
	fs.IntVar(&f.parallel, "parallel", 8, "chunks of 2 MiB copied at once")
	completeWords(c, "format", registry.QCOW2)
	completeWords(c, "cache", cacheModes...)
	return c
}

func (f *commitFlags) run(c *cobra.Command, args []string) error {
	if len(args) != 1 {
		return errors.New("Expecting one image file name")
	}
	name := args[0]
	direct, err := directCache(f.cache)
	if err != nil {
		return err
	}
	var rate int64
	if f.rate != "" {
		if rate, err = registry.ParseSize(f.rate); err != nil || rate <= 0 {
			return errors.New("Invalid rate limit specified. You may use k, M, G, T, P or E suffixes for kilobytes, megabytes, gigabytes, terabytes, petabytes and exabytes.")
		}
	}
	if f.parallel < 1 || f.parallel > 64 {
		return usagef("--parallel %d: want 1 to 64", f.parallel)
	}
	format := f.format
	if format == "" {
		format = registry.Auto
	}
	drop := !f.keep && !c.Flags().Changed("base") // -b implies -d, as in qemu-img
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	// The chain is opened without image locks, and locked by lockChain
	// apart: its base is opened again to be written, and a read-only lock
	// of this open would refuse that.
	o := registry.Options{Format: format, Writable: drop, Direct: direct, Backend: "threads",
		Logger: warnLogger(c.ErrOrStderr())}
	top, err := openImage(name, o)
	if err != nil {
		return fmt.Errorf("Could not open '%s': %w", name, err)
	}
	defer top.Image.Close()
	locks, err := lockChain(top.Image, name)
	defer locks.release()
	if err != nil {
		return err
	}
	basePath, baseFormat, depth, err := findBase(top.Image, f.base, c.Flags().Changed("base"))
	if err != nil {
		return fmt.Errorf("%w", err)
	}
	if baseFormat == "" {
		baseFormat = registry.Auto
	}
	// The base's read lock goes, as QEMU's reopen of the base read-write
	// changes its lock: the writable open takes its own.
	locks.drop(depth)
	bo := o
	bo.Format, bo.Writable, bo.Lock = baseFormat, true, true
	base, err := openImage(basePath, bo)
	if err != nil {
		if le := (*aio.LockError)(nil); errors.As(err, &le) {
			return lockRefusal(le, basePath)
		}
		return fmt.Errorf("Could not open '%s': %w", basePath, err)
	}
	defer base.Image.Close()
	p := progress.New(f.progressMode(), "commit", c.OutOrStdout(), c.ErrOrStderr())
	co := commit.Options{Parallel: f.parallel, Rate: rate, Drop: drop}
	if p.Mode() != progress.None { // without -p, Commit skips the walk that sums the total
		co.Progress = func(done, total int64) {
			if done < total { // the 100% is Finish's, once, as qemu-img prints it
				p.Update(done, total)
			}
		}
	}
	err = commit.Commit(ctx, top.Image, base.Image, depth, co)
	p.Finish(err == nil, -1)
	switch {
	case ctx.Err() != nil && errors.Is(err, context.Canceled):
		fmt.Fprintf(c.ErrOrStderr(), "blockexport: commit %s interrupted: it reads as before (what was written is flushed); run it again\n", name)
		return exitStatus(exitInterrupted)
	case err != nil:
		return fmt.Errorf("Error while committing %s: %w", name, err)
	}
	if err := base.Image.Close(); err != nil {
		return fmt.Errorf("commit %s: close %s: %w", name, basePath, err)
	}
	if !f.quiet {
		fmt.Fprintln(c.OutOrStdout(), "Image committed.")
	}
	return nil
}

// chainLocks hold QEMU's image locks on the local layers of a chain, top
// first; nil where a layer is not a local file or its lock was dropped.
type chainLocks []aio.File

// lockChain takes the image locks qemu-img commit holds on name's chain
// once it has opened it: the top layer writable (qemu-img opens it
// read-write even with -d), every layer below for reading. qemu-img's top
// shares writes with others, and so then do the layers below it
// (bdrv_default_perms_for_cow): only a format with metadata (qcow2)
// refuses others' writes to its own file, so a raw base another process
// writes does not refuse a commit, as in QEMU. A lock refused is
// qemu-img's refusal, in its words, with the layer's depth in its "Could
// not open backing file"s.
func lockChain(top formats.Image, name string) (chainLocks, error) {
	var locks chainLocks
	layer, path := top, name
	for depth := 0; layer != nil; depth++ {
		var lf aio.File
		l, ok := registry.LockFor(layer.Info().Format, depth == 0, false)
		if st, err := os.Stat(path); ok && err == nil && st.Mode().IsRegular() {
			f, err := aio.Open(path, aio.Options{Backend: aio.Threads, Lock: &l})
			if err != nil {
				if le := (*aio.LockError)(nil); errors.As(err, &le) {
					return locks, fmt.Errorf("Could not open '%s': %s%w", name, strings.Repeat("Could not open backing file: ", depth), lockRefusal(le, path))
				}
				return locks, fmt.Errorf("Could not open '%s': %w", name, err)
			}
			lf = f
		}
		locks = append(locks, lf)
		below, ok := layer.(formats.Layered)
		if !ok || below.Backing() == nil {
			break
		}
		path = cmp.Or(layer.Info().FullBackingFilename, below.Backing().Info().Filename)
		layer = below.Backing()
	}
	return locks, nil
}

// drop lets go of the lock on the layer at depth.
func (l chainLocks) drop(depth int) {
	if depth < len(l) && l[depth] != nil {
		l[depth].Close()
		l[depth] = nil
	}
}

func (l chainLocks) release() {
	for i := range l {
		l.drop(i)
	}
}

// lockRefusal words a refused lock on path as QEMU does.
func lockRefusal(le *aio.LockError, path string) error {
	shared := ""
	if le.Shared {
		shared = "shared "
	}
	return fmt.Errorf("Failed to get %s\"%s\" lock\nIs another process using the image [%s]?", shared, le.Perm, path)
}

func (f *commitFlags) progressMode() progress.Mode {
	if f.bar && !f.quiet {
		return progress.Percent
	}
	return progress.None
}

// findBase finds the image to commit into: top's backing file, or the
// layer of its chain that base names (as qemu's bdrv_find_backing_image:
// the name a header holds, or a path relative to that layer's directory
// that is the same file). It returns its path, format and depth.
func findBase(top formats.Image, base string, given bool) (string, string, int, error) {
	layer, depth := top, 0
	for {
		l, ok := layer.(formats.Layered)
		if !ok || l.Backing() == nil {
			if depth == 0 {
				return "", "", 0, errors.New("Image does not have a backing file")
			}
			return "", "", 0, fmt.Errorf("Did not find '%s' in the backing chain of '%s'", base, top.Info().Filename)
		}
		info := layer.Info()
		depth++
		full := info.FullBackingFilename
		if full == "" {
			full = l.Backing().Info().Filename
		}
		if !given || info.BackingFilename == base || commit.NamesFile(info.Filename, base, full) {
			return full, info.BackingFilenameFormat, depth, nil
		}
		layer = l.Backing()
	}
}
