package remote

import (
	"bytes"
	"context"
	"math/rand"
	"testing"
	"time"
)

// settled waits for a grow under way to end and returns the spare
// buffers and how many buffers were made.
func settled(t *testing.T, f *File) (free, made int) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		f.mu.Lock()
		growing, free, made := f.growing, len(f.free), f.made
		f.mu.Unlock()
		if !growing {
			return free, made
		}
		if time.Now().After(deadline) {
			t.Fatal("a grow never ended")
		}
	}
}

// A cold read leaves fresh buffers made ahead of the next reads (one
// slab, faulted in at once), every spare buffer is a whole block, and
// however much is read the cache never makes more buffers than it holds
// (plus what one GET may take while a grow is under way).
func TestFreshBuffersAreMadeAhead(t *testing.T) {
	m := &memBackend{data: patterned(8 << 20)}
	f := openMem(t, m, Options{CacheSize: 4 << 20}) // 256 blocks
	ctx := context.Background()
	p := make([]byte, 4096)
	if _, err := f.ReadAt(ctx, p, 100<<10); err != nil {
		t.Fatal(err)
	}
	free, _ := settled(t, f)
	if want := int(growBytes/f.bs) - 1; free < want {
		t.Fatalf("%d spare buffers after a cold read, want at least %d made ahead", free, want)
	}
	rng := rand.New(rand.NewSource(4))
	q := make([]byte, 256<<10)
	for i := 0; i < 400; i++ {
		var off int64
		if i%2 == 0 {
			off = int64(i/2) * int64(len(q)) % (int64(len(m.data)) - int64(len(q)))
		} else {
			off = rng.Int63n(int64(len(m.data)) - int64(len(q)))
		}
		if _, err := f.ReadAt(ctx, q, off); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(q, m.data[off:off+int64(len(q))]) {
			t.Fatalf("read at %d: wrong bytes", off)
		}
	}
	bound := f.capacity + int(maxGet/f.bs)
	if _, made := settled(t, f); made > bound {
		t.Fatalf("%d buffers made for a cache of %d blocks (bound %d)", made, f.capacity, bound)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, d := range f.free {
		if int64(len(d)) != f.bs || int64(cap(d)) != f.bs {
			t.Fatalf("a spare buffer of len %d, cap %d: want one block (%d)", len(d), cap(d), f.bs)
		}
	}
}

// A grow that ends after Close adds nothing: a closed file holds no
// buffers.
func TestGrowAfterCloseAddsNothing(t *testing.T) {
	m := &memBackend{data: patterned(1 << 20)}
	f, err := Open(context.Background(), m, Options{})
	if err != nil {
		t.Fatal(err)
	}
	f.mu.Lock()
	f.growing = true
	f.mu.Unlock()
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	f.grow(4)
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.free != nil || f.growing {
		t.Fatalf("closed file: %d spare buffers, growing %v", len(f.free), f.growing)
	}
}

// A small object is not given buffers it has no blocks for: reading a
// 40 KiB object (three blocks) whole makes a grow of four (the object's
// blocks, rounded up) and the GET's own three while it runs, not a
// MiB's worth.
func TestGrowStopsAtTheObjectsBlocks(t *testing.T) {
	m := &memBackend{data: patterned(40 << 10)}
	f := openMem(t, m, Options{})
	p := make([]byte, len(m.data))
	if _, err := f.ReadAt(context.Background(), p, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(p, m.data) {
		t.Fatal("wrong bytes")
	}
	if _, made := settled(t, f); made > 7 {
		t.Fatalf("%d buffers made for an object of 3 blocks", made)
	}
}
