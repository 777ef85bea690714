package remote

// Attacks on the loans (LendAt): a lent block must hold the
// object's bytes until release whatever else the cache does meanwhile,
// every loan and every failed or cancelled one must leave no reference
// behind, and the edges (the object's end, a partial last block, the
// bound on slices) must lend exactly the object's bytes or nothing.

import (
	"bytes"
	"context"
	"errors"
	"math/rand"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// A borrower that, while its loan is out, reads enough of the rest of
// the object to evict every block of the cache (its own lent ones
// included) still sees the object's bytes in its slices; so do loans
// racing each other and plain reads. The cache is the least (16 blocks
// of 4 KiB) and the object ends in a partial block, which loans reach.
func TestLendSurvivesEvictionAndRecycling(t *testing.T) {
	const bs = 4096
	m := &memBackend{data: patterned(64*bs + 777)}
	f := openMem(t, m, Options{BlockSize: bs, CacheSize: 16 * bs})
	size := int64(len(m.data))
	ctx := context.Background()

	// Deterministic first: a loan held across a sweep of the whole
	// object, which evicts the lent blocks and refills the cache twice
	// over (a lent buffer recycled early is refilled with other bytes).
	off, n := int64(3*bs+100), int64(5*bs)
	bufs, release, ok, err := f.LendAt(ctx, off, n, 128)
	if !ok || err != nil {
		t.Fatalf("lend: ok %v, err %v", ok, err)
	}
	p := make([]byte, 3*bs)
	for o := int64(0); o < size; o += int64(len(p)) {
		if _, err := f.ReadAt(ctx, p, o); err != nil && o+int64(len(p)) <= size {
			t.Fatal(err)
		}
	}
	if got := joined(bufs); !bytes.Equal(got, m.data[off:off+n]) {
		t.Fatalf("a loan's bytes changed while the cache evicted and refilled its blocks (%d of %d bytes differ)", countDiff(got, m.data[off:off+n]), n)
	}
	release()
	checkCache(t, f, m.data)

	// Then racing borrowers and readers, each borrower checking its
	// bytes before and after the reads it makes while its loan is out.
	var wg sync.WaitGroup
	var bad atomic.Int64
	deadline := time.Now().Add(3 * time.Second)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(seed int64) {
			defer wg.Done()
			rng := rand.New(rand.NewSource(seed))
			q := make([]byte, 2*bs)
			for i := 0; i < 400 && time.Now().Before(deadline); i++ {
				n := 1 + rng.Int63n(12*bs)
				var off int64
				switch rng.Intn(4) {
				case 0: // ending at the object's end, in its partial block
					n = min(n, size)
					off = size - n
				default:
					off = rng.Int63n(size - n + 1)
				}
				bufs, release, ok, err := f.LendAt(ctx, off, n, 128)
				if !ok || err != nil {
					t.Errorf("lend %d at %d: ok %v, err %v", n, off, ok, err)
					bad.Add(1)
					return
				}
				if want := (off+n-1)/bs - off/bs + 1; int64(len(bufs)) != want {
					t.Errorf("lend %d at %d: %d slices, want %d", n, off, len(bufs), want)
				}
				if !bytes.Equal(joined(bufs), m.data[off:off+n]) {
					t.Errorf("lend %d at %d: wrong bytes when lent", n, off)
					bad.Add(1)
				}
				for k := 0; k < 1+rng.Intn(4); k++ {
					o := rng.Int63n(size - int64(len(q)))
					if rng.Intn(2) == 0 {
						f.TryReadAt(q, o)
					} else if _, err := f.ReadAt(ctx, q, o); err != nil {
						t.Errorf("read at %d: %v", o, err)
					}
				}
				if !bytes.Equal(joined(bufs), m.data[off:off+n]) {
					t.Errorf("lend %d at %d: bytes changed while lent", n, off)
					bad.Add(1)
				}
				release()
				if bad.Load() > 5 {
					return
				}
			}
		}(int64(g) + 10)
	}
	wg.Wait()
	checkCache(t, f, m.data)
}

func countDiff(a, b []byte) int {
	d := 0
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			d++
		}
	}
	return d + max(len(a), len(b)) - min(len(a), len(b))
}

