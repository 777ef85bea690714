package convert

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/jobs/progress"
	"github.com/blockexport/blockexport/formats/protocols/nbd"
	"github.com/blockexport/blockexport/formats/registry"
)

// Job is one conversion as qemu-img convert's command line asks for it.
type Job struct {
	Source, Target string
	// Open is how to open Source (read-only); Target is opened with its
	// backend, NBD and directory options.
	Open registry.Options
	// Format is Target's format (raw or qcow2); with NoCreate and
	// FormatGiven false, Target's format is probed instead (qemu-img
	// would write raw bytes over a qcow2 image's metadata).
	Format      string
	FormatGiven bool
	// NoCreate (-n): Target exists; TargetIsZero: it reads as zeroes.
	NoCreate, TargetIsZero bool
	// Create: how a new Target is made (-o); its size is Source's.
	Create registry.CreateOptions
	// Backing, BackingFormat (-B, -F): a new Target's backing file.
	Backing, BackingFormat string
	// Compress (-c) stores the data clusters compressed.
	Compress bool
	// Cache is -t: unsafe (no flush at the end, qemu-img's default),
	// writeback or none (O_DIRECT).
	Cache string
	// Options is what the copy engine is told (Parallel, OutOfOrder,
	// MinSparse, Chunk); the rest is filled in here.
	Options Options
	// Progress shows how far the conversion has come (nil: not at all).
	Progress *progress.Reporter
}

// ErrInterrupted: the context ended the conversion; the error says what
// Target holds.
var ErrInterrupted = errors.New("interrupted")

// BadRequest is a conversion that cannot be done as asked (a usage error
// for the command).
type BadRequest struct{ error }

func (b BadRequest) Unwrap() error { return b.error }

func badRequest(format string, a ...any) error { return BadRequest{fmt.Errorf(format, a...)} }

// Run converts j.Source into j.Target. Interrupted (ctx ends), what was
// written is written back: a new raw Target is truncated to what was
// converted, a qcow2 one left consistent.
func Run(ctx context.Context, j Job) error {
	src, err := registry.Open(j.Source, j.Open)
	if err != nil {
		return err
	}
	defer src.Image.Close()
	size := src.Image.Size()
	if err := notBeingRead(j.Target, src.Image, j.Backing); err != nil {
		return err
	}
	// Interrupted while the source was opened (a network source can take
	// a while): nothing of Target has been touched yet, so it stays so.
	if ctx.Err() != nil {
		return fmt.Errorf("%w: %s untouched", ErrInterrupted, j.Target)
	}
	dst, created, err := j.openTarget(size)
	if err != nil {
		return err
	}
	o, err := j.engineOptions(dst.Image, created)
	if err != nil {
		dst.Image.Close()
		return err
	}
	// The progress of -p counts qemu-img's steps over the source's block
	// status first; an interrupt there ends the job as one in the copy
	// does (a new raw Target keeps the 0 bytes converted).
	var st Stats
	cerr := j.watch(ctx, src.Image, &o)
	if cerr == nil {
		if wb := startWriteBehind(j.Target, j.Cache == "none" || nbd.IsURI(j.Target)); wb != nil {
			defer wb.stop()
			report := o.Progress
			o.Progress = func(done, total int64) { report(done, total); wb.note(done) }
		}
		st, cerr = Convert(ctx, src.Image, dst.Image, o)
	}
	interrupted := cerr != nil && ctx.Err() != nil
	// Whatever happened, what was written is written back (and made
	// durable, but with -t unsafe): a qcow2 target's metadata is
	// consistent after its flush.
	ferr := dst.Image.Flush(context.Background())
	if interrupted && created && j.Format == registry.Raw {
		// A new raw target keeps exactly what was converted.
		if err := dst.Image.Resize(context.Background(), st.Done); err != nil && ferr == nil {
			ferr = err
		}
	}
	clerr := dst.Image.Close()
	if j.Progress != nil {
		j.Progress.Finish(cerr == nil, -1)
	}
	switch {
	case interrupted:
		return j.interrupted(st, size, created, ferr)
	case cerr != nil:
		return cerr
	case ferr != nil:
		return fmt.Errorf("%s: %w", j.Target, ferr)
	case clerr != nil:
		return fmt.Errorf("%s: %w", j.Target, clerr)
	}
	return nil
}

// interrupted says what an interrupted conversion left in Target.
func (j Job) interrupted(st Stats, size int64, created bool, ferr error) error {
	what := fmt.Sprintf("%s holds %d of %d bytes of %s", j.Target, st.Done, size, registry.Shown(j.Source))
	switch {
	case created && j.Format == registry.Raw:
		what = fmt.Sprintf("%s is truncated to the %d bytes converted (of %d)", j.Target, st.Done, size)
	case j.Format == registry.QCOW2:
		what += "; it is consistent (qemu-img check finds it clean), the rest reads as zeroes or as its backing file"
	}
	if ferr != nil {
		what += fmt.Sprintf("; writing it back failed: %v", ferr)
	}
	return fmt.Errorf("%w: %s", ErrInterrupted, what)
}

