package qcow2

import (
	"bytes"
	"context"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/aio/aiotest"
)

// SetNoFlush (convert's -t unsafe, qemu-img convert's default): a Flush
// writes the metadata back without one fdatasync, and the image is then
// complete: qemu-img check finds it clean and it reads back as written.
// Without it the same writes and Flush sync (the counter sees it).
func TestNoFlushWritesMetadataWithoutSync(t *testing.T) {
	for _, noFlush := range []bool{false, true} {
		ctx := context.Background()
		img := filepath.Join(t.TempDir(), "n.qcow2")
		const size = 8 << 20
		if err := Create(img, CreateOptions{Size: size, ClusterSize: 65536}); err != nil {
			t.Fatal(err)
		}
		f, err := openTestFile(img, testOpts{Writable: true, Backend: aio.Threads})
		if err != nil {
			t.Fatal(err)
		}
		var syncs atomic.Int64
		q, err := New(context.Background(), aiotest.SyncCounter{File: f, N: &syncs}, Options{Writable: true})
		if err != nil {
			t.Fatal(err)
		}
		q.SetNoFlush(noFlush)
		data := bytes.Repeat([]byte("blockexport"), 300000)[:3<<20]
		if _, err := q.WriteAt(ctx, data, 1<<20); err != nil {
			t.Fatal(err)
		}
		if err := q.Flush(ctx); err != nil {
			t.Fatal(err)
		}
		if err := q.Close(); err != nil {
			t.Fatal(err)
		}
		switch n := syncs.Load(); {
		case noFlush && n != 0:
			t.Fatalf("SetNoFlush(true): %d syncs, want none", n)
		case !noFlush && n == 0:
			t.Fatal("SetNoFlush(false): the flush synced nothing")
		}
		checkClean(t, img)
		r := openRW(t, img)
		got := make([]byte, len(data))
		if _, err := r.ReadAt(ctx, got, 1<<20); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("noFlush %v: reads back wrong (%v)", noFlush, err)
		}
		r.Close()
	}
}
