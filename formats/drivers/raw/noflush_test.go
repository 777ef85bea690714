package raw

import (
	"context"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/aio/aiotest"
)

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
		r, err := New(context.Background(), aiotest.SyncCounter{File: f, N: &syncs}, Options{Writable: true})
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
