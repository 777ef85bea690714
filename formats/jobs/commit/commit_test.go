package commit

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/qcow2"
	"github.com/blockexport/blockexport/formats/registry"
)

func readAll(t *testing.T, img formats.Image) []byte {
	t.Helper()
	p := make([]byte, img.Size())
	if _, err := img.ReadAt(context.Background(), p, 0); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestCommitWritesTheOverlayIntoAShorterBaseAndEmptiesIt: the base grows
// to the overlay's size and reads as the overlay did; the overlay holds
// nothing and still reads the same. With a progress listener the overlay
// is emptied extent by extent, counted; without, a step at a time over
// its whole size.
func TestCommitWritesTheOverlayIntoAShorterBaseAndEmptiesIt(t *testing.T) {
	for _, counted := range []bool{false, true} {
		name := "without progress"
		if counted {
			name = "with progress"
		}
		t.Run(name, func(t *testing.T) { commitIntoAShorterBase(t, counted) })
	}
}

func commitIntoAShorterBase(t *testing.T, counted bool) {
	ctx := context.Background()
	dir := t.TempDir()
	base := filepath.Join(dir, "base.raw")
	if err := os.WriteFile(base, bytes.Repeat([]byte{1}, 2<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	top := filepath.Join(dir, "top.qcow2")
	if err := qcow2.Create(top, qcow2.CreateOptions{Size: 3 << 20, BackingFile: "base.raw", BackingFormat: "raw"}); err != nil {
		t.Fatal(err)
	}
	o := registry.Options{Format: registry.QCOW2, Writable: true, Backend: "threads"}
	img, err := registry.Open(top, o)
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []struct {
		off, n int64
		b      byte
	}{{0, 100 << 10, 2}, {1 << 20, 64 << 10, 3}, {(2 << 20) + 4096, 200 << 10, 4}} {
		if _, err := img.Image.WriteAt(ctx, bytes.Repeat([]byte{w.b}, int(w.n)), w.off); err != nil {
			t.Fatal(err)
		}
	}
	if err := img.Image.WriteZeroes(ctx, 1536<<10, 128<<10, false); err != nil {
		t.Fatal(err)
	}
	want := readAll(t, img.Image)
	b, err := registry.Open(base, registry.Options{Format: registry.Raw, Writable: true, Backend: "threads"})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	co := Options{Drop: true, Parallel: 2, Step: 64 << 10, Rate: 2 << 20}
	var lastDone, lastTotal int64
	if counted {
		co.Progress = func(done, total int64) {
			if done < lastDone {
				t.Errorf("progress went back from %d to %d", lastDone, done)
			}
			lastDone, lastTotal = done, total
		}
	}
	if err := Commit(ctx, img.Image, b.Image, 1, co); err != nil {
		t.Fatal(err)
	}
	// Nine clusters, 576 KiB, copied and then dropped.
	if counted && (lastDone != lastTotal || lastTotal != 2*576<<10) {
		t.Errorf("progress ended at %d of %d, want %d of %d", lastDone, lastTotal, 2*576<<10, 2*576<<10)
	}
	// Nine clusters (576 KiB) copied at 2 MiB/s: the last starts after
	// about 250 ms.
	if took := time.Since(start); took < 200*time.Millisecond {
		t.Errorf("the commit took %v under a rate limit of 2 MiB/s", took)
	}
	if got := readAll(t, b.Image); !bytes.Equal(got, want) {
		t.Error("the base does not read as the overlay did")
	}
	b.Image.Close()
	img.Image.Close()
	// Opened again: its backing file's size is read anew.
	o.Writable = false
	img, err = registry.Open(top, o)
	if err != nil {
		t.Fatal(err)
	}
	defer img.Image.Close()
	if got := readAll(t, img.Image); !bytes.Equal(got, want) {
		t.Error("the overlay reads differently after the commit")
	}
	for off := int64(0); off < img.Image.Size(); {
		e, err := img.Image.Extent(ctx, off, img.Image.Size()-off)
		if err != nil {
			t.Fatal(err)
		}
		if e.Depth == 0 && e.Present {
			t.Fatalf("the overlay still holds [%d, +%d)", off, e.Length)
		}
		off += e.Length
	}
}
