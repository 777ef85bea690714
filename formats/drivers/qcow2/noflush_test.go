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

// TestFlushWithNothingWrittenDoesNotSync: a flush syncs only what was
// written since the last one (QEMU's write generation): none right after
// the open, none for a second flush or the Close after one, and one
// again for a write in place (a cluster already allocated: no metadata
// dirty, only the data to make durable), which Close makes durable too
// when no flush came first.
func TestFlushWithNothingWrittenDoesNotSync(t *testing.T) {
	ctx := context.Background()
	img := filepath.Join(t.TempDir(), "g.qcow2")
	if err := Create(img, CreateOptions{Size: 8 << 20, ClusterSize: 65536}); err != nil {
		t.Fatal(err)
	}
	var syncs atomic.Int64
	open := func() *Image {
		t.Helper()
		f, err := openTestFile(img, testOpts{Writable: true, Backend: aio.Threads})
		if err != nil {
			t.Fatal(err)
		}
		q, err := New(ctx, aiotest.SyncCounter{File: f, N: &syncs}, Options{Writable: true})
		if err != nil {
			t.Fatal(err)
		}
		return q
	}
	step := func(what string, do func() error, wantSync bool) {
		t.Helper()
		before := syncs.Load()
		if err := do(); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if got := syncs.Load() - before; got > 0 != wantSync {
			t.Fatalf("%s: %d syncs, want them: %v", what, got, wantSync)
		}
	}
	data := bytes.Repeat([]byte{0xab}, 4096)
	write := func(q *Image) func() error {
		return func() error { _, err := q.WriteAt(ctx, data, 1<<20); return err }
	}
	q := open()
	step("a flush after the open", func() error { return q.Flush(ctx) }, false)
	step("the first write (allocating)", write(q), false)
	step("its flush", func() error { return q.Flush(ctx) }, true)
	step("a second flush", func() error { return q.Flush(ctx) }, false)
	step("a write in place", write(q), false)
	step("its flush", func() error { return q.Flush(ctx) }, true)
	step("the close after it", q.Close, false)
	q = open()
	step("a close with nothing written", q.Close, false)
	q = open()
	step("a write in place", write(q), false)
	ok, err := q.TryWriteAt(data, 1<<20)
	if !ok || err != nil {
		t.Fatalf("a try-write in place: %v, %v", ok, err)
	}
	step("the close after writes in place, without a flush", q.Close, true)
	checkClean(t, img)
}
