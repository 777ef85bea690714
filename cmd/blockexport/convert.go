package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/blockexport/blockexport/formats/jobs/convert"
	"github.com/blockexport/blockexport/formats/jobs/progress"
	"github.com/blockexport/blockexport/formats/registry"
)

// exitInterrupted is convert's status after SIGINT (128 + SIGINT, as a
// shell reports a command the signal ended).
const exitInterrupted = 130

type convertFlags struct {
	inspectFlags
	outFormat     string
	outFormatSet  bool // -O given: with -n, TARGET is opened as that
	options       []string
	compress      bool
	showProgress  bool
	progressFmt   string
	parallel      int
	outOfOrder    bool
	noCreate      bool
	sparse        string
	backing       string
	backingFormat string
	targetIsZero  bool
	cache         string
	cpuprofile    string
	chunk         string
}

func convertCommand() *cobra.Command {
	var f convertFlags
	c := &cobra.Command{
		Use:   "convert [flags] SOURCE TARGET",
		Short: "convert an image to " + registry.OrList(registry.CreatableFormats()) + ", as qemu-img convert does",
		Long: "Convert SOURCE (any image blockexport reads, a file or an NBD export) into TARGET,\n" +
			"a new " + registry.OrList(registry.CreatableFormats()) + " file (-O), or an existing image or NBD export with -n, with\n" +
			"qemu-img convert's flags. The source's block status drives the copy: holes and\n" +
			"zero runs are neither read nor written; -S finds zeroes inside data.\n" +
			"Memory: at most (-m or, with -c, the CPU count) x 256 KiB buffers (2 MiB with -t none; or a cluster,\n" +
			"or -S, if larger),\n" +
			"twice that with -B.\n" +
			"Progress: -p prints qemu-img's \"    (12.34/100%)\\r\" lines on stdout, terminal or not;\n" +
			"--progress bar draws a bar with rate and ETA on stderr, --progress json prints one\n" +
			"JSON object per percent on stdout: {\"event\":\"step\",\"done\":B,\"total\":B,\"percent\":P,\n" +
			"\"bytes-per-second\":R,\"eta-seconds\":S}, as stream's.\n" +
			"SIGINT (or SIGTERM) stops it: a new raw TARGET is truncated to what was converted, a qcow2 one\n" +
			"is left consistent; exit 130. " + imageHelp,
		Example: "  blockexport convert -O qcow2 -c -o compression_type=zstd disk.raw disk.qcow2\n" +
			"  blockexport convert -p -m 16 -W disk.vmdk disk.raw",
	}
	fs := c.Flags()
	fs.StringVarP(&f.outFormat, "output-format", "O", "raw", "TARGET's format: "+registry.OrList(registry.CreatableFormats())+" (with -n: TARGET's format, as it is opened)")
	fs.StringArrayVarP(&f.options, "options", "o", nil, "TARGET's creation options, as qemu-img's -o KEY=VALUE,...: backing_file, backing_fmt, and the format's own ("+registry.CreateKeysHelp()+")")
	fs.BoolVarP(&f.compress, "compress", "c", false, "store TARGET's data clusters compressed, where its format takes compressed clusters, on all cores")
	fs.BoolVarP(&f.showProgress, "show-progress", "p", false, "show progress as qemu-img does: \"    (P/100%)\\r\" on stdout (--progress percent)")
	fs.StringVar(&f.progressFmt, "progress", "", "progress: percent (as -p), bar (on stderr), json (one JSON object per percent on stdout), none, or auto (bar when stderr is a terminal, else none)")
	completeWords(c, "progress", progress.Modes...)
	fs.IntVarP(&f.parallel, "parallel", "m", 8, "requests in flight (qemu-img's -m; 1 to 64)")
	fs.BoolVarP(&f.outOfOrder, "out-of-order", "W", false, "let writes complete out of order")
	fs.BoolVarP(&f.noCreate, "no-create", "n", false, "write into an existing TARGET (a file or nbd://...) instead of creating it")
	fs.StringVarP(&f.sparse, "sparse-size", "S", "4k", "zero runs inside data at least this long (a multiple of 512) are not written; 0 writes all data")
	fs.StringVarP(&f.backing, "backing", "B", "", "TARGET's backing file (qcow2): only what differs from it is written")
	fs.StringVarP(&f.backingFormat, "backing-format", "F", "", "format of the backing file: "+registry.OrList(registry.FileFormats())+" (default: detected)")
	fs.BoolVar(&f.targetIsZero, "target-is-zero", false, "with -n: TARGET reads as zeroes already, so zeroes need not be written")
	fs.StringVarP(&f.cache, "target-cache", "t", "unsafe", "TARGET's cache mode, qemu-img's: unsafe (no flush at the end, qemu-img convert's default), writeback (flushed at the end) or none (O_DIRECT, flushed; not with -c, whose clusters lie at any byte)")
	fs.StringVar(&f.cpuprofile, "cpuprofile", "", "write a Go CPU profile to this file (for go tool pprof)")
	fs.MarkHidden("cpuprofile")
	fs.StringVar(&f.chunk, "buffer-size", "", "the largest read and write (default: 256 KiB, 2 MiB with -t none)")
	fs.MarkHidden("buffer-size")
	f.register(c)
	// inspectFlags' --output and --json say nothing to convert.
	fs.MarkHidden("output")
	fs.MarkHidden("json")
	completeWords(c, "output-format", registry.CreatableFormats()...)
	completeWords(c, "target-cache", "unsafe", "writeback", "none")
	c.RunE = func(c *cobra.Command, args []string) error {
		f.outFormatSet = c.Flags().Changed("output-format")
		return convertCmd(c.OutOrStdout(), c.ErrOrStderr(), args, &f)
	}
	return c
}

