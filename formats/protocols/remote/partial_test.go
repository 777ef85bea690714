package remote

import (
	"bytes"
	"context"
	"errors"
	"math/rand"
	"sync"
	"testing"
	"time"
)

// A random read fetches the pages of its block that it covers, not the
// block; a later read that needs more of the block fetches the block
// whole, and every read gets the object's bytes.
func TestRandomReadsFetchOnlyTheirPages(t *testing.T) {
	m := &memBackend{data: patterned(32<<20 + 1000)}
	f := openMem(t, m, Options{})
	rng := rand.New(rand.NewSource(3))
	ctx := context.Background()
	// One read in every other 256 KiB region, in random order: no read
	// lands near another (a read within 64 KiB of one before may be a
	// stream going on, and gets its block).
	const region = 256 << 10
	regions := int64(len(m.data)) / region
	var want int64
	held := map[int64]bool{} // pages fetched
	for i, r := range rng.Perm(int(regions+1) / 2) {
		n := int64(4096)
		off := int64(r)*2*region + rng.Int63n(region/4096)*4096
		switch {
		case int64(r)*2 == regions: // the last, short block
			off, n = int64(len(m.data))-10, 10
		case i%3 == 0: // small, anywhere (across a page edge too)
			n = 1 + rng.Int63n(300)
			off = int64(r)*2*region + rng.Int63n(region-n)
		}
		p := make([]byte, n)
		if _, err := f.ReadAt(ctx, p, off); err != nil || !bytes.Equal(p, m.data[off:off+n]) {
			t.Fatalf("read %d at %d: %v, or wrong bytes", n, off, err)
		}
		lo, hi := off&^(page-1), min((off+n+page-1)&^(page-1), int64(len(m.data)))
		want += hi - lo
		for q := lo; q < hi; q += page {
			held[q] = true
		}
	}
	f.wg.Wait()
	asked := m.requests()
	for _, a := range asked {
		if a[0]%page != 0 || a[1] > 2*page || a[1]%page != 0 && a[0]+a[1] != int64(len(m.data)) {
			t.Fatalf("a random read asked for %d bytes at %d: want its pages", a[1], a[0])
		}
	}
	if got := m.bytes.Load(); got != want {
		t.Fatalf("%d random reads fetched %d bytes, their pages %d", len(asked), got, want)
	}
	// A page held is served without a request; its neighbour in the
	// block, not fetched, is not.
	q := make([]byte, 100)
	first := asked[0][0]
	if !f.TryReadAt(q, first) || !bytes.Equal(q, m.data[first:first+100]) {
		t.Fatalf("the page fetched at %d is not served from the cache", first)
	}
	other := first ^ page
	if held[other] {
		other = first ^ 2*page
	}
	if f.TryReadAt(q, other) {
		t.Fatalf("the page at %d was never fetched, yet read from the cache", other)
	}

	// The rest of a partly held block: fetched whole, once, then held.
	blk := first / DefaultBlockSize * DefaultBlockSize
	before := m.gets.Load()
	p := make([]byte, DefaultBlockSize)
	if _, err := f.ReadAt(ctx, p, blk); err != nil || !bytes.Equal(p, m.data[blk:blk+DefaultBlockSize]) {
		t.Fatalf("the block at %d whole: %v, or wrong bytes", blk, err)
	}
	if got := m.gets.Load() - before; got != 1 {
		t.Fatalf("the rest of a partly fetched block took %d requests, want 1", got)
	}
	if !f.TryReadAt(p, blk) || !bytes.Equal(p, m.data[blk:blk+DefaultBlockSize]) {
		t.Fatal("the block just read whole is not served from the cache")
	}
}

// Sequential readers still fetch whole blocks (and read ahead): only a
// read that starts no stream is partial.
func TestStreamsFetchWholeBlocks(t *testing.T) {
	m := &memBackend{data: patterned(8 << 20)}
	f := openMem(t, m, Options{})
	p := make([]byte, 4096)
	for off := int64(0); off < 4<<20; off += 4096 {
		if _, err := f.ReadAt(context.Background(), p, off); err != nil || !bytes.Equal(p, m.data[off:off+4096]) {
			t.Fatalf("read at %d: %v, or wrong bytes", off, err)
		}
	}
	f.wg.Wait()
	if g := m.gets.Load(); g > 30 {
		t.Fatalf("4 MiB read in 4 KiB pieces took %d requests", g)
	}
	// The first read is a page; the second, going on from it, its block
	// and the rest of its neighbourhood (no readahead yet: see follow).
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.asked[0] != [2]int64{0, 4096} || m.asked[1] != [2]int64{0, neighbourhood} {
		t.Fatalf("first requests %v, want a page then its neighbourhood", m.asked[:2])
	}
}

