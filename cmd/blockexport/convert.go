package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/qcow2"
	"github.com/blockexport/blockexport/formats/jobs/convert"
	"github.com/blockexport/blockexport/formats/protocols/nbd"
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
		Short: "convert an image to " + registry.OrList(registry.WritableFormats()) + ", as qemu-img convert does",
		Long: "Convert SOURCE (any image blockexport reads, a file or an NBD export) into TARGET,\n" +
			"a new " + registry.OrList(registry.WritableFormats()) + " file (-O), or an existing image or NBD export with -n, with\n" +
			"qemu-img convert's flags. The source's block status drives the copy: holes and\n" +
			"zero runs are neither read nor written; -S finds zeroes inside data.\n" +
			"Memory: at most (-m or, with -c, the CPU count) x 256 KiB buffers (2 MiB with -t none; or a cluster,\n" +
			"or -S, if larger),\n" +
			"twice that with -B.\n" +
			"Progress: -p draws a bar with rate and ETA on a terminal; --progress=json (or -p\n" +
			"when stderr is not a terminal) prints one JSON object per percent on stdout:\n" +
			"{\"done\":B,\"total\":B,\"percent\":P,\"rate\":B/s,\"eta-seconds\":S}.\n" +
			"SIGINT (or SIGTERM) stops it: a new raw TARGET is truncated to what was converted, a qcow2 one\n" +
			"is left consistent; exit 130. " + imageHelp,
		Example: "  blockexport convert -O qcow2 -c -o compression_type=zstd disk.raw disk.qcow2\n" +
			"  blockexport convert -p -m 16 -W disk.vmdk disk.raw",
	}
	fs := c.Flags()
	fs.StringVarP(&f.outFormat, "output-format", "O", "raw", "TARGET's format: "+registry.OrList(registry.WritableFormats())+" (with -n: TARGET's format, as it is opened)")
	fs.StringArrayVarP(&f.options, "options", "o", nil, "TARGET's creation options, qemu-img's: cluster_size, compression_type=zlib|zstd, lazy_refcounts=on|off, preallocation=off, compat=v3, refcount_bits=16, backing_file, backing_fmt")
	fs.BoolVarP(&f.compress, "compress", "c", false, "store TARGET's data clusters compressed (qcow2), on all cores")
	fs.BoolVarP(&f.showProgress, "show-progress", "p", false, "show progress: a bar with rate and ETA on a terminal, JSON lines otherwise")
	fs.StringVar(&f.progressFmt, "progress", "", "progress: auto (as -p), bar, json (one JSON object per percent on stdout) or none")
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
	completeWords(c, "output-format", "raw", "qcow2")
	completeWords(c, "progress", "auto", "bar", "json", "none")
	completeWords(c, "target-cache", "unsafe", "writeback", "none")
	c.RunE = func(c *cobra.Command, args []string) error {
		f.outFormatSet = c.Flags().Changed("output-format")
		return convertCmd(c.OutOrStdout(), c.ErrOrStderr(), args, &f)
	}
	return c
}

// targetOptions are -o's, parsed.
type targetOptions struct {
	clusterSize     int64
	compressionType string
	lazyRefcounts   bool
	backing         string
	backingFormat   string
}