func convertCmd(stdout, stderr io.Writer, args []string, f *convertFlags) error {
	if len(args) != 2 {
		return usagef("convert: want SOURCE TARGET, got %d argument(s)", len(args))
	}
	j, err := f.job(args[0], args[1])
	if err != nil {
		return err
	}
	mode, err := f.progressMode(stderr)
	if err != nil {
		return err
	}
	stopProfile, err := startCPUProfile(f.cpuprofile)
	if err != nil {
		return err
	}
	defer stopProfile()
	if mode != progress.None {
		j.Progress = progress.New(mode, "converting", stdout, stderr)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err = convert.Run(ctx, j)
	var bad convert.BadRequest
	switch {
	case errors.Is(err, convert.ErrInterrupted):
		fmt.Fprintf(stderr, "blockexport: convert: %v\n", err)
		return exitStatus(exitInterrupted)
	case errors.As(err, &bad), errors.Is(err, registry.ErrBadSpec):
		return usageError{fmt.Errorf("convert: %w", err)}
	case err != nil:
		return fmt.Errorf("convert: %w", err)
	}
	return nil
}

// job checks the flags and says what to convert.
func (f *convertFlags) job(src, dst string) (convert.Job, error) {
	if f.parallel < 1 || f.parallel > 64 {
		return convert.Job{}, usagef("Invalid number of coroutines. Allowed number of coroutines is between 1 and 64")
	}
	minSparse, err := registry.ParseSize(f.sparse)
	if err != nil || minSparse%512 != 0 || minSparse > 16<<20 {
		return convert.Job{}, usagef("Invalid buffer size for sparse output specified. Valid sizes are multiples of 512 up to 16777216.")
	}
	switch f.cache {
	case "unsafe", "writeback", "none":
	default:
		return convert.Job{}, usagef("Invalid cache option: %s (want unsafe, writeback or none)", f.cache)
	}
	// A new TARGET is created; with -n an existing one is opened writable.
	targets := registry.CreatableFormats()
	if f.noCreate {
		targets = registry.WritableFormats()
	}
	if !slices.Contains(targets, f.outFormat) {
		return convert.Job{}, usagef("convert: -O %s: want %s", f.outFormat, registry.OrList(targets))
	}
	topts, err := registry.ParseCreateOptions(f.options)
	if err != nil {
		return convert.Job{}, usageError{err}
	}
	if topts.Size >= 0 {
		return convert.Job{}, usagef("Parameter 'size' is not supported here (TARGET takes SOURCE's size)")
	}
	if f.backing == "" {
		f.backing = topts.BackingFile
		f.backingFormat = cmp.Or(f.backingFormat, topts.BackingFormat)
	}
	switch {
	case f.backing != "" && !registry.CreatesBacking(f.outFormat):
		// A failure in qemu-img 7.2 (exit 1), as -c's below.
		return convert.Job{}, fmt.Errorf("Backing file not supported for file format '%s'", f.outFormat)
	case f.compress && !registry.Compresses(f.outFormat):
		// qemu-img 7.2 refuses it as a failure (exit 1), not as a usage
		// error, and before it creates TARGET (and after -B's refusal):
		// scripts that test its status see the same here.
		return convert.Job{}, errors.New("Compression not supported for this file format")
	case f.backing != "" && f.noCreate:
		return convert.Job{}, usagef("-B makes a new TARGET; it cannot be used with -n")
	case f.targetIsZero && !f.noCreate:
		return convert.Job{}, usagef("--target-is-zero requires use of -n flag")
	case f.noCreate && len(f.options) > 0:
		return convert.Job{}, usagef("-o has no effect with -n (TARGET exists)")
	case f.backingFormat != "" && f.backing == "":
		return convert.Job{}, usagef("-F without -B")
	}
	o, err := f.inspectFlags.options()
	if err != nil {
		return convert.Job{}, err
	}
	co := convert.Options{Parallel: f.parallel, OutOfOrder: f.outOfOrder, MinSparse: minSparse}
	if f.chunk != "" {
		n, err := registry.ParseSize(f.chunk)
		if err != nil || n <= 0 || n%4096 != 0 || n > 64<<20 {
			return convert.Job{}, usagef("--buffer-size %q: want a multiple of 4 KiB up to 64 MiB", f.chunk)
		}
		co.Chunk = n
	}
	return convert.Job{Source: src, Target: dst, Open: o, Format: f.outFormat, FormatGiven: f.outFormatSet,
		NoCreate: f.noCreate, TargetIsZero: f.targetIsZero, Compress: f.compress, Cache: f.cache,
		Create:  topts,
		Backing: f.backing, BackingFormat: f.backingFormat, Options: co}, nil
}

// progressMode is what -p and --progress ask for: -p is qemu-img's
// percentages on stdout, terminal or not.
func (f *convertFlags) progressMode(stderr io.Writer) (progress.Mode, error) {
	switch {
	case f.progressFmt != "":
		m, err := progress.ParseMode(f.progressFmt, stderr)
		if err != nil {
			return m, usageError{err}
		}
		return m, nil
	case f.showProgress:
		return progress.Percent, nil
	}
	return progress.None, nil
}
