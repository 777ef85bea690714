package raw

import (
	"context"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/blockexport/blockexport/aio"
)

// syncCounter counts the fdatasyncs and fsyncs asked of a file.
type syncCounter struct {
	aio.File
	n *atomic.Int64
}

func (c syncCounter) Fdatasync(ctx context.Context) error {
	c.n.Add(1)
	return c.File.Fdatasync(ctx)
}

func (c syncCounter) Fsync(ctx context.Context) error {
	c.n.Add(1)
	return c.File.Fsync(ctx)
}

// SetNoFlush (convert's -t unsafe, qemu-img convert's default) makes
// Flush sync nothing; without it Flush syncs.
func TestNoFlushSyncsNothing(t *testing.T) {
	for _, noFlush := range []bool{false, true} {
		path := filepath.Join(t.TempDir(), "r.img")
		if err := os.WriteFile(path, make([]byte, 1<<20), 0o644); err != nil {
			t.Fatal(err)
		}
		f, err := aio.Open(path, aio.Options{Writable: true})
		if err != nil {
			t.Fatal(err)
		}
		var syncs atomic.Int64
		r, err := New(syncCounter{f, &syncs}, Options{Writable: true})
		if err != nil {
			t.Fatal(err)
		}
		r.SetNoFlush(noFlush)
		if _, err := r.WriteAt(context.Background(), []byte("x"), 4096); err != nil {
			t.Fatal(err)
		}
		if err := r.Flush(context.Background()); err != nil {
			t.Fatal(err)
		}
		r.Close()
		if n := syncs.Load(); (n == 0) != noFlush {
			t.Fatalf("SetNoFlush(%v): %d syncs", noFlush, n)
		}
	}
}
