package rebase

import (
	"bytes"
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

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

// TestCopyKeepsTheContentOverTheNewBackingFile rebases an overlay from
// one raw file onto a shorter one that differs in a few blocks: the
// overlay reads the same, and only the differing blocks it did not hold
// were copied.
func TestCopyKeepsTheContentOverTheNewBackingFile(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(1, 2))
	old := make([]byte, 4<<20)
	for i := range old {
		old[i] = byte(rng.Uint32())
	}
	newer := bytes.Clone(old[:3<<20])
	copy(newer[1<<20:], make([]byte, 64<<10))         // differs: zeroes
	copy(newer[2<<20:], bytes.Repeat([]byte{7}, 100)) // differs inside one block
	copy(newer[(1<<20)+(512<<10):], bytes.Repeat([]byte{9}, 64<<10))
	for name, b := range map[string][]byte{"old.raw": old, "new.raw": newer} {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	top := filepath.Join(dir, "top.qcow2")
	if err := qcow2.Create(top, qcow2.CreateOptions{Size: 5 << 20, BackingFile: "old.raw", BackingFormat: "raw"}); err != nil {
		t.Fatal(err)
	}
	o := registry.Options{Format: registry.QCOW2, Writable: true, Backend: "threads"}
	img, err := registry.Open(top, o)
	if err != nil {
		t.Fatal(err)
	}
	// The overlay holds the block at 1.5 MiB itself: not copied.
	if _, err := img.Image.WriteAt(ctx, bytes.Repeat([]byte{5}, 64<<10), (1<<20)+(512<<10)); err != nil {
		t.Fatal(err)
	}
	want := readAll(t, img.Image)
	nb, err := registry.Open(filepath.Join(dir, "new.raw"), registry.Options{Format: registry.Raw, Backend: "threads"})
	if err != nil {
		t.Fatal(err)
	}
	defer nb.Image.Close()
	copied, err := Copy(ctx, img.Image, nb.Image, Options{Parallel: 3, Step: 256 << 10})
	if err != nil {
		t.Fatal(err)
	}
	// Two differing blocks below 3 MiB, and the old file's last MiB,
	// which the new one lacks.
	if wantCopied := int64(2*(64<<10) + (1 << 20)); copied != wantCopied {
		t.Errorf("copied %d bytes, want %d", copied, wantCopied)
	}
	if err := img.Image.(*qcow2.Image).SetBacking(ctx, "new.raw", "raw"); err != nil {
		t.Fatal(err)
	}
	if err := img.Image.Close(); err != nil {
		t.Fatal(err)
	}
	o.Writable = false
	again, err := registry.Open(top, o)
	if err != nil {
		t.Fatal(err)
	}
	defer again.Image.Close()
	if got := readAll(t, again.Image); !bytes.Equal(got, want) {
		t.Fatal("the overlay reads differently over the new backing file")
	}
}