// A borrower that gives up while the fetch it waits on is slow gets its
// context's error at once and holds nothing; another borrower of the same
// blocks, who waits, gets them. Once both are done no block is
// referenced, and the blocks leave the cache when others need the room
// (a reference left behind pins a block's buffer for good: never
// recycled, memory past the cache size).
func TestCancelledLoanLeavesNoReference(t *testing.T) {
	const bs = 4096
	// A 2 s fetch, and 1 s for a borrower to give up: see
	// TestReaderCancelDoesNotWait.
	m := &memBackend{data: patterned(256 * bs), delay: 2 * time.Second}
	f := openMem(t, m, Options{BlockSize: bs, CacheSize: 16 * bs, ReconnectTimeout: 10 * time.Second})
	off, n := int64(bs/2), int64(6*bs)

	type res struct {
		bufs    [][]byte
		release func()
		ok      bool
		err     error
		took    time.Duration
	}
	patient := make(chan res, 1)
	go func() {
		start := time.Now()
		b, r, ok, err := f.LendAt(context.Background(), off, n, 128)
		patient <- res{b, r, ok, err, time.Since(start)}
	}()
	var quitters []res
	for i := 0; i < 4; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(10+10*i)*time.Millisecond)
		start := time.Now()
		b, r, ok, err := f.LendAt(ctx, off+int64(i), n-int64(2*i), 128)
		cancel()
		quitters = append(quitters, res{b, r, ok, err, time.Since(start)})
	}
	for i, q := range quitters {
		if !q.ok || !errors.Is(q.err, context.DeadlineExceeded) || q.bufs != nil || q.release != nil {
			t.Fatalf("borrower %d gave up: ok %v, err %v, %d slices, release %v: want its context's error and nothing lent",
				i, q.ok, q.err, len(q.bufs), q.release != nil)
		}
		if q.took > time.Second {
			t.Fatalf("borrower %d gave up after %v: it waited for the fetch", i, q.took)
		}
	}
	p := <-patient
	if !p.ok || p.err != nil || !bytes.Equal(joined(p.bufs), m.data[off:off+n]) {
		t.Fatalf("the patient borrower: ok %v, err %v", p.ok, p.err)
	}
	p.release()
	checkCache(t, f, m.data)

	// The blocks are not pinned: reads elsewhere push them out.
	f.wg.Wait() // no fetch in flight reads delay
	m.delay = 0
	q := make([]byte, bs)
	for o := int64(64 * bs); o < int64(len(m.data)); o += bs {
		if _, err := f.ReadAt(context.Background(), q, o); err != nil {
			t.Fatal(err)
		}
	}
	f.mu.Lock()
	for i := off / bs; i <= (off+n-1)/bs; i++ {
		if f.blocks[i] != nil {
			t.Errorf("block %d of the cancelled loans is still cached after %d other blocks were read", i, len(m.data)/bs-64)
		}
	}
	f.mu.Unlock()
	checkCache(t, f, m.data)
}

