package remote

// Attacks on partial blocks (a random read fetching
// only its pages): after each, checkCache holds the cache to its
// invariants (every entry loaded and unreferenced, the LRU and the map
// the same blocks, no buffer in two places, each block's held bytes the
// object's).

import (
	"bytes"
	"context"
	"errors"
	"math/rand"
	"sync"
	"testing"
	"time"
)

// waitReaders fails the test if wg's readers have not all returned
// within d: a reader waiting on a block nobody completes.
func waitReaders(t *testing.T, wg *sync.WaitGroup, d time.Duration) {
	t.Helper()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatal("readers hang")
	}
}

// Partial reads of one block racing, with loans held across orphaning,
// readers giving up, zero-length reads, reads at the short end,
// sequential streams whose readahead orphans partial blocks, and failing
// GETs; several block sizes and backends without vectors.
func TestPartialAttackStress(t *testing.T) {
	for _, tc := range []struct {
		name  string
		bs    int
		plain bool
		fail  bool
	}{
		{"16k", 0, false, false},
		{"16k-fail", 0, false, true},
		{"8k-plain", 8192, true, false},
		{"64k", 64 << 10, false, false},
		{"64k-fail-plain", 64 << 10, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bs := int64(tc.bs)
			if bs == 0 {
				bs = DefaultBlockSize
			}
			m := &memBackend{data: patterned(int(20*bs + 5*page + 333))}
			var failMu sync.Mutex
			frng := rand.New(rand.NewSource(9))
			m.fail = func(n int64, ctx context.Context) error {
				failMu.Lock()
				d := time.Duration(frng.Intn(400)) * time.Microsecond
				bad := tc.fail && frng.Intn(8) == 0
				failMu.Unlock()
				time.Sleep(d)
				if bad {
					return errors.New("403 injected")
				}
				return nil
			}
			var be Backend = m
			if tc.plain {
				be = plainBackend{m}
			}
			f, err := Open(context.Background(), be, Options{BlockSize: tc.bs, CacheSize: 1, Connections: 3})
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			size := int64(len(m.data))
			var wg sync.WaitGroup
			for g := 0; g < 8; g++ {
				wg.Add(1)
				go func(seed int64) {
					defer wg.Done()
					rng := rand.New(rand.NewSource(seed))
					seq := int64(-1)
					for i := 0; i < 250; i++ {
						var off, n int64
						switch rng.Intn(6) {
						case 0: // near the end
							n = 1 + rng.Int63n(2*page)
							off = size - n - rng.Int63n(3)
							if off < 0 {
								off = 0
							}
						case 1: // a stream
							if seq < 0 || seq >= size {
								seq = rng.Int63n(size / 2)
							}
							off, n = seq, min(page, size-seq)
							seq += n
						case 2: // zero length
							off, n = rng.Int63n(size), 0
						default: // a page or less, somewhere in a few blocks
							n = 1 + rng.Int63n(page)
							off = rng.Int63n(size - n + 1)
						}
						if n > 0 && rng.Intn(3) == 0 {
							bufs, release, ok, err := f.LendAt(context.Background(), off, n, 64)
							if err != nil {
								if !tc.fail {
									t.Errorf("lend %d at %d: %v, with no GET failing", n, off, err)
								}
								continue
							}
							if !ok {
								t.Errorf("lend %d at %d refused", n, off)
								return
							}
							time.Sleep(time.Duration(rng.Intn(300)) * time.Microsecond)
							if !bytes.Equal(bytes.Join(bufs, nil), m.data[off:off+n]) {
								t.Errorf("lend %d at %d: wrong bytes", n, off)
							}
							release()
							continue
						}
						p := make([]byte, n)
						if n > 0 && rng.Intn(3) == 0 && f.TryReadAt(p, off) {
							if !bytes.Equal(p, m.data[off:off+n]) {
								t.Errorf("try %d at %d: wrong bytes", n, off)
							}
							continue
						}
						ctx := context.Background()
						var cancel context.CancelFunc = func() {}
						if rng.Intn(5) == 0 {
							ctx, cancel = context.WithTimeout(ctx, time.Duration(rng.Intn(300))*time.Microsecond)
						}
						k, err := f.ReadAt(ctx, p, off)
						cancel()
						if err != nil {
							if !tc.fail && !errors.Is(err, context.DeadlineExceeded) {
								t.Errorf("read %d at %d: %v, with no GET failing", n, off, err)
							}
							continue
						}
						if !bytes.Equal(p[:k], m.data[off:off+int64(k)]) {
							t.Errorf("read %d at %d: wrong bytes", n, off)
						}
					}
				}(int64(g) + 100*bs)
			}
			waitReaders(t, &wg, 60*time.Second)
			checkCache(t, f, m.data)
		})
	}
}

