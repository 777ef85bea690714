package remote

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// memBackend serves data, counting requests and bytes, failing as fail
// says (called with the request's number, from 1).
type memBackend struct {
	data  []byte
	gets  atomic.Int64
	bytes atomic.Int64
	delay time.Duration
	fail  func(n int64, ctx context.Context) error
	mu    sync.Mutex
	asked [][2]int64
}

func (m *memBackend) Stat(context.Context) (Object, error) {
	return Object{Size: int64(len(m.data)), ETag: `"v1"`}, nil
}

func (m *memBackend) ReadRange(ctx context.Context, obj Object, p []byte, off int64) error {
	n := m.gets.Add(1)
	m.mu.Lock()
	m.asked = append(m.asked, [2]int64{off, int64(len(p))})
	m.mu.Unlock()
	if m.delay > 0 {
		select {
		case <-time.After(m.delay):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if m.fail != nil {
		if err := m.fail(n, ctx); err != nil {
			return err
		}
	}
	if obj.ETag != `"v1"` || off+int64(len(p)) > int64(len(m.data)) {
		return fmt.Errorf("bad request %d+%d", off, len(p))
	}
	m.bytes.Add(int64(len(p)))
	copy(p, m.data[off:])
	return nil
}

// ReadRangev: the shared layer's reads go straight into its blocks.
func (m *memBackend) ReadRangev(ctx context.Context, obj Object, bufs [][]byte, off int64) error {
	n := 0
	for _, d := range bufs {
		n += len(d)
	}
	p := make([]byte, n)
	if err := m.ReadRange(ctx, obj, p, off); err != nil {
		return err
	}
	for _, d := range bufs {
		p = p[copy(d, p):]
	}
	return nil
}

// plainBackend hides a backend's ReadRangev: the shared layer reads a
// GET of several blocks through a bounce buffer.
type plainBackend struct{ b Backend }

func (p plainBackend) Stat(ctx context.Context) (Object, error) { return p.b.Stat(ctx) }
func (p plainBackend) ReadRange(ctx context.Context, obj Object, b []byte, off int64) error {
	return p.b.ReadRange(ctx, obj, b, off)
}
func (p plainBackend) String() string { return p.b.String() }
func (p plainBackend) Close() error   { return p.b.Close() }

func TestReadsThroughABackendWithoutVectors(t *testing.T) {
	m := &memBackend{data: patterned(3<<20 + 123)}
	f, err := Open(context.Background(), plainBackend{m}, Options{BlockSize: 4096, CacheSize: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	p := make([]byte, 300<<10)
	for _, off := range []int64{0, 5000, 3<<20 - 1000, 1 << 20} {
		n, err := f.ReadAt(context.Background(), p, off)
		if err != nil && !(errors.Is(err, io.EOF) && off+int64(len(p)) > int64(len(m.data))) {
			t.Fatalf("read at %d: %v", off, err)
		}
		if !bytes.Equal(p[:n], m.data[off:off+int64(n)]) {
			t.Fatalf("read at %d: wrong bytes", off)
		}
	}
}

func (m *memBackend) String() string { return "mem://object" }
func (m *memBackend) Close() error   { return nil }

// awaitGets waits until m has been asked n requests (they count as they
// start), up to 5 s.
func awaitGets(t *testing.T, m *memBackend, n int64) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); m.gets.Load() < n; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d requests after 5 s, want %d", m.gets.Load(), n)
		}
	}
}

// requests is what m was asked, in order.
func (m *memBackend) requests() [][2]int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([][2]int64(nil), m.asked...)
}

