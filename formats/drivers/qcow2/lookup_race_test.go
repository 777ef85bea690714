package qcow2

import (
	"bytes"
	"context"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/blockexport/blockexport/aio"
)

// gateFile holds the first read at offset gate (once armed) until open is
// closed, and says on held when it has one.
type gateFile struct {
	aio.File
	mu    sync.Mutex
	gate  int64 // -1: none
	held  chan struct{}
	open  chan struct{}
	armed bool
}

func (g *gateFile) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	g.mu.Lock()
	hold := g.armed && off == g.gate
	if hold {
		g.armed = false
	}
	g.mu.Unlock()
	if hold {
		close(g.held)
		<-g.open
	}
	return g.File.ReadAt(ctx, p, off)
}

// A read whose L2 table is not in memory decodes its entry against the
// file's end as it is once the table is read, not as it was before: a
// write that allocated the read's cluster past the old end and wrote the
// table back meanwhile made the read fail with "data cluster ... beyond
// the end of the file" (found by TestRaceAttack with 512-byte clusters).
func TestLookupDecodesAgainstTheEndAfterTheTableRead(t *testing.T) {
	img := filepath.Join(t.TempDir(), "race.qcow2")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=512", img, "1M")
	f, err := openTestFile(img, testOpts{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	g := &gateFile{File: f, gate: -1}
	// One 512-byte L2 table of cache: the second table written evicts
	// the first once both are written back.
	q, err := New(context.Background(), g, Options{Writable: true, L2CacheSize: 512})
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	ctx := context.Background()
	// 64 entries of 512 bytes per table: table A maps [0, 32 KiB), B the next.
	a := bytes.Repeat([]byte{0xa1}, 512)
	if _, err := q.WriteAt(ctx, a, 0); err != nil {
		t.Fatal(err)
	}
	if err := q.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := q.WriteAt(ctx, a, 32<<10); err != nil {
		t.Fatal(err)
	}
	if err := q.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	q.meta.RLock()
	l2a := int64(q.l1[0] & l1OffsetMask)
	_, cached := q.cachedL2(l2a)
	q.meta.RUnlock()
	if cached {
		t.Fatal("table A is still in memory: the test needs it read from the file")
	}

	// The reader of cluster 2 snapshots the end and stalls reading table A.
	g.mu.Lock()
	g.gate, g.armed, g.held, g.open = l2a, true, make(chan struct{}), make(chan struct{})
	g.mu.Unlock()
	type res struct {
		p   []byte
		err error
	}
	done := make(chan res, 1)
	go func() {
		p := make([]byte, 512)
		_, err := q.ReadAt(ctx, p, 2*512)
		done <- res{p, err}
	}()
	select {
	case <-g.held:
	case <-time.After(5 * time.Second):
		t.Fatal("the read never read table A from the file")
	}
	// Meanwhile a write allocates cluster 2 past that end, and the table
	// goes back to the file.
	w := bytes.Repeat([]byte{0x5c}, 512)
	if _, err := q.WriteAt(ctx, w, 2*512); err != nil {
		t.Fatal(err)
	}
	if err := q.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	close(g.open)
	r := <-done
	if r.err != nil {
		t.Fatalf("the read racing the allocation failed: %v", r.err)
	}
	if !bytes.Equal(r.p, w) && !bytes.Equal(r.p, make([]byte, 512)) {
		t.Fatal("the read racing the allocation read neither the old zeroes nor the new data")
	}
}
