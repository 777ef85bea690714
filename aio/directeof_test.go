package aio

import (
	"context"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"
)

// TestDirectReadOfAGrowingTail: an O_DIRECT file whose end is off a
// block boundary (qemu-img leaves a qcow2 image with 512-byte clusters
// so) is read in its last block while another writer grows it. The read
// comes back short at the old end; its continuation there, off the block
// boundary, must end the read as at the end of the file, not fail with
// EINVAL once the file has grown (a qcow2 metadata write's
// read-modify-write of the first block failed so, under the qcow2 race
// attack with --cache none).
func TestDirectReadOfAGrowingTail(t *testing.T) {
	for _, backend := range []Backend{IOUring, Threads} {
		t.Run(string(backend), func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "f")
			if err := os.WriteFile(path, make([]byte, 1800), 0o644); err != nil {
				t.Fatal(err)
			}
			raw, err := Open(path, Options{Backend: backend, Writable: true, Direct: true})
			if err != nil {
				t.Skipf("O_DIRECT not available here: %v", err)
			}
			f := Aligned(raw, LogicalBlockSize(raw.Fd()))
			defer f.Close()
			g, err := os.OpenFile(path, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer g.Close()
			var stop atomic.Bool
			done := make(chan struct{})
			go func() {
				defer close(done)
				for !stop.Load() {
					g.Truncate(8192)
					g.Truncate(1800)
				}
			}()
			defer func() { stop.Store(true); <-done }()
			ctx := context.Background()
			p := make([]byte, 7)
			for i, start := 0, time.Now(); time.Since(start) < 300*time.Millisecond; i++ {
				if _, err := f.ReadAt(ctx, p, 100); err != nil {
					t.Fatalf("read %d: %v", i, err)
				}
				if _, err := f.WriteAt(ctx, p, 200); err != nil {
					t.Fatalf("write %d (read-modify-write): %v", i, err)
				}
			}
		})
	}
}
