package remote

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// joined is what lent slices hold, in order.
func joined(bufs [][]byte) []byte { return bytes.Join(bufs, nil) }

// Lent ranges hold the object's bytes, within the slices asked for, and
// what is out of reach (past the end, more slices than allowed) is not
// lent.
func TestLendAtHoldsTheObject(t *testing.T) {
	m := &memBackend{data: patterned(3<<20 + 4321)}
	f := openMem(t, m, Options{CacheSize: 1 << 20})
	size := int64(len(m.data))
	rng := rand.New(rand.NewSource(2))
	ctx := context.Background()
	for i := 0; i < 300; i++ {
		n := 1 + rng.Int63n(300<<10)
		off := rng.Int63n(size - n + 1)
		bufs, release, ok, err := f.LendAt(ctx, off, n, 1000)
		if !ok || err != nil {
			t.Fatalf("lend %d at %d: ok %v, err %v", n, off, ok, err)
		}
		if want := (off+n-1)/f.bs - off/f.bs + 1; int64(len(bufs)) != want {
			t.Fatalf("lend %d at %d: %d slices, want one a block (%d)", n, off, len(bufs), want)
		}
		if got := joined(bufs); !bytes.Equal(got, m.data[off:off+n]) {
			t.Fatalf("lend %d at %d: wrong bytes (%d of them)", n, off, len(got))
		}
		release()
	}
	for _, c := range []struct {
		name    string
		off, n  int64
		maxBufs int
	}{
		{"past the end", size - 10, 11, 1000},
		{"at the end", size, 1, 1000},
		{"offset near 2^63", 1<<63 - 10, 5, 1000},
		{"negative offset", -1, 5, 1000},
		{"nothing", 0, 0, 1000},
		{"more slices than allowed", f.bs - 1, f.bs + 2, 2}, // three blocks
	} {
		if bufs, release, ok, err := f.LendAt(ctx, c.off, c.n, c.maxBufs); ok || err != nil || bufs != nil || release != nil {
			t.Fatalf("%s: lent (ok %v, err %v, %d slices)", c.name, ok, err, len(bufs))
		}
	}
	// Exactly as many slices as allowed is lent.
	if _, release, ok, err := f.LendAt(ctx, f.bs-1, f.bs+2, 3); !ok || err != nil {
		t.Fatalf("three blocks in three slices: ok %v, err %v", ok, err)
	} else {
		release()
	}
}

// A lent block is neither evicted nor reused while lent, however many
// other reads go through a cache too small to keep it; after release it
// is.
func TestLentBlocksOutliveEviction(t *testing.T) {
	m := &memBackend{data: patterned(8 << 20)}
	f := openMem(t, m, Options{CacheSize: 16 * DefaultBlockSize}) // the least: 16 blocks
	ctx := context.Background()
	off, n := int64(5<<20+100), int64(3*DefaultBlockSize)
	bufs, release, ok, err := f.LendAt(ctx, off, n, 8)
	if !ok || err != nil {
		t.Fatalf("ok %v, err %v", ok, err)
	}
	rng := rand.New(rand.NewSource(3))
	p := make([]byte, 64<<10)
	for i := 0; i < 200; i++ {
		o := rng.Int63n(int64(len(m.data)) - int64(len(p)))
		if _, err := f.ReadAt(ctx, p, o); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(p, m.data[o:o+int64(len(p))]) {
			t.Fatalf("read at %d: wrong bytes", o)
		}
	}
	if !bytes.Equal(joined(bufs), m.data[off:off+n]) {
		t.Fatal("a lent block changed under its loan while other reads evicted it")
	}
	release()
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, b := range f.blocks {
		if b.refs != 0 {
			t.Fatalf("block %d still referenced (%d) after every loan and read ended", b.idx, b.refs)
		}
	}
	if len(f.blocks) > f.capacity {
		t.Fatalf("cache holds %d blocks, capacity %d", len(f.blocks), f.capacity)
	}
}

// Readers that find the cache all loading overshoot it (their own blocks
// are never refused), and once their loads complete the cache is back
// within its capacity: the overshoot is not kept until the next insert.
func TestOvershootEndsWithTheLoads(t *testing.T) {
	const readers = 24
	bs := int64(DefaultBlockSize)
	// Every GET waits at the gate until every reader's block is in.
	gate := make(chan struct{})
	m := &memBackend{data: patterned(int(5 * readers * bs)), fail: gated(gate)}
	f := openMem(t, m, Options{CacheSize: 16 * DefaultBlockSize})
	var wg sync.WaitGroup
	errs := make(chan error, readers)
	for k := range readers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Five blocks apart: each read is a stream of its own, so
			// none earns readahead.
			off := int64(k) * 5 * bs
			p := make([]byte, 4096)
			if _, err := f.ReadAt(context.Background(), p, off); err != nil {
				errs <- err
			} else if !bytes.Equal(p, m.data[off:off+4096]) {
				errs <- fmt.Errorf("read at %d: wrong bytes", off)
			}
		}()
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		f.mu.Lock()
		n := len(f.blocks)
		f.mu.Unlock()
		if n == readers {
			break // the cache overshot: every reader's block is in
		}
		if time.Now().After(deadline) {
			close(gate)
			t.Fatalf("%d of %d readers' blocks in the cache (capacity %d)", n, readers, f.capacity)
		}
		time.Sleep(time.Millisecond)
	}
	close(gate)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.blocks) > f.capacity {
		t.Fatalf("cache holds %d blocks after every load ended, capacity %d", len(f.blocks), f.capacity)
	}
}

// A loan whose fetch fails is an error (EIO), lends nothing and holds
// no block; a cancelled borrower gets its context's error at once.
func TestLendAtFailures(t *testing.T) {
	m := &memBackend{data: patterned(1 << 20), fail: func(int64, context.Context) error { return errors.New("403 Forbidden") }}
	f := openMem(t, m, Options{})
	bufs, release, ok, err := f.LendAt(context.Background(), 100, 5000, 8)
	if !ok || !errors.Is(err, unix.EIO) || bufs != nil || release != nil {
		t.Fatalf("ok %v, err %v, %d slices: want an EIO and nothing lent", ok, err, len(bufs))
	}
	m2 := &memBackend{data: patterned(1 << 20), delay: 300 * 1e6}
	f2 := openMem(t, m2, Options{})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, _, ok, err := f2.LendAt(ctx, 0, 10, 8); !ok || !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled: ok %v, err %v", ok, err)
	}
	f2.mu.Lock()
	defer f2.mu.Unlock()
	for _, b := range f2.blocks {
		if b.refs != 0 {
			t.Fatalf("block %d referenced (%d) by a loan that failed", b.idx, b.refs)
		}
	}
}
