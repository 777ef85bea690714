package engine

import (
	"bytes"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

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

// TestLentReadsSurviveImageSwapsUnderAFUSEExport reads a page-cached raw
// node through its FUSE export (reads answered by lending the file's
// pages, written to /dev/fuse after the image's call returns) while the
// engine swaps the image under the export again and again, closing the
// old one each time, as a job's graph change does: every read succeeds
// with the file's bytes, as QEMU's drain before a graph change keeps its
// readers from seeing an error.
func TestLentReadsSurviveImageSwapsUnderAFUSEExport(t *testing.T) {
	const size = 4 << 20
	dir := t.TempDir()
	raw, mnt := filepath.Join(dir, "disk.raw"), filepath.Join(dir, "mnt")
	want := make([]byte, size)
	for i := range want {
		want[i] = byte(i/4096) ^ byte(i)
	}
	// Written through the page cache, so its pages are resident to lend.
	if err := os.WriteFile(raw, want, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(mnt, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	e := New(Options{Backend: "threads", Event: func(string, any) {}})
	t.Cleanup(func() { e.Close() })
	if err := e.AddNode(BlockdevOptions{Driver: "raw", NodeName: "disk", File: &BlockdevRef{Inline: &BlockdevOptions{Driver: "file", Filename: raw}}}); err != nil {
		t.Fatal(err)
	}
	if err := e.AddExport(ExportOptions{Type: "fuse", ID: "exp", NodeName: "disk", Mountpoint: mnt}); err != nil {
		t.Fatal(err)
	}
	e.mu.Lock()
	n := e.node("disk")
	p, ok := n.img.(*pivotImage)
	if _, lends := formats.As[formats.PageLender](n.img); !ok || !lends {
		e.mu.Unlock()
		t.Fatalf("the raw node's image is %T, lending %v: want a pivotImage that lends pages", n.img, lends)
	}
	e.mu.Unlock()

	f, err := os.Open(mnt)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var (
		stop  = make(chan struct{})
		wg    sync.WaitGroup
		reads atomic.Int64
	)
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, 64<<10)
			for i := w; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				off := int64(i*len(buf)) % size
				if _, err := f.ReadAt(buf, off); err != nil {
					t.Errorf("read at %d while the image was swapped: %v", off, err)
					return
				}
				if !bytes.Equal(buf, want[off:off+int64(len(buf))]) {
					t.Errorf("read at %d while the image was swapped: wrong data", off)
					return
				}
				reads.Add(1)
			}
		}()
	}
	for range 300 {
		e.mu.Lock()
		err := e.reopenChain(n)
		e.mu.Unlock()
		if err != nil {
			t.Error(err)
			break
		}
		time.Sleep(time.Millisecond)
	}
	close(stop)
	wg.Wait()
	if reads.Load() < 300 {
		t.Errorf("only %d reads went on during 300 swaps", reads.Load())
	}
	if p.img == nil {
		t.Fatal("no image under the node after the swaps")
	}
}