// gated makes a memBackend's requests wait until gate is closed (or their
// context ends).
func gated(gate chan struct{}) func(int64, context.Context) error {
	return func(_ int64, ctx context.Context) error {
		select {
		case <-gate:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func patterned(n int) []byte {
	d := make([]byte, n)
	rand.New(rand.NewSource(int64(n))).Read(d)
	return d
}

func openMem(t *testing.T, m *memBackend, o Options) *File {
	t.Helper()
	f, err := Open(context.Background(), m, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

func TestReadsMatchTheObject(t *testing.T) {
	m := &memBackend{data: patterned(3<<20 + 12345)}
	f := openMem(t, m, Options{CacheSize: 1 << 20})
	rng := rand.New(rand.NewSource(1))
	for i := 0; i < 300; i++ {
		off := rng.Int63n(int64(len(m.data)) + 100)
		p := make([]byte, rng.Intn(300<<10))
		n, err := f.ReadAt(context.Background(), p, off)
		wantN := int(max(0, min(int64(len(p)), int64(len(m.data))-off)))
		if n != wantN {
			t.Fatalf("read %d at %d: %d bytes, want %d (err %v)", len(p), off, n, wantN, err)
		}
		if n < len(p) && !errors.Is(err, io.EOF) || n == len(p) && err != nil {
			t.Fatalf("read %d at %d: err %v with %d bytes", len(p), off, err, n)
		}
		if n > 0 && !bytes.Equal(p[:n], m.data[off:off+int64(n)]) {
			t.Fatalf("read %d at %d: wrong bytes", len(p), off)
		}
	}
	// What the cache holds stays within its size (plus what was in flight,
	// none once the readahead's fetches are done).
	f.wg.Wait()
	f.mu.Lock()
	held := len(f.blocks)
	f.mu.Unlock()
	if held > f.capacity {
		t.Fatalf("cache holds %d blocks, capacity %d", held, f.capacity)
	}
}

// Concurrent readers of one range share one request. (Readers of one
// block may make two: the first, random, fetches its pages only, and the
// readers after it, going on from it, the block; see partial_test.go.)
func TestConcurrentReadsOfABlockShareOneGet(t *testing.T) {
	m := &memBackend{data: patterned(1 << 20), delay: 50 * time.Millisecond}
	f := openMem(t, m, Options{})
	var wg sync.WaitGroup
	for i := 0; i < 32; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			p := make([]byte, 128+i)
			off := int64(1000 - i)
			if _, err := f.ReadAt(context.Background(), p, off); err != nil || !bytes.Equal(p, m.data[off:off+int64(len(p))]) {
				t.Errorf("read at %d: %v", off, err)
			}
		}(i)
	}
	wg.Wait()
	m.mu.Lock()
	defer m.mu.Unlock()
	n := 0
	for _, a := range m.asked {
		if a[0] == 0 {
			n++
		}
	}
	if n != 1 {
		t.Fatalf("32 readers of one range made %d requests for it, want 1 (%v)", n, m.asked)
	}
}

func TestTemporaryFailuresAreRetried(t *testing.T) {
	m := &memBackend{data: patterned(1 << 20), fail: func(n int64, _ context.Context) error {
		if n <= 4 {
			return Temporary(errors.New("503 Service Unavailable"))
		}
		return nil
	}}
	f := openMem(t, m, Options{ReconnectTimeout: 5 * time.Second})
	p := make([]byte, 4096)
	if _, err := f.ReadAt(context.Background(), p, 8192); err != nil || !bytes.Equal(p, m.data[8192:8192+4096]) {
		t.Fatalf("read after 4 temporary failures: %v", err)
	}
}

// A server that keeps failing, or never answers, ends in EIO within the
// reconnect timeout: not a hang, not EINTR (the reader was not
// interrupted), not the cause's own errno.
func TestFailuresEndInEIOWithinTheTimeout(t *testing.T) {
	for _, tc := range []struct {
		name string
		fail func(int64, context.Context) error
	}{
		{"5xx forever", func(int64, context.Context) error { return Temporary(errors.New("502")) }},
		{"reset forever", func(int64, context.Context) error { return Temporary(unix.ECONNRESET) }},
		{"hang", func(_ int64, ctx context.Context) error { <-ctx.Done(); return Temporary(ctx.Err()) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := &memBackend{data: patterned(1 << 20), fail: tc.fail}
			f := openMem(t, m, Options{ReconnectTimeout: 1500 * time.Millisecond})
			start := time.Now()
			_, err := f.ReadAt(context.Background(), make([]byte, 4096), 0)
			took := time.Since(start)
			var en unix.Errno
			if !errors.As(err, &en) || en != unix.EIO || errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("err %v (errno %v), want EIO alone", err, en)
			}
			if took > 2500*time.Millisecond {
				t.Fatalf("failed after %v, timeout 1.5s", took)
			}
		})
	}
}

// A permanent error is not retried.
func TestPermanentErrorIsNotRetried(t *testing.T) {
	m := &memBackend{data: patterned(1 << 20), fail: func(int64, context.Context) error { return errors.New("403 Forbidden") }}
	f := openMem(t, m, Options{ReconnectTimeout: 10 * time.Second})
	if _, err := f.ReadAt(context.Background(), make([]byte, 10), 0); !errors.Is(err, unix.EIO) {
		t.Fatalf("err %v, want EIO", err)
	}
	if g := m.gets.Load(); g != 1 {
		t.Fatalf("%d requests for a permanent error", g)
	}
}

// An object replaced while exported: EIO (with ErrChanged) and one log
// line however many reads fail.
func TestChangedObjectIsEIOAndLoggedOnce(t *testing.T) {
	m := &memBackend{data: patterned(4 << 20), fail: func(int64, context.Context) error {
		return fmt.Errorf("412 Precondition Failed: %w", ErrChanged)
	}}
	var log strings.Builder
	var mu sync.Mutex
	f := openMem(t, m, Options{Logger: slog.New(slog.NewTextHandler(lockedWriter{&mu, &log}, nil))})
	for i := 0; i < 4; i++ {
		_, err := f.ReadAt(context.Background(), make([]byte, 10), int64(i)<<20)
		if !errors.Is(err, unix.EIO) || !errors.Is(err, ErrChanged) {
			t.Fatalf("err %v, want EIO and ErrChanged", err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if n := strings.Count(log.String(), "changed"); n != 1 {
		t.Fatalf("%d log lines about the change, want 1:\n%s", n, log.String())
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// A reader that gives up gets its context's error at once; the fetch it
// started goes on for whoever else waits.
func TestReaderCancelDoesNotWait(t *testing.T) {
	// The fetch takes 2 s and the reader may take 1 s to give up: a
	// stalled machine neither lets the fetch finish first nor fails the
	// bound.
	m := &memBackend{data: patterned(1 << 20), delay: 2 * time.Second}
	f := openMem(t, m, Options{ReconnectTimeout: 10 * time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	start := time.Now()
	if _, err := f.ReadAt(ctx, make([]byte, 10), 0); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err %v", err)
	}
	if time.Since(start) > time.Second {
		t.Fatal("the cancelled reader waited for the fetch")
	}
	p := make([]byte, 10)
	if _, err := f.ReadAt(context.Background(), p, 0); err != nil || !bytes.Equal(p, m.data[:10]) {
		t.Fatal(err)
	}
	if g := m.gets.Load(); g != 1 {
		t.Fatalf("%d requests, want the one", g)
	}
}

// Sequential reads earn readahead (fewer, larger requests ahead of the
// reader); random reads fetch only their own blocks.
func TestReadaheadFollowsStreamsOnly(t *testing.T) {
	m := &memBackend{data: patterned(32 << 20)}
	f := openMem(t, m, Options{})
	p := make([]byte, 128<<10)
	for off := int64(0); off < 16<<20; off += int64(len(p)) {
		if _, err := f.ReadAt(context.Background(), p, off); err != nil {
			t.Fatal(err)
		}
	}
	f.wg.Wait()
	seq := m.gets.Load()
	if seq > 40 {
		t.Fatalf("16 MiB read sequentially in 128 KiB reads took %d requests: no readahead", seq)
	}
	var hits int
	for off := int64(2 << 20); off < 15<<20; off += int64(len(p)) {
		if f.TryReadAt(p, off) {
			hits++
		}
	}
	if hits == 0 {
		t.Fatal("nothing of what was read is served without waiting")
	}

	m2 := &memBackend{data: patterned(32 << 20)}
	f2 := openMem(t, m2, Options{})
	rng := rand.New(rand.NewSource(2))
	q := make([]byte, 4096)
	for i := 0; i < 200; i++ {
		off := rng.Int63n(int64(len(m2.data))/4096) * 4096
		if _, err := f2.ReadAt(context.Background(), q, off); err != nil {
			t.Fatal(err)
		}
	}
	f2.wg.Wait()
	if b := m2.bytes.Load(); b > 200*DefaultBlockSize {
		t.Fatalf("200 random 4 KiB reads fetched %d bytes: readahead on random access", b)
	}
}

func TestWritesRefusedAndNoFd(t *testing.T) {
	m := &memBackend{data: patterned(4096)}
	f := openMem(t, m, Options{})
	if _, err := f.WriteAt(context.Background(), []byte{1}, 0); err == nil {
		t.Fatal("write accepted")
	}
	if f.Fd() >= 0 || f.Size() != 4096 {
		t.Fatalf("fd %d size %d", f.Fd(), f.Size())
	}
}

// A server failing for good is retried with backoff, not hammered: a
// read that fails after 1.5 s made a handful of requests.
func TestRetriesBackOff(t *testing.T) {
	m := &memBackend{data: patterned(1 << 20), fail: func(int64, context.Context) error { return Temporary(errors.New("503")) }}
	f := openMem(t, m, Options{ReconnectTimeout: 1500 * time.Millisecond})
	if _, err := f.ReadAt(context.Background(), make([]byte, 10), 0); !errors.Is(err, unix.EIO) {
		t.Fatalf("err %v", err)
	}
	if g := m.gets.Load(); g < 3 || g > 15 {
		t.Fatalf("%d requests in 1.5 s of failures: want a few, backing off", g)
	}
}

// A read near an earlier one, earning no readahead, brings the missing
// blocks of its neighbourhood along in its own GET; the random read
// before it fetched its page only.
func TestNearbyReadBringsItsNeighbourhood(t *testing.T) {
	m := &memBackend{data: patterned(4 << 20)}
	f := openMem(t, m, Options{})
	ctx := context.Background()
	p := make([]byte, 4096)
	first := int64(1<<20 + 40<<10) // in block 66 of 16 KiB, 8 KiB in
	if _, err := f.ReadAt(ctx, p, first); err != nil {
		t.Fatal(err)
	}
	next := first + 8<<10 // block 67, within the first read's slack
	if _, err := f.ReadAt(ctx, p, next); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(p, m.data[next:next+4096]) {
		t.Fatal("the nearby read's bytes differ from the object's")
	}
	asked := m.requests()
	// The neighbourhood of 128 KiB is blocks 64-71: 66 is held (its
	// page), so the second GET is blocks 67-71.
	want := [][2]int64{{first, 4096}, {1<<20 + 48<<10, 80 << 10}}
	if len(asked) != 2 || asked[0] != want[0] || asked[1] != want[1] {
		t.Fatalf("requests %v, want %v", asked, want)
	}
	// Past the neighbourhood first: a read of its last block goes on
	// from the stream and may start readahead past it, which a check
	// after it would then race.
	q := make([]byte, 16<<10)
	if f.TryReadAt(q, 1<<20+128<<10) {
		t.Fatal("a block past the neighbourhood was fetched")
	}
	if !f.TryReadAt(q, 1<<20+112<<10) || !bytes.Equal(q, m.data[1<<20+112<<10:1<<20+128<<10]) {
		t.Fatal("the neighbourhood's last block is not served from the cache")
	}
}

// readNear reads n bytes at off and checks them against the object.
func readNear(t *testing.T, f *File, m *memBackend, off, n int64) {
	t.Helper()
	p := make([]byte, n)
	k, err := f.ReadAt(context.Background(), p, off)
	if int64(k) != min(n, int64(len(m.data))-off) || !bytes.Equal(p[:k], m.data[off:off+int64(k)]) {
		t.Fatalf("read %d at %d: %d bytes, %v, or wrong bytes", n, off, k, err)
	}
}

// The neighbourhood ends with the object: widened up onto a short last
// block, and down from it, never past the object's end.
func TestNeighbourhoodEndsWithTheObject(t *testing.T) {
	bs := int64(DefaultBlockSize)
	size := 66*bs + 5000 // blocks 64 and 65 whole, 66 of 5000 bytes
	for _, c := range []struct {
		name string
		near int64
	}{{"up", 65*bs + 10}, {"down", 66*bs + 10}} {
		t.Run(c.name, func(t *testing.T) {
			m := &memBackend{data: patterned(int(size))}
			f := openMem(t, m, Options{})
			readNear(t, f, m, 64*bs, 100) // random: a page of block 64
			readNear(t, f, m, c.near, 100)
			f.wg.Wait()
			a := m.requests()
			want := [2]int64{65 * bs, bs + 5000}
			if len(a) != 2 || a[0] != [2]int64{64 * bs, page} || a[1] != want {
				t.Fatalf("requests %v, want a page of block 64, then %v", a, want)
			}
			q := make([]byte, 5000)
			if !f.TryReadAt(q, 66*bs) || !bytes.Equal(q, m.data[66*bs:]) {
				t.Fatal("the short last block is not held whole")
			}
			checkCache(t, f, m.data)
		})
	}
}

// Making room for neighbours evicts the least recently used blocks; a
// neighbour held when widening began is not fetched again for the read
// (the reader's own entry evicts the least recently used, block 200;
// room for block 9 then evicts block 8, the next).
func TestNeighbourhoodRefetchesNothingHeld(t *testing.T) {
	bs := int64(DefaultBlockSize)
	m := &memBackend{data: patterned(16 << 20)}
	f := openMem(t, m, Options{CacheSize: 16 * bs})
	readNear(t, f, m, 200*bs, bs) // the least recently used
	readNear(t, f, m, 8*bs, bs)   // the next
	for k := int64(0); k < 13; k++ {
		readNear(t, f, m, (300+20*k)*bs, bs) // far apart: random
	}
	readNear(t, f, m, 11*bs, 100) // a page of block 11: the cache is full
	f.wg.Wait()
	f.mu.Lock()
	held := f.blocks[8] != nil && f.blocks[8].loaded && len(f.blocks) == 16
	f.mu.Unlock()
	if !held {
		t.Fatal("block 8 is not in a full cache before the nearby read")
	}
	before := len(m.requests())
	readNear(t, f, m, 10*bs, 100) // near block 11's read: widened down to 9
	f.wg.Wait()
	a := m.requests()[before:]
	if len(a) != 1 || a[0] != [2]int64{9 * bs, 2 * bs} {
		t.Fatalf("the nearby read's requests %v, want blocks 9 and 10 (8 was held)", a)
	}
	checkCache(t, f, m.data)
}

// A widened run stays one GET: a run of maxGet is not widened, and a
// shorter one only up to maxGet (the reader would wait for a second GET).
func TestNeighbourhoodKeepsOneGet(t *testing.T) {
	bs := int64(DefaultBlockSize)
	for _, n := range []int64{maxGet, maxGet - bs} {
		m := &memBackend{data: patterned(16 << 20)}
		f := openMem(t, m, Options{})
		readNear(t, f, m, 1<<20+6*bs, maxGet)
		readNear(t, f, m, 2<<20+6*bs, n) // goes on from it, no readahead yet
		f.wg.Wait()
		a := m.requests()
		want := [][2]int64{{1<<20 + 6*bs, maxGet}, {2<<20 + 6*bs, maxGet}}
		if len(a) != 2 || a[0] != want[0] || a[1] != want[1] {
			t.Fatalf("a read of %d: requests %v, want %v", n, a, want)
		}
	}
}

// With the cache all loading, a nearby read brings no neighbours: the
// cache overshoots by readers' own blocks only.
func TestNeighbourhoodWithinTheCache(t *testing.T) {
	bs := int64(DefaultBlockSize)
	gate := make(chan struct{})
	m := &memBackend{data: patterned(8 << 20), fail: gated(gate)}
	f := openMem(t, m, Options{CacheSize: 16 * bs})
	done := make(chan struct{}, 32)
	read := func(off int64) {
		go func() {
			p := make([]byte, 100)
			f.ReadAt(context.Background(), p, off)
			done <- struct{}{}
		}()
	}
	held := func(n int) int {
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
			f.mu.Lock()
			k := len(f.blocks)
			f.mu.Unlock()
			if k >= n || time.Now().After(deadline) {
				return k
			}
		}
	}
	for k := int64(0); k < 15; k++ {
		read((100 + 10*k) * bs) // far apart, all loading
		held(int(k) + 1)
	}
	read(11*bs + 2*page) // a 16th stream's first read: the cache is full
	held(16)
	read(13 * bs) // near it: not random, but no room for 12, 14 or 15
	// The reader's own entry and any neighbours are made under one hold
	// of mu: once its entry shows, widening is over.
	n := held(17)
	close(gate)
	for range 17 {
		<-done
	}
	if n != 17 {
		t.Fatalf("%d blocks with a capacity of 16 and 17 readers' own", n)
	}
}

// checkCache checks the cache's invariants once no loan or read is
// out: every entry loaded, unreferenced and in the LRU (and the LRU's
// blocks those of the map), the map within the capacity, every block
// holding the object's bytes in the range it holds (all of it but for a
// partial block), and no buffer in two places (two blocks, or a block
// and the free list: a buffer recycled twice, or recycled while a block
// still used it).
func checkCache(t *testing.T, f *File, data []byte) {
	t.Helper()
	// The readahead in flight first: the callers start no fetch
	// meanwhile, so this Wait races no Add.
	f.wg.Wait()
	f.mu.Lock()
	defer f.mu.Unlock()
	inLRU := map[*block]bool{}
	for v := f.lru.next; v != &f.lru; v = v.next {
		if inLRU[v] || f.blocks[v.idx] != v {
			t.Errorf("block %d in the LRU twice, or not (this one) in the map (evicted %v)", v.idx, v.evicted)
		}
		inLRU[v] = true
	}
	if len(inLRU) != len(f.blocks) {
		t.Errorf("the LRU holds %d blocks, the map %d", len(inLRU), len(f.blocks))
	}
	owner := map[*byte]int64{}
	for i, b := range f.blocks {
		if b.refs != 0 || !b.loaded || b.evicted || b.idx != i {
			t.Errorf("block %d: %d references, loaded %v, evicted %v, index %d, with nothing in flight", i, b.refs, b.loaded, b.evicted, b.idx)
			continue
		}
		start := i * f.bs
		if b.lo < 0 || b.lo > b.hi || b.hi > f.size(i) || int64(len(b.data)) != f.size(i) {
			t.Errorf("block %d holds [%d, %d) of %d bytes (%d)", i, b.lo, b.hi, f.size(i), len(b.data))
		} else if !bytes.Equal(b.data[b.lo:b.hi], data[start+b.lo:start+b.hi]) {
			t.Errorf("block %d does not hold the object's bytes [%d, %d)", i, start+b.lo, start+b.hi)
		}
		p := unsafe.SliceData(b.data[:cap(b.data)])
		if j, dup := owner[p]; dup {
			t.Errorf("blocks %d and %d share one buffer", j, i)
		}
		owner[p] = i
	}
	for k, d := range f.free {
		p := unsafe.SliceData(d[:cap(d)])
		if j, dup := owner[p]; dup {
			t.Errorf("free buffer %d is also block %d's (or another free one's)", k, j)
		}
		owner[p] = -1 - int64(k)
	}
	if len(f.blocks) > f.capacity {
		t.Errorf("the cache holds %d blocks, capacity %d", len(f.blocks), f.capacity)
	}
	if len(f.free) > f.capacity {
		t.Errorf("%d free buffers kept, capacity %d", len(f.free), f.capacity)
	}
}
