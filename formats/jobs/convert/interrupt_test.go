package convert

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/blockexport/blockexport/formats/jobs/progress"
	"github.com/blockexport/blockexport/formats/registry"
)

// A SIGINT that comes while the source is opened (the command's signal
// context is in place before Run opens it, and a network source can take
// a while) ends the job before Target is touched: an existing file keeps
// every byte, and the error is an interrupt (exit 130).
func TestInterruptBeforeTheCopyLeavesAnExistingTargetUntouched(t *testing.T) {
	dir := t.TempDir()
	src, dst := filepath.Join(dir, "src.raw"), filepath.Join(dir, "dst.raw")
	if err := os.WriteFile(src, bytes.Repeat([]byte{1}, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	precious := bytes.Repeat([]byte("precious"), 1<<16)
	if err := os.WriteFile(dst, precious, 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := Run(ctx, Job{Source: src, Target: dst, Open: registry.Options{Format: "raw", Backend: "threads"},
		Format: "raw", FormatGiven: true, Cache: "writeback"})
	if !errors.Is(err, ErrInterrupted) {
		t.Fatalf("Run with an interrupted context: %v, want ErrInterrupted", err)
	}
	if got, err := os.ReadFile(dst); err != nil || !bytes.Equal(got, precious) {
		t.Fatalf("the existing target changed: %d bytes (was %d), %v", len(got), len(precious), err)
	}
}

// endsAfter is a context whose Err turns to Canceled at its n-th call:
// an interrupt that lands at a chosen point of the job.
type endsAfter struct {
	context.Context
	calls, n atomic.Int64
}

func (c *endsAfter) Err() error {
	if c.calls.Add(1) >= c.n.Load() {
		return context.Canceled
	}
	return nil
}

// With -p the job walks the source's block status first (qemu-img's
// steps); an interrupt there is an interrupt like one in the copy:
// ErrInterrupted (exit 130), and the new raw target is cut to the 0 bytes
// converted, not left at its full size.
func TestInterruptDuringTheProgressPrescanIsAnInterrupt(t *testing.T) {
	dir := t.TempDir()
	src, dst := filepath.Join(dir, "src.qcow2"), filepath.Join(dir, "dst.raw")
	if err := registry.Create(src, "qcow2", registry.CreateOptions{Size: 64 << 20}); err != nil {
		t.Fatal(err)
	}
	w, err := registry.Open(src, registry.Options{Format: "qcow2", Writable: true, Backend: "threads"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Image.WriteAt(context.Background(), bytes.Repeat([]byte{7}, 1<<20), 32<<20); err != nil {
		t.Fatal(err)
	}
	if err := w.Image.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	w.Image.Close()
	ctx := &endsAfter{Context: context.Background()}
	ctx.n.Store(3) // Run's check before the target, the prescan's first step, then the interrupt
	err = Run(ctx, Job{Source: src, Target: dst, Open: registry.Options{Format: "qcow2", Backend: "threads"},
		Format: "raw", FormatGiven: true, Cache: "writeback",
		Progress: progress.New(progress.Percent, "converting", io.Discard, io.Discard)})
	if !errors.Is(err, ErrInterrupted) {
		t.Fatalf("interrupted in the prescan: %v, want ErrInterrupted", err)
	}
	if fi, err := os.Stat(dst); err != nil || fi.Size() != 0 {
		t.Fatalf("the new raw target after an interrupt before any copy: %v, %v (want 0 bytes)", fi.Size(), err)
	}
}
