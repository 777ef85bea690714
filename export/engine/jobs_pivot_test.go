package engine

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/registry"
)

// TestPivotImageKeepsWhatItsImageOffers: the wrapper a format node's
// exports hold offers front ends what the image under it offers (page
// lending and a backing chain where there are), and hides nothing the
// FUSE export finds by type assertion (a raw image's preallocated grow).
func TestPivotImageKeepsWhatItsImageOffers(t *testing.T) {
	dir := t.TempDir()
	raw, top := filepath.Join(dir, "disk.raw"), filepath.Join(dir, "top.qcow2")
	if err := os.WriteFile(raw, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := registry.Create(top, registry.QCOW2, registry.CreateOptions{Size: 1 << 20, BackingFile: "disk.raw", BackingFormat: "raw"}); err != nil {
		t.Fatal(err)
	}
	open := func(path, format string, writable bool) *pivotImage {
		o, err := registry.Open(path, registry.Options{Format: format, Writable: writable, Backend: "threads"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { o.Image.Close() })
		return newPivotImage(o.Image)
	}
	q := open(top, registry.QCOW2, false)
	if l, ok := formats.As[formats.Layered](q); !ok || l.Backing() == nil {
		t.Fatal("a qcow2 overlay under the wrapper shows no backing file")
	}
	r := open(raw, registry.Raw, true)
	if _, ok := formats.As[formats.PageLender](r); !ok {
		t.Fatal("a raw image under the wrapper lends no pages")
	}
	if _, ok := formats.As[formats.Layered](r); ok {
		t.Fatal("a raw image under the wrapper claims a backing chain")
	}
	var before syscall.Stat_t
	if err := syscall.Stat(raw, &before); err != nil {
		t.Fatal(err)
	}
	if err := r.GrowPreallocated(t.Context(), 2<<20, false); err != nil {
		t.Fatal(err)
	}
	var after syscall.Stat_t
	if err := syscall.Stat(raw, &after); err != nil {
		t.Fatal(err)
	}
	if after.Size != 2<<20 || after.Blocks <= before.Blocks {
		t.Fatalf("a preallocated grow through the wrapper: size %d, blocks %d -> %d; want 2 MiB, the tail allocated", after.Size, before.Blocks, after.Blocks)
	}
}