// parseTargetOptions reads -o as qemu-img does (key=value, comma
// separated, repeatable), refusing what is not implemented here in
// qemu-img's words.
func parseTargetOptions(opts []string, format string) (targetOptions, error) {
	var t targetOptions
	for _, o := range opts {
		for kv := range strings.SplitSeq(o, ",") {
			if kv == "" {
				continue
			}
			k, v, _ := strings.Cut(kv, "=")
			bad := func() error { return usagef("Parameter '%s' does not accept value '%s'", k, v) }
			known := format == registry.QCOW2 || k == "preallocation" || k == "size"
			if !known {
				return t, usagef("Invalid parameter '%s' (a %s target takes preallocation=off only)", k, format)
			}
			switch k {
			case "cluster_size":
				n, err := registry.ParseSize(v)
				if err != nil {
					return t, bad()
				}
				t.clusterSize = n
			case "compression_type":
				if v != "zlib" && v != "zstd" {
					return t, bad()
				}
				t.compressionType = v
			case "lazy_refcounts":
				switch v {
				case "on", "true":
					t.lazyRefcounts = true
				case "off", "false":
					t.lazyRefcounts = false
				default:
					return t, bad()
				}
			case "preallocation":
				if v != "off" {
					return t, usagef("Parameter 'preallocation' value '%s' is not supported here (only preallocation=off)", v)
				}
			case "compat":
				if v != "1.1" && v != "v3" {
					return t, usagef("Parameter 'compat' value '%s' is not supported here (images are created as compat=1.1)", v)
				}
			case "refcount_bits":
				if v != "16" {
					return t, usagef("Parameter 'refcount_bits' value '%s' is not supported here (refcounts are 16 bits)", v)
				}
			case "backing_file":
				t.backing = v
			case "backing_fmt":
				t.backingFormat = v
			case "size":
				return t, usagef("Parameter 'size' is not supported here (TARGET takes SOURCE's size)")
			case "encryption", "encrypt.format", "data_file", "data_file_raw", "extended_l2":
				return t, usagef("Parameter '%s' is not supported here", k)
			default:
				return t, usagef("Invalid parameter '%s'", k)
			}
		}
	}
	return t, nil
}

