package qcow2

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
)

// errAfterCtx is a context that says it is cancelled from its k-th Err()
// on: a SIGINT arriving between any two of the operations that look.
type errAfterCtx struct {
	context.Context
	k, calls *atomic.Int64
}

func (c errAfterCtx) Err() error {
	if c.calls.Add(1) > c.k.Load() {
		return context.Canceled
	}
	return nil
}

// qemuBacking is what qemu-img info says of img's backing file and its
// format ("" for none).
func qemuBacking(t *testing.T, img string) (string, string) {
	t.Helper()
	var info struct {
		Backing string `json:"backing-filename"`
		Format  string `json:"backing-filename-format"`
	}
	if err := json.Unmarshal([]byte(tool(t, "qemu-img", "info", "-U", "--output=json", img)), &info); err != nil {
		t.Fatal(err)
	}
	return info.Backing, info.Format
}

// TestRvwDropBackingCancelledAtEveryStep: a cancellation (SIGINT) seen
// at any point of DropBacking leaves either the image as it was (backing
// file and format named) or standalone: never the middle state, a
// backing file without its format, which every later open would probe
// (a raw backing file whose first bytes look like another format's
// header would then be read as that format).
func TestRvwDropBackingCancelledAtEveryStep(t *testing.T) {
	for k := int64(0); k < 64; k++ {
		over, data := corOverlay(t, 1<<20, "1.1")
		q := openRW(t, over)
		buf := make([]byte, len(data))
		if _, err := q.ReadCopy(context.Background(), buf, 0); err != nil {
			t.Fatal(err)
		}
		var kk, calls atomic.Int64
		kk.Store(k)
		err := q.DropBacking(errAfterCtx{context.Background(), &kk, &calls})
		q.Close()
		b, f := qemuBacking(t, over)
		switch {
		case err == nil && b == "":
		case err != nil && b != "" && f == "raw":
		default:
			t.Fatalf("DropBacking cancelled at check %d: err %v, backing %q format %q", k, err, b, f)
		}
		tool(t, "qemu-img", "check", "-q", over)
		tool(t, "qemu-img", "compare", "-q", "-F", "raw", over, filepath.Join(filepath.Dir(over), "base.raw"))
		if err == nil {
			return // past the last look: every step was tried
		}
	}
	t.Fatal("DropBacking never completed")
}

// TestRvwDropBackingRefusesSnapshots: an internal snapshot of the overlay
// reads its unallocated clusters from the backing file too; dropping the
// backing file (after copying only into the active layer) would turn
// them into zeroes. QEMU's block-stream does exactly that; we refuse.
func TestRvwDropBackingRefusesSnapshots(t *testing.T) {
	over, data := corOverlay(t, 1<<20, "1.1")
	tool(t, "qemu-img", "snapshot", "-c", "s1", over)
	dir := filepath.Dir(over)
	want := filepath.Join(dir, "snap.raw")
	tool(t, "qemu-img", "convert", "-l", "snapshot.name=s1", "-O", "raw", over, want)
	q := openRW(t, over)
	buf := make([]byte, len(data))
	if _, err := q.ReadCopy(context.Background(), buf, 0); err != nil {
		t.Fatal(err)
	}
	err := q.DropBacking(context.Background())
	q.Close()
	if err == nil {
		got := filepath.Join(dir, "snap-after.raw")
		tool(t, "qemu-img", "convert", "-l", "snapshot.name=s1", "-O", "raw", over, got)
		a, _ := os.ReadFile(want)
		b, _ := os.ReadFile(got)
		if string(a) != string(b) {
			t.Fatal("DropBacking with an internal snapshot: the snapshot no longer reads as it did")
		}
		return
	}
	if !errors.Is(err, ErrUnsupported) {
		t.Fatalf("DropBacking with an internal snapshot: %v", err)
	}
	if b, _ := qemuBacking(t, over); b == "" {
		t.Fatal("the refused DropBacking dropped the backing file")
	}
}
