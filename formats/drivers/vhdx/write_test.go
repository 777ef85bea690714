package vhdx

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats/internal/driver"
)

// TestNewImageReadsBackWhatWasWritten: writes across block boundaries,
// into the short last block, and zero writes over written and unwritten
// blocks, into a new dynamic and fixed image (what convert -O vhdx writes): after Close, our reader and
// qemu-img read the bytes written (and zeroes elsewhere), and qemu-img
// check finds the image clean.
func TestNewImageReadsBackWhatWasWritten(t *testing.T) {
	ctx := context.Background()
	const size = 5<<20 + 512
	for _, keys := range []map[string]string{
		{"block_size": "1M"},
		{"block_size": "1M", "subformat": "fixed"},
		{"block_size": "2M", "subformat": "fixed", "block_state_zero": "off"},
		{"block_size": "1M", "block_state_zero": "off"},
	} {
		path := filepath.Join(t.TempDir(), "fresh.vhdx")
		if err := Create(path, driver.CreateOptions{Size: size, Keys: keys}); err != nil {
			t.Fatal(err)
		}
		f, err := aio.Open(path, aio.Options{Backend: aio.Threads, Writable: true})
		if err != nil {
			t.Fatal(err)
		}
		w, err := OpenWriter(ctx, f, Options{})
		if err != nil {
			t.Fatalf("%v: %v", keys, err)
		}
		want := make([]byte, size)
		write := func(fill byte, off, n int) {
			p := bytes.Repeat([]byte{fill}, n)
			if _, err := w.WriteAt(ctx, p, int64(off)); err != nil {
				t.Fatalf("%v: write at %d: %v", keys, off, err)
			}
			copy(want[off:], p)
		}
		write(1, 1<<20-100, 300)     // across blocks 0 and 1
		write(2, 4<<20+7, 1<<20+505) // to the end of the disk
		write(3, 3<<20, 512)         // one sector of block 3
		if err := w.WriteZeroes(ctx, 4<<20+100, 50, true); err != nil {
			t.Fatal(err)
		}
		clear(want[4<<20+100 : 4<<20+150])
		if err := w.WriteZeroes(ctx, 2<<20, 1<<20, true); err != nil { // never written
			t.Fatal(err)
		}
		if _, err := w.WriteAt(ctx, []byte{1}, size); err == nil {
			t.Errorf("%v: a write past the end was taken", keys)
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		img := createAndOpenExisting(t, path)
		got := make([]byte, size)
		if _, err := img.ReadAt(ctx, got, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%v: our reader reads other bytes than written", keys)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if got, ok := qemuReads(t, b); !ok || !bytes.Equal(got, want) {
			t.Errorf("%v: qemu-img reads other bytes than written", keys)
		}
		if out, err := exec.Command("qemu-img", "check", "-f", "vhdx", path).CombinedOutput(); err != nil {
			t.Errorf("%v: qemu-img check: %v\n%s", keys, err, out)
		}
	}
}

// createAndOpenExisting opens the image at path with the reader.
func createAndOpenExisting(t *testing.T, path string) *Image {
	t.Helper()
	f, err := aio.Open(path, aio.Options{Backend: aio.Threads})
	if err != nil {
		t.Fatal(err)
	}
	img, err := New(context.Background(), f, Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { img.Close() })
	return img
}
