package qcow2

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"
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

// TestDropBackingCancelledAtEveryStep: a cancellation (SIGINT) seen
// at any point of DropBacking leaves either the image as it was (backing
// file and format named) or standalone: never the middle state, a
// backing file without its format, which every later open would probe
// (a raw backing file whose first bytes look like another format's
// header would then be read as that format).
func TestDropBackingCancelledAtEveryStep(t *testing.T) {
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

// TestDropBackingRefusesSnapshots: an internal snapshot of the overlay
// reads its unallocated clusters from the backing file too; dropping the
// backing file (after copying only into the active layer) would turn
// them into zeroes. QEMU's block-stream does exactly that; we refuse.
func TestDropBackingRefusesSnapshots(t *testing.T) {
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

// TestCopyOfThePartialLastClusterRacesGuestOps: the image ends 4.5 KiB
// into its last cluster; a copy-on-read of that cluster is caught reading
// the backing file while a guest write, a write of zeroes or a discard
// of it comes: each waits and wins, and the image checks clean.
func TestCopyOfThePartialLastClusterRacesGuestOps(t *testing.T) {
	const size = 1<<20 + 4608
	ops := map[string]func(q *Image, want []byte) error{
		"write": func(q *Image, want []byte) error {
			p := bytes.Repeat([]byte{0xcd}, 3000)
			copy(want[1<<20+1000:], p)
			_, err := q.WriteAt(context.Background(), p, 1<<20+1000)
			return err
		},
		"zeroes": func(q *Image, want []byte) error {
			clear(want[1<<20+512:])
			return q.WriteZeroes(context.Background(), 1<<20+512, 4096, true)
		},
		"discard": func(q *Image, want []byte) error {
			clear(want[1<<20:]) // v3 with a backing file: a zero cluster
			return q.Discard(context.Background(), 1<<20, 4608)
		},
	}
	for name, op := range ops {
		t.Run(name, func(t *testing.T) {
			over, data := corOverlay(t, size, "1.1")
			q := openRW(t, over)
			g := &gatedImage{Image: q.backing, entered: make(chan struct{}), release: make(chan struct{})}
			q.backing = g
			got := make([]byte, 2048)
			readDone := make(chan error, 1)
			go func() {
				_, err := q.ReadCopy(context.Background(), got, size-2048)
				readDone <- err
			}()
			<-g.entered
			want := bytes.Clone(data)
			opDone := make(chan error, 1)
			go func() { opDone <- op(q, want) }()
			time.Sleep(100 * time.Millisecond)
			close(g.release)
			if err := <-readDone; err != nil {
				t.Fatal(err)
			}
			if err := <-opDone; err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, data[size-2048:]) {
				t.Fatal("the copy-on-read returned other bytes than the backing file's")
			}
			buf := make([]byte, size)
			if _, err := q.ReadCopy(context.Background(), buf, 0); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(buf, want) {
				t.Fatal("the image does not read as the backing file with the guest's operation applied")
			}
			if err := q.Close(); err != nil {
				t.Fatal(err)
			}
			checkClean(t, over)
			compareRaw(t, over, want)
		})
	}
}

// TestCopyOnReadTailPastTheEndStaysZero: an overlay 1 MiB + 512 bytes long over
// a 2 MiB backing file. A copy-on-read of its last (partial) cluster, and
// a guest write into it, must not fill the cluster's part past the image
// end with the backing file's bytes: once the backing file is dropped
// (stream), a grown image reads zeroes there (Resize: "a grown tail reads
// as zeroes"), not the old backing file.
func TestCopyOnReadTailPastTheEndStaysZero(t *testing.T) {
	for _, how := range []string{"copy", "write", "write-without-zero-range"} {
		t.Run(how, func(t *testing.T) {
			ctx := context.Background()
			dir := t.TempDir()
			data := make([]byte, 2<<20)
			for i := range data {
				data[i] = byte(i*7) | 1
			}
			base := filepath.Join(dir, "base.raw")
			if err := os.WriteFile(base, data, 0o644); err != nil {
				t.Fatal(err)
			}
			over := filepath.Join(dir, "over.qcow2")
			const size = 1<<20 + 512
			tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "raw", over, "1049088")
			q := openRW(t, over)
			// A host file system without FALLOC_FL_ZERO_RANGE (tmpfs):
			// the tail is read and written as bytes.
			q.w.noZeroRange.Store(how == "write-without-zero-range")
			if how == "copy" {
				if _, err := q.ReadCopy(ctx, make([]byte, 512), size-512); err != nil {
					t.Fatal(err)
				}
			} else if _, err := q.WriteAt(ctx, []byte{0xee}, 1<<20+100); err != nil {
				t.Fatal(err)
			}
			// The rest of the overlay, as a stream would, then drop.
			if _, err := q.Populate(ctx, 0, size); err != nil {
				t.Fatal(err)
			}
			if err := q.DropBacking(ctx); err != nil {
				t.Fatal(err)
			}
			if err := q.Resize(ctx, 2<<20); err != nil {
				t.Fatal(err)
			}
			tail := make([]byte, 2<<20-size)
			if _, err := q.ReadAt(ctx, tail, size); err != nil {
				t.Fatal(err)
			}
			if err := q.Close(); err != nil {
				t.Fatal(err)
			}
			for i, b := range tail {
				if b != 0 {
					t.Fatalf("the grown tail reads %#x at %d (the old backing file's byte is %#x)", b, size+int64(i), data[size+int64(i)])
				}
			}
			checkClean(t, over)
		})
	}
}