// Readers racing over a few blocks (a cache of 16), with requests in
// flight: random pages, reads across blocks, loans and cache hits, so
// that partial blocks are replaced while loading, while lent and while
// evicted. Every read gets the object's bytes; nothing stays referenced.
func TestPartialBlocksRacingWholeReads(t *testing.T) {
	m := &memBackend{data: patterned(40*DefaultBlockSize + 777), delay: time.Millisecond}
	f := openMem(t, m, Options{CacheSize: 1})
	size := int64(len(m.data))
	ctx := context.Background()
	var wg sync.WaitGroup
	for g := 0; g < 12; g++ {
		wg.Add(1)
		go func(seed int64) {
			defer wg.Done()
			rng := rand.New(rand.NewSource(seed))
			for i := 0; i < 150; i++ {
				n := 1 + rng.Int63n(2*page)
				if rng.Intn(4) == 0 {
					n = 1 + rng.Int63n(3*DefaultBlockSize)
				}
				n = min(n, size)
				off := rng.Int63n(size - n + 1)
				p := make([]byte, n)
				switch rng.Intn(3) {
				case 0:
					bufs, release, ok, err := f.LendAt(ctx, off, n, 128)
					if !ok || err != nil {
						t.Errorf("lend %d at %d: %v %v", n, off, ok, err)
						return
					}
					time.Sleep(time.Duration(rng.Intn(200)) * time.Microsecond)
					if got := bytes.Join(bufs, nil); !bytes.Equal(got, m.data[off:off+n]) {
						t.Errorf("lend %d at %d: wrong bytes", n, off)
					}
					release()
					continue
				case 1:
					if f.TryReadAt(p, off) {
						break
					}
					fallthrough
				default:
					if _, err := f.ReadAt(ctx, p, off); err != nil {
						t.Errorf("read %d at %d: %v", n, off, err)
						return
					}
				}
				if !bytes.Equal(p, m.data[off:off+n]) {
					t.Errorf("read %d at %d: wrong bytes", n, off)
				}
			}
		}(int64(g))
	}
	wg.Wait()
	checkCache(t, f, m.data)
}

// The same random reads again are all served from the cache (the warm
// rows of the bench): a block that replaces a partial one keeps the
// pages the old one held. (Replaced by another partial block, the pages
// of the first read in a block were lost: a fifth of a second pass
// missed.)
func TestSecondPassOfRandomReadsHitsTheCache(t *testing.T) {
	m := &memBackend{data: patterned(64 << 20)}
	f := openMem(t, m, Options{CacheSize: 128 << 20})
	rng := rand.New(rand.NewSource(4))
	offs := make([]int64, 3000)
	for i := range offs {
		offs[i] = rng.Int63n(int64(len(m.data))/4096) * 4096
	}
	p := make([]byte, 4096)
	for pass := range 2 {
		before := m.gets.Load()
		for _, off := range offs {
			if !f.TryReadAt(p, off) {
				if pass == 1 {
					t.Fatalf("second pass: the read at %d missed the cache", off)
				}
				if _, err := f.ReadAt(context.Background(), p, off); err != nil {
					t.Fatal(err)
				}
			}
			if !bytes.Equal(p, m.data[off:off+4096]) {
				t.Fatalf("pass %d: read at %d: wrong bytes", pass, off)
			}
		}
		f.wg.Wait()
		if got := m.gets.Load() - before; pass == 1 && got != 0 {
			t.Fatalf("second pass: %d requests", got)
		}
	}
}

// A partial block evicted while its GET is in flight (a read of another
// page of the block replaces it) completes for its reader, stays out of
// the cache, and its buffer goes back once: the cache then holds the
// replacement and the neighbours it brought (the object is one
// neighbourhood), in the map and the LRU.
func TestPartialBlockEvictedWhileLoading(t *testing.T) {
	m := &memBackend{data: patterned(8 * DefaultBlockSize), delay: 300 * time.Millisecond}
	f := openMem(t, m, Options{})
	base := int64(5 * DefaultBlockSize)
	first := make(chan error, 1)
	go func() {
		p := make([]byte, 100)
		_, err := f.ReadAt(context.Background(), p, base)
		if err == nil && !bytes.Equal(p, m.data[base:base+100]) {
			err = errors.New("wrong bytes")
		}
		first <- err
	}()
	awaitGets(t, m, 1) // the first read's GET is in flight
	p := make([]byte, 100)
	if _, err := f.ReadAt(context.Background(), p, base+2*page); err != nil || !bytes.Equal(p, m.data[base+2*page:base+2*page+100]) {
		t.Fatalf("the read that replaced the loading block: %v, or wrong bytes", err)
	}
	if err := <-first; err != nil {
		t.Fatalf("the evicted block's reader: %v", err)
	}
	checkCache(t, f, m.data)
	asked := m.requests()
	if len(asked) != 2 || asked[0] != [2]int64{base, page} || asked[1] != [2]int64{0, 8 * DefaultBlockSize} {
		t.Fatalf("requests %v, want the page, then the neighbourhood", asked)
	}
	f.mu.Lock()
	held := len(f.blocks)
	f.mu.Unlock()
	if held != 8 {
		t.Fatalf("the cache holds %d blocks, want the replacement and its 7 neighbours", held)
	}
}