// Loans and Close: a loan out when the file closes keeps its bytes, and
// its release after Close is harmless; a borrower waiting on a fetch
// that Close cuts short gets an error (EIO, not its own interruption)
// promptly and nothing lent; a loan asked for after Close is refused
// with an error, not served (from the cache or a new fetch). Run it with
// -race: Close and releases meet under the file's lock.
func TestLoansAcrossClose(t *testing.T) {
	const bs = 4096
	m := &memBackend{data: patterned(64*bs + 100)}
	// Closed by the test itself, not deferred: a panic under the file's
	// lock would deadlock a deferred Close instead of failing.
	f, err := Open(context.Background(), m, Options{BlockSize: bs, CacheSize: 16 * bs})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	off, n := int64(60*bs+7), int64(4*bs+93) // to the end, the partial block included
	bufs, release, ok, err := f.LendAt(ctx, off, n, 128)
	if !ok || err != nil {
		t.Fatalf("lend: ok %v, err %v", ok, err)
	}
	// A second loan evicted while out (recycled at its release, after
	// Close).
	bufs2, release2, ok, err := f.LendAt(ctx, 0, 3*bs, 128)
	if !ok || err != nil {
		t.Fatalf("lend: ok %v, err %v", ok, err)
	}
	p := make([]byte, bs)
	for o := int64(4 * bs); o < 40*bs; o += bs {
		if _, err := f.ReadAt(ctx, p, o); err != nil {
			t.Fatal(err)
		}
	}
	// A borrower waiting on a slow fetch when Close comes.
	f.wg.Wait() // the readahead of the reads above: none reads delay
	m.delay = 5 * time.Second
	waiting := make(chan error, 1)
	f.mu.Lock()
	slow := int64(-1)
	for i := int64(45); i < 60 && slow < 0; i++ {
		if f.blocks[i] == nil {
			slow = i // not cached: its loan waits on the slow fetch
		}
	}
	f.mu.Unlock()
	if slow < 0 {
		t.Fatal("blocks 45-59 all cached with 16 blocks of room")
	}
	go func() {
		b, r, ok, err := f.LendAt(ctx, slow*bs, bs, 128)
		if ok && err == nil {
			r()
			waiting <- errors.New("lent")
			return
		}
		if !ok || b != nil || r != nil {
			waiting <- errors.New("not ok, or slices or a release with the error")
			return
		}
		waiting <- err
	}()
	time.Sleep(50 * time.Millisecond)
	closed := make(chan error, 1)
	go func() { closed <- f.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("Close: %v", err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("Close did not return within 2s with loans out and a fetch in flight")
	}
	select {
	case err := <-waiting:
		if err == nil || !errors.Is(err, unix.EIO) && !errors.Is(err, errClosed) || errors.Is(err, context.Canceled) {
			t.Fatalf("a borrower waiting when Close came: %v, want the file's closing (EIO)", err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("a borrower waiting on a fetch was left waiting past Close")
	}
	m.delay = 0
	// Bounded: a loan after Close that waits on a fetch nobody runs
	// fails here in 2s, not at the test's timeout.
	actx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if b, r, ok, err := f.LendAt(actx, off, n, 128); !ok || err == nil || errors.Is(err, context.DeadlineExceeded) || b != nil || r != nil {
		t.Fatalf("a loan after Close (of cached blocks): ok %v, err %v, %d slices", ok, err, len(b))
	}
	gets := m.gets.Load()
	if b, r, ok, err := f.LendAt(actx, 20*bs, bs, 128); !ok || err == nil || errors.Is(err, context.DeadlineExceeded) || b != nil || r != nil {
		t.Fatalf("a loan after Close (of blocks not cached): ok %v, err %v, %d slices", ok, err, len(b))
	}
	if g := m.gets.Load(); g != gets {
		t.Fatalf("a loan after Close fetched (%d requests)", g-gets)
	}
	if !bytes.Equal(joined(bufs), m.data[off:off+n]) || !bytes.Equal(joined(bufs2), m.data[:3*bs]) {
		t.Fatal("loans out across Close lost their bytes")
	}
	release()
	release2()
}

// The edges: loans up to the object's last byte (a partial block) lend
// it exactly; a loan of exactly maxBufs blocks is lent and one more is
// not; what is not lent (past the end, too many slices, nothing, a
// maxBufs of 0 or less) is refused before anything is fetched or
// referenced, so the caller's fallback read is the only one.
func TestLendEdgesFetchNothingWhenRefused(t *testing.T) {
	const bs = 16 << 10
	size := int64(10*bs + 1)
	m := &memBackend{data: patterned(int(size))}
	f := openMem(t, m, Options{BlockSize: bs, CacheSize: 1 << 20})
	ctx := context.Background()
	for _, c := range []struct {
		name    string
		off, n  int64
		maxBufs int
	}{
		{"past the end by one", size - 100, 101, 128},
		{"at the end", size, 1, 128},
		{"past the end", size + bs, bs, 128},
		{"n past the object", 0, size + 1, 128},
		{"n near 2^63", 5, 1<<63 - 6, 128},
		{"offset and n near 2^63", 1<<62 + 1, 1<<62 + 1, 128},
		{"negative n", 100, -1, 128},
		{"zero n", 100, 0, 128},
		{"zero maxBufs", 0, 1, 0},
		{"negative maxBufs", 0, 1, -1},
		{"one block more than maxBufs", bs - 1, 2*bs + 2, 3}, // four blocks
		{"the whole object in 10 slices", 0, size, 10},       // eleven
	} {
		bufs, release, ok, err := f.LendAt(ctx, c.off, c.n, c.maxBufs)
		if ok || err != nil || bufs != nil || release != nil {
			t.Fatalf("%s: lent (ok %v, err %v, %d slices)", c.name, ok, err, len(bufs))
		}
	}
	if g := m.gets.Load(); g != 0 {
		t.Fatalf("refused loans made %d requests", g)
	}
	f.mu.Lock()
	if len(f.blocks) != 0 {
		t.Fatalf("refused loans made %d cache entries", len(f.blocks))
	}
	f.mu.Unlock()

	for _, c := range []struct {
		name    string
		off, n  int64
		maxBufs int
	}{
		{"the last byte, alone in its block", size - 1, 1, 1},
		{"the last two bytes, across two blocks", size - 2, 2, 2},
		{"the last block and a half", 9*bs + bs/2, bs/2 + 1, 2},
		{"the whole object in 11 slices", 0, size, 11},
		{"four blocks, maxBufs 4", bs - 1, 2*bs + 2, 4},
		{"one byte", 12345, 1, 1},
		{"one whole block", 3 * bs, bs, 1},
	} {
		bufs, release, ok, err := f.LendAt(ctx, c.off, c.n, c.maxBufs)
		if !ok || err != nil {
			t.Fatalf("%s: ok %v, err %v", c.name, ok, err)
		}
		if want := (c.off+c.n-1)/bs - c.off/bs + 1; int64(len(bufs)) != want {
			t.Fatalf("%s: %d slices, want %d", c.name, len(bufs), want)
		}
		for k, b := range bufs {
			if len(b) == 0 {
				t.Fatalf("%s: slice %d is empty", c.name, k)
			}
		}
		if got := joined(bufs); !bytes.Equal(got, m.data[c.off:c.off+c.n]) {
			t.Fatalf("%s: %d bytes lent, %d differ from the object's %d", c.name, len(got), countDiff(got, m.data[c.off:c.off+c.n]), c.n)
		}
		release()
	}
	checkCache(t, f, m.data)
}

// garbler is a lying backend: each GET first scribbles over the buffers
// it was given, then fails as fail says (nil: it then fills them
// properly). Vectors or not (plain hides ReadRangev).
type garbler struct {
	data []byte
	gets atomic.Int64
	fail func(n int64) error
}

func (g *garbler) Stat(context.Context) (Object, error) {
	return Object{Size: int64(len(g.data)), ETag: `"v1"`}, nil
}
func (g *garbler) String() string { return "garbler://object" }
func (g *garbler) Close() error   { return nil }
func (g *garbler) ReadRange(ctx context.Context, obj Object, p []byte, off int64) error {
	return g.ReadRangev(ctx, obj, [][]byte{p}, off)
}
func (g *garbler) ReadRangev(ctx context.Context, obj Object, bufs [][]byte, off int64) error {
	n := g.gets.Add(1)
	for _, d := range bufs {
		for i := range d {
			d[i] = 0xa5 ^ byte(i)
		}
	}
	if err := g.fail(n); err != nil {
		return err
	}
	for _, d := range bufs {
		off += int64(copy(d, g.data[off:]))
	}
	return nil
}

type plainGarbler struct{ g *garbler }

func (p plainGarbler) Stat(ctx context.Context) (Object, error) { return p.g.Stat(ctx) }
func (p plainGarbler) String() string                           { return p.g.String() }
func (p plainGarbler) Close() error                             { return p.g.Close() }
func (p plainGarbler) ReadRange(ctx context.Context, obj Object, b []byte, off int64) error {
	return p.g.ReadRange(ctx, obj, b, off)
}

// A server whose failures leave garbage in the buffers: a failed loan is
// EIO with nothing lent (never the garbage), a retried one lends the
// retry's bytes, and the garbage buffers, recycled into later blocks,
// are filled before they are lent.
func TestGarbageThenErrorIsEIONotBytes(t *testing.T) {
	const bs = 4096
	for _, vectors := range []bool{true, false} {
		g := &garbler{data: patterned(64*bs + 33)}
		var b Backend = g
		if !vectors {
			b = plainGarbler{g}
		}
		var failing atomic.Int64 // GETs up to this one fail for good
		g.fail = func(n int64) error {
			switch {
			case n <= failing.Load():
				return errors.New("403 Forbidden")
			case n%3 == 0:
				return Temporary(errors.New("503, after half a body"))
			}
			return nil
		}
		f, err := Open(context.Background(), b, Options{BlockSize: bs, CacheSize: 16 * bs, ReconnectTimeout: 3 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		size := int64(len(g.data))
		rng := rand.New(rand.NewSource(7))
		for i := 0; i < 200; i++ {
			n := 1 + rng.Int63n(8*bs)
			off := rng.Int63n(size - n + 1)
			if i%5 == 4 {
				off = size - n // the partial last block
			}
			fails := i%4 == 0
			if fails {
				// Every GET of this loan fails, its readahead's too; the
				// fetches of earlier loans are done first, and this
				// one's before the next loan (none starts meanwhile).
				f.wg.Wait()
				failing.Store(g.gets.Load() + 100)
			}
			bufs, release, ok, err := f.LendAt(ctx, off, n, 128)
			if fails {
				f.wg.Wait()
				failing.Store(0)
			}
			if fails {
				// Its blocks may be cached already: then it is lent.
				if err != nil && (!ok || !errors.Is(err, unix.EIO) || bufs != nil || release != nil) {
					t.Fatalf("vectors %v: a failed loan: ok %v, err %v, %d slices", vectors, ok, err, len(bufs))
				}
				if err != nil {
					continue
				}
			} else if !ok || err != nil {
				t.Fatalf("vectors %v: lend %d at %d: ok %v, err %v", vectors, n, off, ok, err)
			}
			if got := joined(bufs); !bytes.Equal(got, g.data[off:off+n]) {
				t.Fatalf("vectors %v: lend %d at %d: %d bytes of garbage lent", vectors, n, off, countDiff(got, g.data[off:off+n]))
			}
			release()
		}
		checkCache(t, f, g.data)
		f.Close()
	}
}
