package raw

import (
	"context"
	"fmt"
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

// TestFlushWithNothingWrittenDoesNotSync: Flush syncs only what was
// written since the last flush: nothing after the open or after another
// flush, once after a write, a try-write, a zeroing, a discard or a
// resize.
func TestFlushWithNothingWrittenDoesNotSync(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "r.img")
	if err := os.WriteFile(path, make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := aio.Open(path, aio.Options{Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	var syncs atomic.Int64
	r, err := New(ctx, aiotest.SyncCounter{File: f, N: &syncs}, Options{Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	flush := func(what string, want int64) {
		t.Helper()
		before := syncs.Load()
		if err := r.Flush(ctx); err != nil {
			t.Fatal(err)
		}
		if got := syncs.Load() - before; got != want {
			t.Fatalf("a flush %s: %d syncs, want %d", what, got, want)
		}
	}
	flush("right after the open", 0)
	changes := []struct {
		what string
		do   func() error
	}{
		{"after a write", func() error { _, err := r.WriteAt(ctx, []byte("x"), 4096); return err }},
		{"after a try-write", func() error {
			if ok, err := r.TryWriteAt([]byte("y"), 8192); !ok || err != nil {
				return fmt.Errorf("try-write: %v, %v", ok, err)
			}
			return nil
		}},
		{"after a zeroing", func() error { return r.WriteZeroes(ctx, 0, 4096, false) }},
		{"after a discard", func() error { return r.Discard(ctx, 0, 4096) }},
		{"after a resize", func() error { return r.Resize(ctx, 2<<20) }},
	}
	for _, c := range changes {
		if err := c.do(); err != nil {
			t.Fatalf("%s: %v", c.what, err)
		}
		flush(c.what, 1)
		flush(c.what+" and a flush", 0)
	}
}