// Close while partial blocks (some orphaned, some lent) are loading: no
// reader hangs, and a loan taken before Close still reads the object.
func TestPartialAttackCloseDuringLoads(t *testing.T) {
	for round := 0; round < 5; round++ {
		m := &memBackend{data: patterned(30*DefaultBlockSize + 100), delay: 2 * time.Millisecond}
		f, err := Open(context.Background(), m, Options{CacheSize: 1})
		if err != nil {
			t.Fatal(err)
		}
		size := int64(len(m.data))
		var wg sync.WaitGroup
		for g := 0; g < 6; g++ {
			wg.Add(1)
			go func(seed int64) {
				defer wg.Done()
				rng := rand.New(rand.NewSource(seed))
				for i := 0; i < 40; i++ {
					n := 1 + rng.Int63n(page)
					off := rng.Int63n(size - n + 1)
					bufs, release, ok, err := f.LendAt(context.Background(), off, n, 8)
					if err != nil {
						continue
					}
					if !ok {
						t.Errorf("refused")
						return
					}
					time.Sleep(time.Millisecond)
					if !bytes.Equal(bytes.Join(bufs, nil), m.data[off:off+n]) {
						t.Errorf("lend %d at %d: wrong bytes", n, off)
					}
					release()
				}
			}(int64(round*10 + g))
		}
		time.Sleep(time.Duration(5+round*3) * time.Millisecond)
		f.Close()
		waitReaders(t, &wg, 20*time.Second)
	}
}

// A partial block whose GET fails: its reader gets EIO, the block leaves
// the map, and a reread of the block (page, rest) gets the object.
func TestPartialAttackFailedGet(t *testing.T) {
	m := &memBackend{data: patterned(8 * DefaultBlockSize)}
	m.fail = func(n int64, _ context.Context) error {
		if n == 1 {
			return errors.New("403 once")
		}
		return nil
	}
	f := openMem(t, m, Options{})
	off := int64(3*DefaultBlockSize + page)
	if _, err := f.ReadAt(context.Background(), make([]byte, 100), off); err == nil {
		t.Fatal("no error")
	}
	checkCache(t, f, m.data)
	for _, o := range []int64{off, off + page, off - page} {
		p := make([]byte, 200)
		if _, err := f.ReadAt(context.Background(), p, o); err != nil || !bytes.Equal(p, m.data[o:o+200]) {
			t.Fatalf("read at %d after a failed partial: %v", o, err)
		}
	}
	checkCache(t, f, m.data)
}

// A partial page that failed to load, orphaned while loading by a read of
// its neighbour: the waiter of the first gets an error, not bytes.
func TestPartialAttackOrphanedThenFailed(t *testing.T) {
	m := &memBackend{data: patterned(8 * DefaultBlockSize), delay: 300 * time.Millisecond}
	m.fail = func(n int64, _ context.Context) error {
		if n == 1 {
			return errors.New("403 first")
		}
		return nil
	}
	f := openMem(t, m, Options{})
	base := int64(5 * DefaultBlockSize)
	errc := make(chan error, 1)
	go func() {
		p := make([]byte, 100)
		_, err := f.ReadAt(context.Background(), p, base)
		errc <- err
	}()
	awaitGets(t, m, 1) // the first read's GET is in flight
	p := make([]byte, 100)
	if _, err := f.ReadAt(context.Background(), p, base+2*page); err != nil || !bytes.Equal(p, m.data[base+2*page:base+2*page+100]) {
		t.Fatalf("neighbour: %v", err)
	}
	if err := <-errc; err == nil {
		t.Fatal("the failed partial's reader got no error")
	}
	checkCache(t, f, m.data)
	// The whole block is there now.
	q := make([]byte, DefaultBlockSize)
	if !f.TryReadAt(q, base) || !bytes.Equal(q, m.data[base:base+DefaultBlockSize]) {
		t.Fatal("the replacing block is not cached whole")
	}
}