// openTarget makes a new Target of size bytes (removed again if it cannot
// be opened), or opens the existing one with NoCreate.
func (j Job) openTarget(size int64) (*registry.Opened, bool, error) {
	if !j.NoCreate {
		if nbd.IsURI(j.Target) {
			return nil, false, badRequest("an NBD TARGET exists already: give -n")
		}
		if err := j.create(size); err != nil {
			return nil, false, err
		}
	}
	to := registry.Options{Format: j.Format, Writable: true, Lock: true, Backend: j.Open.Backend,
		Direct: j.Cache == "none" && !j.Compress, NBD: j.Open.NBD, RelatedDirs: j.Open.RelatedDirs}
	if j.NoCreate && (!j.FormatGiven || nbd.IsURI(j.Target)) {
		to.Format = registry.Auto // probed; an export is raw bytes
	}
	dst, err := registry.Open(j.Target, to)
	if err != nil {
		if !j.NoCreate {
			os.Remove(j.Target)
		}
		return nil, false, err
	}
	if dst.Image.Size() < size {
		dst.Image.Close()
		return nil, false, fmt.Errorf("%s: the target (%d bytes) is smaller than the source (%d bytes)", j.Target, dst.Image.Size(), size)
	}
	return dst, !j.NoCreate, nil
}

// engineOptions completes j.Options for the target opened.
func (j Job) engineOptions(dst formats.Image, created bool) (Options, error) {
	o := j.Options
	if nf, ok := formats.As[formats.NoFlusher](dst); ok && j.Cache == "unsafe" {
		// qemu-img convert's default: the target is written through the
		// page cache and not flushed at the end (the kernel writes it
		// back later).
		nf.SetNoFlush(true)
	}
	if g, ok := formats.As[formats.GrowAheader](dst); ok && created {
		g.SetGrowAhead(64 << 20) // cut back at the end
	}
	o.TargetZero = created || j.TargetIsZero
	if l, ok := dst.(formats.Layered); ok && j.Backing != "" {
		o.Backing = l.Backing()
		o.TargetZero = false
	}
	if j.Compress {
		ct, ok := dst.(CompressedTarget)
		if !ok {
			return o, badRequest("Compression not supported for this file format")
		}
		if ct.ClusterSize() <= 0 {
			// A format that takes -c but whose image has no clusters
			// (a flat vmdk): qemu-img's refusal, after the target is made.
			return o, errors.New("invalid cluster size")
		}
		o.Compressed = ct
	}
	if co, ok := dst.(CompressedOnly); ok && co.NeedsCompressedWrites() {
		// Every cluster compressed, -c or not, as qemu-img does for such
		// a target: compression on every core, as with -c.
		ct, ok := dst.(CompressedTarget)
		if !ok {
			return o, fmt.Errorf("%s: the target stores compressed clusters only, and cannot compress them", j.Target)
		}
		o.Compressed = ct
	}
	if j.Cache == "none" && !j.Compress && o.Chunk == 0 {
		// O_DIRECT writes go to the device as they are: the larger the
		// request, the closer to the device's bandwidth (qemu-img's
		// requests are of up to 2 MiB too; docs/design.md, Convert's chunk sizes).
		o.Chunk = 2 << 20
	}
	return o, nil
}

// watch points the engine's progress at j.Progress: for qemu-img's
// percentages, counted as qemu-img counts them.
func (j Job) watch(ctx context.Context, src formats.Image, o *Options) error {
	o.Progress = func(int64, int64) {}
	switch {
	case j.Progress == nil:
	case j.Progress.Mode() == progress.Percent:
		steps, err := qemuSteps(ctx, src, *o)
		if err != nil {
			return err
		}
		o.Progress = steps.follow(j.Progress.Update)
	default:
		j.Progress.Planned(src.Size())
		o.Progress = j.Progress.Update
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
		files = append(files, layer.Info().Filename)
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
			return badRequest("TARGET %s is %s, which the conversion reads; refusing to overwrite it", dst, name)
		}
	}
	return nil
}

// create makes a new Target of size bytes, replacing one that exists (as
// qemu-img convert does).
func (j Job) create(size int64) error {
	co := j.Create
	co.Size, co.Force = size, true
	if j.Format != registry.Raw {
		// Image formats count sectors; a raw file takes any size.
		co.Size = (size + 511) &^ 511
	}
	if j.Backing != "" {
		b, err := registry.OpenBackingFile(j.Target, j.Backing, j.BackingFormat, registry.Options{Backend: "threads"})
		if err != nil {
			if errors.Is(err, registry.ErrBadSpec) {
				return err
			}
			return fmt.Errorf("backing file %s: %w", j.Backing, err)
		}
		co.BackingFile, co.BackingFormat = j.Backing, b.Format
		b.Image.Close()
	}
	return registry.Create(j.Target, j.Format, co)
}