func convertCmd(stdout, stderr io.Writer, args []string, f *convertFlags) error {
	if len(args) != 2 {
		return usagef("convert: want SOURCE TARGET, got %d argument(s)", len(args))
	}
	srcSpec, dstSpec := args[0], args[1]
	if f.cpuprofile != "" {
		stopProfile, err := startCPUProfile(f.cpuprofile)
		if err != nil {
			return err
		}
		defer stopProfile()
	}
	if f.parallel < 1 || f.parallel > 64 {
		return usagef("Invalid number of coroutines. Allowed number of coroutines is between 1 and 64")
	}
	minSparse, err := registry.ParseSize(f.sparse)
	if err != nil || minSparse%512 != 0 || minSparse > 16<<20 {
		return usagef("Invalid buffer size for sparse output specified. Valid sizes are multiples of 512 up to 16777216.")
	}
	var direct, noFlush bool
	switch f.cache {
	case "unsafe":
		// qemu-img convert's default: the target is written through the
		// page cache and not flushed at the end (the kernel writes it
		// back later).
		noFlush = true
	case "writeback":
	case "none":
		direct = true
	default:
		return usagef("Invalid cache option: %s (want unsafe, writeback or none)", f.cache)
	}
	if !slices.Contains(registry.WritableFormats(), f.outFormat) {
		return usagef("convert: -O %s: want %s", f.outFormat, registry.OrList(registry.WritableFormats()))
	}
	topts, err := parseTargetOptions(f.options, f.outFormat)
	if err != nil {
		return err
	}
	if f.backing == "" {
		f.backing, f.backingFormat = topts.backing, cmp(f.backingFormat, topts.backingFormat)
	}
	switch {
	case f.compress && f.outFormat != registry.QCOW2:
		return usagef("Compression not supported for this file format")
	case f.backing != "" && f.outFormat != registry.QCOW2:
		return usagef("Backing file not supported for file format '%s'", f.outFormat)
	case f.backing != "" && f.noCreate:
		return usagef("-B makes a new TARGET; it cannot be used with -n")
	case f.targetIsZero && !f.noCreate:
		return usagef("--target-is-zero requires use of -n flag")
	case f.noCreate && len(f.options) > 0:
		return usagef("-o has no effect with -n (TARGET exists)")
	case f.backingFormat != "" && f.backing == "":
		return usagef("-F without -B")
	}
	progressMode, err := f.progressMode(stderr)
	if err != nil {
		return err
	}
	o, err := f.inspectFlags.options()
	if err != nil {
		return err
	}
	src, err := openImage(srcSpec, o)
	if err != nil {
		return fmt.Errorf("convert: %s: %w", registry.Shown(srcSpec), err)
	}
	defer src.Image.Close()
	size := src.Image.Size()

	if err := notBeingRead(dstSpec, src.Image, f.backing); err != nil {
		return err
	}
	// The target: made here (and removed again if it cannot be opened),
	// or an existing one with -n.
	created := false
	if !f.noCreate {
		if nbd.IsURI(dstSpec) {
			return usagef("an NBD TARGET exists already: give -n")
		}
		if err := f.create(dstSpec, size, topts); err != nil {
			return err
		}
		created = true
	}
	to := registry.Options{Format: f.outFormat, Writable: true, Lock: true, Backend: o.Backend, Direct: direct && !f.compress,
		NBD: o.NBD, RelatedDirs: o.RelatedDirs}
	if f.noCreate && !f.outFormatSet {
		// qemu-img would open it as raw and write raw bytes over a qcow2
		// image's metadata; without -O the format is probed instead.
		to.Format = registry.Auto
	}
	if f.noCreate && nbd.IsURI(dstSpec) {
		to.Format = registry.Auto // an export is raw bytes
	}
	dst, err := openImage(dstSpec, to)
	if err != nil {
		if created {
			os.Remove(dstSpec)
		}
		return fmt.Errorf("convert: %s: %w", dstSpec, err)
	}
	if dst.Image.Size() < size {
		dst.Image.Close()
		return fmt.Errorf("convert: %s: the target (%d bytes) is smaller than the source (%d bytes)", dstSpec, dst.Image.Size(), size)
	}
	if nf, ok := dst.Image.(interface{ SetNoFlush(bool) }); ok && noFlush {
		nf.SetNoFlush(true)
	}
	if g, ok := dst.Image.(interface{ SetGrowAhead(int64) }); ok && created {
		// A new qcow2 file grows in steps rather than write by write
		// (cut back at the end).
		g.SetGrowAhead(64 << 20)
	}
	co := convert.Options{Parallel: f.parallel, OutOfOrder: f.outOfOrder, MinSparse: minSparse,
		TargetZero: created || f.targetIsZero}
	if l, ok := dst.Image.(formats.Layered); ok && f.backing != "" {
		co.Backing = l.Backing()
		co.TargetZero = false
	}
	if f.compress {
		ct, ok := dst.Image.(convert.CompressedTarget)
		if !ok {
			dst.Image.Close()
			return usagef("Compression not supported for this file format")
		}
		co.Compressed = ct
	}
	if direct && !f.compress {
		// O_DIRECT writes go to the device as they are, with no copy
		// through the CPU's caches for small buffers to help: the larger
		// the request, the closer to the device's bandwidth (4 GiB with
		// 2 GiB of 1 MiB data runs, qcow2 to raw, -m 16 -W -t none:
		// 1.98-2.03 s with 256 KiB, 1.34-1.47 s with 2 MiB; qemu-img's
		// requests are of up to 2 MiB too).
		co.Chunk = 2 << 20
	}
	if f.chunk != "" {
		n, err := registry.ParseSize(f.chunk)
		if err != nil || n <= 0 || n%4096 != 0 || n > 64<<20 {
			return usagef("--buffer-size %q: want a multiple of 4 KiB up to 64 MiB", f.chunk)
		}
		co.Chunk = n
	}
	prog := newProgress(progressMode, stdout, stderr, size)
	co.Progress = prog.update
	if !direct && !nbd.IsURI(dstSpec) {
		if wb := startWriteBehind(dstSpec); wb != nil {
			defer wb.stop()
			co.Progress = func(done, total int64) {
				prog.update(done, total)
				wb.note(done)
			}
		}
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	st, cerr := convert.Convert(ctx, src.Image, dst.Image, co)
	interrupted := cerr != nil && ctx.Err() != nil
	// Whatever happened, what was written is written back (and made
	// durable, but with -t unsafe): a qcow2 target's metadata is
	// consistent after its flush.
	ferr := dst.Image.Flush(context.Background())
	if interrupted && created && f.outFormat == registry.Raw {
		// A new raw target keeps exactly what was converted.
		if err := dst.Image.Resize(context.Background(), st.Done); err != nil && ferr == nil {
			ferr = err
		}
	}
	clerr := dst.Image.Close()
	prog.finish(cerr == nil)
	switch {
	case interrupted:
		what := fmt.Sprintf("%s holds %d of %d bytes of %s", dstSpec, st.Done, size, registry.Shown(srcSpec))
		switch {
		case created && f.outFormat == registry.Raw:
			what = fmt.Sprintf("%s is truncated to the %d bytes converted (of %d)", dstSpec, st.Done, size)
		case f.outFormat == registry.QCOW2:
			what += "; it is consistent (qemu-img check finds it clean), the rest reads as zeroes or as its backing file"
		}
		if ferr != nil {
			what += fmt.Sprintf("; writing it back failed: %v", ferr)
		}
		fmt.Fprintf(stderr, "blockexport: convert: interrupted: %s\n", what)
		return exitStatus(exitInterrupted)
	case cerr != nil:
		return cerr
	case ferr != nil:
		return fmt.Errorf("convert: %s: %w", dstSpec, ferr)
	case clerr != nil:
		return fmt.Errorf("convert: %s: %w", dstSpec, clerr)
	}
	return nil
}

// notBeingRead refuses a TARGET that is a file the conversion reads: the
// source, a file of its backing chain, or the -B file (creating it would
// truncate what is about to be read; qemu-img refuses it by its image
// locks).
func notBeingRead(dst string, src formats.Image, backing string) error {
	dfi, err := os.Stat(dst)
	if err != nil {
		return nil // a new file, or an NBD export
	}
	var files []string
	for layer := src; layer != nil; {
		in := layer.Info()
		files = append(files, in.Filename)
		l, ok := layer.(formats.Layered)
		if !ok {
			break
		}
		layer = l.Backing()
	}
	if backing != "" {
		if !filepath.IsAbs(backing) {
			backing = filepath.Join(filepath.Dir(dst), backing)
		}
		files = append(files, backing)
	}
	for _, name := range files {
		if fi, err := os.Stat(name); err == nil && os.SameFile(fi, dfi) {
			return usagef("convert: TARGET %s is %s, which the conversion reads; refusing to overwrite it", dst, name)
		}
	}
	return nil
}

// cmp is the first of a and b that is not empty.
func cmp(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// create makes a new TARGET of size bytes, replacing one that exists (as
// qemu-img convert does).
func (f *convertFlags) create(path string, size int64, t targetOptions) error {
	if f.outFormat == registry.Raw {
		return registry.Create(path, registry.Raw, registry.CreateOptions{Size: size, Force: true})
	}
	co := qcow2.CreateOptions{Size: (size + 511) &^ 511, ClusterSize: t.clusterSize, Force: true,
		CompressionType: t.compressionType, LazyRefcounts: t.lazyRefcounts}
	if f.backing != "" {
		bpath := f.backing
		if !filepath.IsAbs(bpath) && !nbd.IsURI(bpath) {
			bpath = filepath.Join(filepath.Dir(path), bpath)
		}
		bf := cmp(f.backingFormat, registry.Auto)
		if _, err := registry.ParseFormat(bf); err != nil || bf == registry.Null {
			return usagef("convert: -F %q (want %s)", bf, registry.OrList(registry.FileFormats()))
		}
		b, err := registry.Open(bpath, registry.Options{Format: bf, Backend: "threads"})
		if err != nil {
			if errors.Is(err, registry.ErrBadSpec) {
				return usageError{err}
			}
			return fmt.Errorf("convert: backing file %s: %w", f.backing, err)
		}
		co.BackingFile, co.BackingFormat = f.backing, b.Format
		b.Image.Close()
	}
	if err := qcow2.Create(path, co); err != nil {
		return fmt.Errorf("convert: %w", err)
	}
	return nil
}

// progressMode is what -p and --progress ask for: "", "bar" or "json".
func (f *convertFlags) progressMode(stderr io.Writer) (string, error) {
	switch f.progressFmt {
	case "", "auto":
		if !f.showProgress && f.progressFmt == "" {
			return "", nil
		}
	case "none":
		return "", nil
	case "bar", "json":
		return f.progressFmt, nil
	default:
		return "", usagef("--progress %q: want auto, bar, json or none", f.progressFmt)
	}
	if isTerminal(stderr) {
		return "bar", nil
	}
	return "json", nil
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

// progress shows how far a conversion has come: a bar (with rate and ETA)
// on stderr, or one JSON object per percent on stdout.
type progress struct {
	mode    string
	bar     *progressbar.ProgressBar
	out     io.Writer
	total   int64
	start   time.Time
	mu      sync.Mutex
	lastPct int
}

// progressLine is one JSON progress step.
type progressLine struct {
	Done       int64   `json:"done"`
	Total      int64   `json:"total"`
	Percent    int     `json:"percent"`
	Rate       float64 `json:"rate"`
	ETASeconds float64 `json:"eta-seconds"`
}

func newProgress(mode string, stdout, stderr io.Writer, total int64) *progress {
	p := &progress{mode: mode, out: stdout, total: total, start: time.Now(), lastPct: -1}
	if mode == "bar" {
		p.bar = progressbar.NewOptions64(total, progressbar.OptionSetWriter(stderr), progressbar.OptionShowBytes(true),
			progressbar.OptionSetDescription("converting"), progressbar.OptionSetPredictTime(true),
			progressbar.OptionThrottle(100*time.Millisecond), progressbar.OptionShowElapsedTimeOnFinish(),
			progressbar.OptionOnCompletion(func() { fmt.Fprintln(stderr) }))
	}
	if mode == "json" {
		p.update(0, total)
	}
	return p
}

func (p *progress) update(done, total int64) {
	switch p.mode {
	case "bar":
		p.bar.Set64(done)
	case "json":
		p.mu.Lock()
		defer p.mu.Unlock()
		pct := 100
		if total > 0 {
			pct = int(done * 100 / total)
		}
		if pct == p.lastPct {
			return
		}
		p.lastPct = pct
		el := time.Since(p.start).Seconds()
		l := progressLine{Done: done, Total: total, Percent: pct}
		if el > 0 {
			l.Rate = float64(done) / el
		}
		if l.Rate > 0 {
			l.ETASeconds = float64(total-done) / l.Rate
		}
		j, _ := json.Marshal(l)
		fmt.Fprintf(p.out, "%s\n", j)
	}
}

func (p *progress) finish(ok bool) {
	if p.mode == "bar" && ok {
		p.bar.Finish()
	}
	if p.mode == "json" && ok {
		p.update(p.total, p.total)
	}
}

// writeBehind starts the kernel's write-back of a target file's dirty
// pages while the conversion goes on (sync_file_range WRITE, which waits
// for nothing), rather than leaving all of them to a sync at the end or
// to the kernel's thresholds (10% of memory, more than most images): the
// device then writes while the source is still read and compressed. It
// makes nothing durable that -t unsafe would not, and bounds the dirty
// pages a conversion leaves behind.
type writeBehind struct {
	f    *os.File
	kick chan struct{}
	done chan struct{}
	last int64 // progress at the last kick; guarded by the engine's one-at-a-time Progress calls
}

// writeBehindStep is how much progress starts another write-back.
const writeBehindStep = 64 << 20

// startWriteBehind returns nil when path cannot be opened (write-back is
// then the kernel's alone).
func startWriteBehind(path string) *writeBehind {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	wb := &writeBehind{f: f, kick: make(chan struct{}, 1), done: make(chan struct{})}
	go func() {
		defer close(wb.done)
		for range wb.kick {
			// Errors are the later flush's to report; EINVAL (a file
			// system without it) only ends the write-behind.
			if err := unix.SyncFileRange(int(wb.f.Fd()), 0, 0, unix.SYNC_FILE_RANGE_WRITE); err != nil {
				for range wb.kick {
				}
				return
			}
		}
	}()
	return wb
}

// note is told the progress; every writeBehindStep it asks for a
// write-back, unless one is still running.
func (wb *writeBehind) note(done int64) {
	if done-wb.last < writeBehindStep {
		return
	}
	wb.last = done
	select {
	case wb.kick <- struct{}{}:
	default:
	}
}

func (wb *writeBehind) stop() {
	close(wb.kick)
	<-wb.done
	wb.f.Close()
}