// Reads at the short last block: a page straddling the end, the last
// byte, reads across the last two blocks; and TryReadAt/LendAt never
// serve what the partial block lacks.
func TestPartialAttackShortLastBlock(t *testing.T) {
	for _, size := range []int{
		10*DefaultBlockSize + 1, 10*DefaultBlockSize + page, 10*DefaultBlockSize + page + 1,
		10*DefaultBlockSize + 3*page + 7, 11*DefaultBlockSize - 1,
	} {
		m := &memBackend{data: patterned(size)}
		f := openMem(t, m, Options{})
		s := int64(size)
		rng := rand.New(rand.NewSource(int64(size)))
		for i := 0; i < 200; i++ {
			n := 1 + rng.Int63n(2*page)
			off := s - n - rng.Int63n(min(s-n, 2*DefaultBlockSize))
			if rng.Intn(4) == 0 {
				// a far random read first, so the next is random too
				far := rng.Int63n(4 * DefaultBlockSize)
				f.ReadAt(context.Background(), make([]byte, 1), far)
			}
			p := make([]byte, n)
			switch rng.Intn(3) {
			case 0:
				if f.TryReadAt(p, off) && !bytes.Equal(p, m.data[off:off+n]) {
					t.Fatalf("size %d: try %d at %d wrong", size, n, off)
				}
			case 1:
				bufs, rel, ok, err := f.LendAt(context.Background(), off, n, 8)
				if !ok || err != nil {
					t.Fatalf("size %d: lend %d at %d: %v %v", size, n, off, ok, err)
				}
				if !bytes.Equal(bytes.Join(bufs, nil), m.data[off:off+n]) {
					t.Fatalf("size %d: lend %d at %d wrong", size, n, off)
				}
				rel()
			default:
				q := make([]byte, n+int64(rng.Intn(100)))
				k, _ := f.ReadAt(context.Background(), q, off)
				if !bytes.Equal(q[:k], m.data[off:off+int64(k)]) || int64(k) < n {
					t.Fatalf("size %d: read %d at %d wrong (%d)", size, n, off, k)
				}
			}
		}
		checkCache(t, f, m.data)
	}
}

// A zero-length read inside a partial block, at a page it lacks: it
// fetches nothing and leaves the block as it was (it replaced it with
// the whole block once).
func TestPartialAttackZeroLengthRead(t *testing.T) {
	m := &memBackend{data: patterned(16 * DefaultBlockSize)}
	f := openMem(t, m, Options{})
	blk := int64(7 * DefaultBlockSize)
	p := make([]byte, 100)
	if _, err := f.ReadAt(context.Background(), p, blk); err != nil || !bytes.Equal(p, m.data[blk:blk+100]) {
		t.Fatal(err)
	}
	before := m.gets.Load()
	if _, err := f.ReadAt(context.Background(), nil, blk+2*page); err != nil {
		t.Fatal(err)
	}
	f.wg.Wait()
	if !f.TryReadAt(p, blk) {
		t.Errorf("a zero-length read dropped the cached page")
	}
	if got := m.gets.Load() - before; got != 0 {
		m.mu.Lock()
		t.Errorf("a zero-length read made %d requests: %v", got, m.asked)
		m.mu.Unlock()
	}
	checkCache(t, f, m.data)
}

// A loan of a partial block survives its orphaning, the replacement's
// load and a churn of the cache through many other blocks: the lent
// bytes never change; afterwards the buffers are each in one place.
func TestPartialAttackLoanOutlivesOrphanAndChurn(t *testing.T) {
	m := &memBackend{data: patterned(200 * DefaultBlockSize)}
	f := openMem(t, m, Options{CacheSize: 1}) // 16 blocks
	ctx := context.Background()
	blk := int64(50 * DefaultBlockSize)
	bufs, release, ok, err := f.LendAt(ctx, blk+10, 100, 4)
	if !ok || err != nil {
		t.Fatal(ok, err)
	}
	snap := bytes.Join(bufs, nil)
	// The neighbour page: orphans the lent partial block.
	p := make([]byte, 100)
	if _, err := f.ReadAt(ctx, p, blk+3*page); err != nil || !bytes.Equal(p, m.data[blk+3*page:blk+3*page+100]) {
		t.Fatal(err)
	}
	// A stream through the block's neighbourhood (readahead), then random
	// reads everywhere: the cache turns over many times.
	q := make([]byte, 8192)
	for off := blk - 4*DefaultBlockSize; off < blk+40*DefaultBlockSize; off += 8192 {
		f.ReadAt(ctx, q, off)
	}
	rng := rand.New(rand.NewSource(5))
	for i := 0; i < 500; i++ {
		off := rng.Int63n(int64(len(m.data)) - 100)
		f.ReadAt(ctx, p, off)
		if !bytes.Equal(p, m.data[off:off+100]) {
			t.Fatalf("read at %d wrong", off)
		}
	}
	f.wg.Wait()
	if got := bytes.Join(bufs, nil); !bytes.Equal(got, snap) || !bytes.Equal(got, m.data[blk+10:blk+110]) {
		t.Fatal("the lent bytes changed while lent")
	}
	release()
	checkCache(t, f, m.data)
}

// A partial block whose only reader gave up, orphaned while loading: it
// completes to nobody and its buffer is recycled once.
func TestPartialAttackAbandonedOrphan(t *testing.T) {
	for round := 0; round < 20; round++ {
		m := &memBackend{data: patterned(40 * DefaultBlockSize), delay: 3 * time.Millisecond}
		f := openMem(t, m, Options{CacheSize: 1})
		ctx := context.Background()
		for k := int64(0); k < 30; k++ {
			blk := k * DefaultBlockSize
			c, cancel := context.WithTimeout(ctx, time.Millisecond)
			f.ReadAt(c, make([]byte, 10), blk+page) // gives up
			cancel()
			if round%2 == 0 {
				time.Sleep(time.Duration(k%4) * time.Millisecond)
			}
			p := make([]byte, 10)
			if _, err := f.ReadAt(ctx, p, blk+3*page); err != nil || !bytes.Equal(p, m.data[blk+3*page:blk+3*page+10]) {
				t.Fatal(err)
			}
		}
		checkCache(t, f, m.data)
		f.Close()
	}
}

// A zero-length read at a page edge inside a block not cached: it asked
// the backend for 0 bytes and left an empty partial block in the cache
// (ReadAt now returns at once).
func TestPartialAttackZeroLengthReadAbsentBlock(t *testing.T) {
	m := &memBackend{data: patterned(16 * DefaultBlockSize)}
	f := openMem(t, m, Options{})
	off := int64(9*DefaultBlockSize + 2*page)
	if _, err := f.ReadAt(context.Background(), nil, off); err != nil {
		t.Fatal(err)
	}
	f.wg.Wait()
	f.mu.Lock()
	b := f.blocks[9]
	f.mu.Unlock()
	asked := m.requests()
	if b != nil {
		t.Errorf("a zero-length read cached block 9 holding [%d,%d)", b.lo, b.hi)
	}
	if len(asked) != 0 {
		t.Errorf("a zero-length read asked %v", asked)
	}
	// The next read of the block, random: its page, not the whole block
	// (which a replacement of an empty partial block would fetch).
	p := make([]byte, 100)
	if _, err := f.ReadAt(context.Background(), p, off+page); err != nil || !bytes.Equal(p, m.data[off+page:off+page+100]) {
		t.Fatalf("read after the empty one: %v, or wrong bytes", err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.asked) != 1 || m.asked[0] != [2]int64{off + page, page} {
		t.Fatalf("a random 100-byte read after an empty one asked %v, want its page", m.asked)
	}
}
