package remote

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/coroutines"
	"github.com/blockexport/blockexport/formats"
)

// Defaults for Options' zero values.
const (
	// DefaultConnections is 16, a connection for each request of a
	// reader at queue depth 16: with 8, half of them waited for one.
	// Cold random 4 KiB reads at qd16 from nginx on loopback, six
	// alternating pairs: 12.2-15.0k IOPS against 10.4-14.1k (medians
	// 12.9k and 11.5k), the daemon's CPU 77-95 µs a read against 82-116;
	// sequential 1 MiB reads and qd1 the same within the noise.
	DefaultConnections = 16
	DefaultCacheSize   = 64 << 20
	DefaultBlockSize   = 16 << 10
)

const (
	// maxGet bounds one range GET: a longer run of missing blocks is
	// split, so that a large read keeps several connections busy and the
	// bounce buffers (one per connection) stay small.
	maxGet = 1 << 20
	// minAttempt is the least time a fetch gets, retries included, when
	// the reconnect timeout is shorter (0 means "no retries", not "no time").
	minAttempt = time.Second
	// Readahead starts at initWindow once a reader is seen reading on from
	// where it stopped, doubles with each read that continues the stream,
	// and stops at maxWindow (or a quarter of the cache, if smaller).
	initWindow = 256 << 10
	maxWindow  = 32 << 20
	// nstreams sequential readers are followed at once (a guest reading
	// two files, the kernel's readahead beside a reader's own requests).
	nstreams = 8
	// page is the unit of a partial fetch (see block): a random read
	// fetches the pages of its block that it covers, not the block.
	page = 4 << 10
	// neighbourhood: a read that lands near earlier ones (within a
	// stream's slack, see follow) and starts no readahead fetches, beside
	// the blocks it misses, the missing blocks next to them up to the
	// edges of its aligned neighbourhood (widen): the other small files
	// of a directory, the next entries of an inode table. An ext4 tree of
	// 15,000 files read back with tar through a loop device on an export
	// of nginx on loopback took 2.29-2.55 s with 128 KiB against
	// 2.58-3.02 s without (four alternating sets; 64 KiB: 2.13-2.80 s in
	// three), where nbdkit's cache filter, which fetches 64 KiB blocks,
	// took 2.68-3.26 s.
	// Random reads are not widened (their partial fetch stays; 40 GETs
	// of 39,894 in 40,000 at qd16 were): 4 KiB reads at qd16 and qd1 and
	// 1 MiB reads ran as before (three pairs).
	neighbourhood = 128 << 10
)

// Options say how a File reads its object.
type Options struct {
	// Connections: range GETs in flight at once (0: DefaultConnections).
	Connections int
	// CacheSize: bytes of fetched blocks kept (0: DefaultCacheSize).
	CacheSize int64
	// BlockSize: the cache's unit, a power of two (0: DefaultBlockSize).
	BlockSize int
	// ReconnectTimeout: how long a fetch retries temporary failures
	// (resets, timeouts, 5xx, 429) before the read fails with EIO; also
	// what one request may take, so a hanging or trickling server ends in
	// EIO. At least a second.
	ReconnectTimeout time.Duration
	Logger           *slog.Logger
}

// File is an object read through a Backend, as an aio.File that formats
// open like a local file: read-only, no descriptor (Fd is -1; its size is
// Size, see aio.FileSize).
//
// Reads are served from a cache of fixed-size blocks. A block that is
// missing is fetched once however many readers want it (they all wait on
// the one request); runs of missing blocks are fetched by one range GET
// each (up to maxGet) over at most Connections requests at once. A reader
// seen continuing where it stopped gets readahead, growing with the
// stream; a random read gets none.
type File struct {
	b    Backend
	obj  Object
	name string
	o    Options
	log  *slog.Logger
	bs   int64 // block size
	// conns hands out the connections, readers' own fetches first.
	conns slots
	// ctx is the fetches' context: a fetch outlives the reader that
	// started it (others may wait on it), not the file.
	ctx    context.Context
	cancel context.CancelFunc
	// loneCtx is ctx marked Lone: the context of a lone reader's own GET
	// (load with held), made once rather than a value a GET.
	loneCtx context.Context
	wg      sync.WaitGroup // fetches started and not complete
	jobs    chan fetch     // to an idle fetching goroutine (spawn)
	// bounce buffers for one GET each, maxGet bytes, for a backend that
	// does not read vectors.
	bounce  sync.Pool
	changed atomic.Bool // ErrChanged logged
	gets    atomic.Int64
	// lastOK is when a request last succeeded (Unix nanoseconds): a fetch
	// waiting for a connection keeps waiting while others make progress,
	// and fails once none has for the reconnect timeout.
	lastOK atomic.Int64

	mu       sync.Mutex
	blocks   map[int64]*block
	lru      block // sentinel of the loaded blocks, most recent first
	capacity int
	free     [][]byte
	// made counts the block buffers made so far; growing says a grow
	// (fresh buffers, faulted in ahead of need) is under way; grows stop
	// at growTo (the capacity, or the object's blocks if fewer: a 1 KiB
	// object is not given a MiB).
	made    int
	growing bool
	growTo  int
	streams [nstreams]stream
	tick    uint64
	window  int64 // readahead limit
	closed  bool
}

// block is one cache entry: loading until done is closed, then loaded
// (data valid) or failed (err; already out of the map). The blocks of one
// GET share its done (start makes it, load closes it once they are all
// complete).
//
// A block holds (or is fetching) the bytes [lo, hi) of its range; that is
// all of it but where a random read fetched only the pages it covers (a
// partial block: a cold random 4 KiB read at queue depth 1 through FUSE
// from nginx on loopback ran 24-28% faster fetching 4 KiB than 16 KiB,
// and 13-17% at qd16; 4 KiB blocks for everything cost sequential reads
// 30%). A read that needs bytes a block lacks replaces it (evict).
type block struct {
	idx        int64
	data       []byte
	lo, hi     int64 // the bytes held, from the block's start; set by start
	done       chan struct{}
	err        error
	loaded     bool
	refs       int  // readers copying out of data
	evicted    bool // out of the map; data recycled at the last unref
	prev, next *block
}

type stream struct {
	next, ahead, window int64
	used                uint64
	seen                int // reads that went on from next
}

// Open pins obj's size and identity (Backend.Stat, retried like a read)
// and returns the File. The backend is the File's from then on: Close
// closes it, and so does a failed Open.
func Open(ctx context.Context, b Backend, o Options) (*File, error) {
	if o.Connections <= 0 {
		o.Connections = DefaultConnections
	}
	if o.CacheSize <= 0 {
		o.CacheSize = DefaultCacheSize
	}
	if o.BlockSize <= 0 {
		o.BlockSize = DefaultBlockSize
	}
	if o.BlockSize&(o.BlockSize-1) != 0 || o.BlockSize > maxGet {
		b.Close()
		return nil, fmt.Errorf("remote: block size %d: want a power of two up to %d", o.BlockSize, maxGet)
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	f := &File{b: b, name: b.String(), o: o, log: o.Logger, bs: int64(o.BlockSize),
		conns: slots{free: o.Connections}, blocks: map[int64]*block{}, jobs: make(chan fetch)}
	f.lru.next, f.lru.prev = &f.lru, &f.lru
	f.capacity = int(max(o.CacheSize/f.bs, 16))
	f.window = min(maxWindow, max(o.CacheSize/4, initWindow))
	f.bounce.New = func() any { b := make([]byte, maxGet); return &b }
	f.ctx, f.cancel = context.WithCancel(context.Background())
	f.loneCtx = coroutines.WithPath(f.ctx, coroutines.Lone)
	obj, err := f.stat(ctx)
	if err != nil {
		f.cancel()
		b.Close()
		return nil, err
	}
	if obj.Size < 0 {
		f.cancel()
		b.Close()
		return nil, fmt.Errorf("%s: size %d: %w", f.name, obj.Size, errBadReply)
	}
	f.obj = obj
	f.growTo = int(min(int64(f.capacity), obj.Size/f.bs+1))
	f.lastOK.Store(time.Now().UnixNano())
	return f, nil
}

var errBadReply = errors.New("server's reply makes no sense")

// stat is Backend.Stat with the retries a read gets.
func (f *File) stat(ctx context.Context) (Object, error) {
	var obj Object
	err := f.retry(ctx, time.Now().Add(f.timeout()), func(ctx context.Context) error {
		var err error
		obj, err = f.b.Stat(ctx)
		return err
	})
	if err != nil {
		return Object{}, err // the backend's errors name the object
	}
	return obj, nil
}

// Object is what Open pinned.
func (f *File) Object() Object { return f.obj }

// Size is the object's size, pinned at open (aio.Sized).
func (f *File) Size() int64 { return f.obj.Size }

// Gets counts the range requests made (not their retries).
func (f *File) Gets() int64 { return f.gets.Load() }

func (f *File) Fd() int              { return -1 }
func (f *File) Name() string         { return f.name }
func (f *File) Backend() aio.Backend { return aio.Backend("remote") }

func (f *File) WriteAt(context.Context, []byte, int64) (int, error) {
	return 0, formats.ErrReadOnly
}
func (f *File) WritevAt(context.Context, [][]byte, int64) (int, error) {
	return 0, formats.ErrReadOnly
}
func (f *File) TryWriteAt([]byte, int64) (bool, error) { return true, formats.ErrReadOnly }
func (f *File) Fallocate(context.Context, uint32, int64, int64) error {
	return formats.ErrReadOnly
}

// Fsync and Fdatasync have nothing to make durable: nothing is written.
func (f *File) Fsync(context.Context) error     { return nil }
func (f *File) Fdatasync(context.Context) error { return nil }

func (f *File) ReadvAt(ctx context.Context, iov [][]byte, off int64) (int, error) {
	total := 0
	for _, p := range iov {
		n, err := f.ReadAt(ctx, p, off)
		total += n
		off += int64(n)
		if err != nil {
			return total, err
		}
	}
	return total, nil
}

// ReadAt reads p at off; past the object's end it returns fewer bytes
// and io.EOF, as a file does.
func (f *File) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("%s: read at %d: %w", f.name, off, unix.EINVAL)
	}
	if len(p) == 0 {
		// Nothing to fetch: an empty read must not make (or replace) a
		// block, a partial one of no pages least of all.
		return 0, nil
	}
	if off >= f.obj.Size {
		return 0, io.EOF
	}
	n := int(min(int64(len(p)), f.obj.Size-off))
	want, err := f.loaded(ctx, off, int64(n))
	if err != nil {
		return 0, err
	}
	f.copyOut(want, p[:n], off)
	f.release(want)
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// loaded returns the blocks of [off, off+n), referenced and loaded, once
// they are (fetching those missing); on an error none stays referenced.
func (f *File) loaded(ctx context.Context, off, n int64) ([]*block, error) {
	// A reader that cannot give up (its context has no Done: a serve
	// loop's lone request) makes the first GET it needs itself, on its
	// own goroutine, with the connection acquire took for it. Handed to
	// a fetching goroutine, the GET readied that goroutine and then the
	// reader again, and the runtime wakes an idle thread for each: on
	// this VM a sleeping vCPU's wake-up each, about a third of a cold
	// random read at queue depth 1 (see the FUSE loop's runStalling). A
	// reader that may give up leaves the GET to a fetching goroutine,
	// which goes on for whoever else waits.
	want, mine, err := f.acquire(off, n, ctx.Done() == nil)
	if err != nil {
		return nil, err
	}
	if mine != nil {
		f.load(*mine, true)
	}
	for _, b := range want {
		select {
		case <-b.done:
		case <-ctx.Done():
			f.release(want)
			return nil, ctx.Err()
		}
		if b.err != nil {
			f.release(want)
			return nil, b.err
		}
	}
	return want, nil
}

// CanLend: a File always may (formats.CacheLender).
func (f *File) CanLend() bool { return true }

// LendAt lends [off, off+n) out of the cache blocks that hold it
// (formats.CacheLender): a FUSE reply is written from them, and the copy into
// a reply buffer that ReadAt makes is saved (cold 1 MiB reads at qd16
// from nginx on loopback, through FUSE: 1100-1230 MiB/s with the copy,
// 1710-1870 without). The blocks stay referenced, so neither evicted nor
// reused, until release.
func (f *File) LendAt(ctx context.Context, off, n int64, maxBufs int) ([][]byte, func(), bool, error) {
	if off < 0 || n <= 0 || off > f.obj.Size-n || (off+n-1)/f.bs-off/f.bs >= int64(maxBufs) {
		return nil, nil, false, nil
	}
	want, err := f.loaded(ctx, off, n)
	if err != nil {
		return nil, nil, true, err
	}
	bufs := make([][]byte, len(want))
	for k, b := range want {
		_, bufs[k] = f.part(b, off, n)
	}
	return bufs, func() { f.release(want) }, true, nil
}

// TryReadAt serves p from the cache when every block of it is there.
func (f *File) TryReadAt(p []byte, off int64) bool {
	if off < 0 || off+int64(len(p)) > f.obj.Size || len(p) == 0 {
		return false
	}
	first, last := off/f.bs, (off+int64(len(p))-1)/f.bs
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		return false
	}
	want := make([]*block, 0, last-first+1)
	for i := first; i <= last; i++ {
		b := f.blocks[i]
		if b == nil || !b.loaded || !f.covers(b, off, int64(len(p))) {
			f.mu.Unlock()
			return false
		}
		want = append(want, b)
	}
	for _, b := range want {
		b.refs++
		f.touch(b)
	}
	ahead, _ := f.follow(off, off+int64(len(p)))
	f.start(ahead, false, false)
	f.mu.Unlock()
	f.copyOut(want, p, off)
	f.release(want)
	return true
}

func (f *File) copyOut(want []*block, p []byte, off int64) {
	for _, b := range want {
		lo, d := f.part(b, off, int64(len(p)))
		copy(p[lo-off:], d)
	}
}

// part is the bytes of [off, off+n) that block b holds, from lo on.
func (f *File) part(b *block, off, n int64) (lo int64, d []byte) {
	start := b.idx * f.bs
	lo, hi := max(off, start), min(off+n, start+int64(len(b.data)))
	return lo, b.data[lo-start : hi-start]
}

// acquire returns the blocks of [off, off+n), referenced, starting the
// fetches of those missing and the readahead the read earns.
// With inline, the first of the reader's own GETs comes back unstarted
// (mine) when a connection was free for it: the caller runs it (load,
// with that connection) and then waits for the rest.
func (f *File) acquire(off, n int64, inline bool) (want []*block, mine *fetch, err error) {
	first, last := off/f.bs, (off+n-1)/f.bs
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		return nil, nil, fmt.Errorf("%s: %w", f.name, errClosed)
	}
	want = make([]*block, 0, last-first+1)
	var runs [][2]int64
	replaced := false
	for i := first; i <= last; i++ {
		b := f.blocks[i]
		if b != nil && !f.covers(b, off, n) {
			f.evict(b) // a partial block lacking bytes of this read
			b, replaced = nil, true
		}
		if b == nil {
			b = f.insert(i)
			if k := len(runs) - 1; k >= 0 && runs[k][1] == i {
				runs[k][1]++
			} else {
				runs = append(runs, [2]int64{i, i + 1})
			}
		} else if b.loaded {
			f.touch(b)
		}
		b.refs++
		want = append(want, b)
	}
	ahead, random := f.follow(off, off+n)
	// A block that replaces a partial one is fetched whole: partial again,
	// it would drop the pages the old one held (a second pass of the same
	// random reads missed on a fifth of them).
	if random && !replaced && len(runs) == 1 && runs[0][1] == runs[0][0]+1 {
		f.partial(f.blocks[runs[0][0]], off, n)
	}
	// A read near others that starts no readahead brings its neighbours
	// (see neighbourhood); one that starts readahead leaves it to that.
	if !random && ahead == nil && len(runs) == 1 {
		runs[0] = f.widen(runs[0])
	}
	// Started under mu: Close sets closed under it, so no fetch is added
	// to wg once Close waits on it.
	mine = f.start(runs, true, inline)
	f.start(ahead, false, false)
	f.mu.Unlock()
	return want, mine, nil
}

// widen extends run r of missing blocks (a reader's own, entries made)
// over the missing blocks next to it, up to the edges of its aligned
// neighbourhood, making their entries while the cache has room for them:
// they come in the reader's one GET. Called with mu held.
func (f *File) widen(r [2]int64) [2]int64 {
	group, per := max(neighbourhood/f.bs, 1), maxGet/f.bs
	lo := r[0] / group * group
	hi := min((r[1]+group-1)/group*group, (f.obj.Size+f.bs-1)/f.bs)
	// How far the missing blocks reach is found before room() evicts
	// anything here: an eviction would make a neighbour held when
	// widening began look missing, and fetch it again.
	down, up := r[0], r[1]
	for down > lo && f.blocks[down-1] == nil {
		down--
	}
	for up < hi && f.blocks[up] == nil {
		up++
	}
	// One GET (see start): a run of maxGet or more stays as it is.
	up = min(up, r[0]+per)
	down = max(down, up-per)
	for r[0] > down && f.room() {
		r[0]--
		f.insert(r[0])
	}
	for r[1] < up && f.room() {
		f.insert(r[1])
		r[1]++
	}
	return r
}

// size is the length of block i's range (the last one may be short).
func (f *File) size(i int64) int64 { return min(f.bs, f.obj.Size-i*f.bs) }

// covers says whether block b holds (or is fetching) the bytes of
// [off, off+n) in its range.
func (f *File) covers(b *block, off, n int64) bool {
	start := b.idx * f.bs
	return b.lo <= max(off, start)-start && min(off+n, start+f.bs)-start <= b.hi
}

// partial makes loading block b (not started) fetch only the pages of
// [off, off+n) in it: a random read's, which would otherwise bring the
// rest of the block across for nothing.
func (f *File) partial(b *block, off, n int64) {
	start := b.idx * f.bs
	b.lo = (max(off, start) - start) &^ (page - 1)
	b.hi = min((min(off+n, start+f.bs)-start+page-1)&^(page-1), f.size(b.idx))
}

// evict takes block b out of the cache: the least recently used (shrink),
// or a partial block that lacks bytes a read needs. Readers holding it
// keep it until they release it, a load in flight completes it for them,
// and its buffer is recycled after.
func (f *File) evict(b *block) {
	if f.blocks[b.idx] == b {
		delete(f.blocks, b.idx)
	}
	f.unlink(b)
	b.evicted = true
	if b.loaded && b.refs == 0 {
		f.recycle(b)
	}
}

var errClosed = errors.New("remote file closed")

// release drops the references acquire took.
func (f *File) release(want []*block) {
	f.mu.Lock()
	for _, b := range want {
		b.refs--
		if b.refs == 0 && b.evicted {
			f.recycle(b)
		}
	}
	f.mu.Unlock()
}

// insert makes a loading entry for block i, evicting the least recently
// used loaded blocks beyond the capacity. Loading blocks are never
// evicted: when all are loading, the cache overshoots by what readers
// asked for themselves (readahead is cut instead: see room) until their
// loads complete (load shrinks it back).
func (f *File) insert(i int64) *block {
	f.room()
	b := &block{idx: i} // done: start's, under the same hold of mu
	f.blocks[i] = b
	return b
}

// room evicts the least recently used loaded blocks until an entry more
// fits in the capacity, and says whether it does (loading entries count:
// they are memory once loaded).
func (f *File) room() bool {
	f.shrink(f.capacity - 1)
	return len(f.blocks) < f.capacity
}

// shrink evicts the least recently used loaded blocks while the cache
// holds more than limit (loading blocks stay); a block's buffer is
// recycled once no reader holds it.
func (f *File) shrink(limit int) {
	for len(f.blocks) > limit && f.lru.prev != &f.lru {
		f.evict(f.lru.prev)
	}
}

func (f *File) recycle(b *block) {
	// Every evicted buffer is kept for the next block (buffers in blocks
	// and aside together stay within the capacity and what readers hold):
	// dropped, they would be garbage the collector lets the heap grow to
	// twice the cache before reclaiming.
	if len(f.free) < f.capacity && int64(cap(b.data)) == f.bs {
		f.free = append(f.free, b.data[:cap(b.data)])
	}
	b.data = nil
}

func (f *File) touch(b *block) {
	f.unlink(b)
	b.next, b.prev = f.lru.next, &f.lru
	f.lru.next.prev = b
	f.lru.next = b
}

func (f *File) unlink(b *block) {
	if b.next != nil {
		b.prev.next, b.next.prev = b.next, b.prev
		b.next, b.prev = nil, nil
	}
}

// follow records a read of [off, end) against the sequential streams and
// returns the runs of blocks to read ahead (entries made, loading), and
// whether the read went on from no stream (random, or a stream's first).
func (f *File) follow(off, end int64) (ahead [][2]int64, random bool) {
	f.tick++
	var s *stream
	// Concurrent requests of one stream arrive out of order: a reader
	// with 16 requests in flight is still one stream.
	slack := max(4*f.bs, 16*(end-off))
	for i := range f.streams {
		c := &f.streams[i]
		if c.used != 0 && off >= c.next-slack && off <= c.next+slack {
			s = c
			break
		}
	}
	if s == nil {
		// A new stream (or a random read): no readahead until it goes on.
		s = &f.streams[0]
		for i := range f.streams {
			if f.streams[i].used < s.used {
				s = &f.streams[i]
			}
		}
		*s = stream{next: end, ahead: end, used: f.tick}
		return nil, true
	}
	s.used = f.tick
	if end <= s.next {
		return nil, false // a request of the stream that arrived late, or a reread
	}
	s.next = end
	if s.seen++; s.seen < 2 {
		// Twice on before readahead: two random reads that happen to
		// fall within the slack of each other are not a stream (200
		// random 4 KiB reads of a 32 MiB object read 0.8 MiB ahead).
		return nil, false
	}
	if s.ahead-s.next > s.window/2 {
		// Enough is on its way: the next batch goes out once the reader
		// has eaten into half of it, so each batch is a large request
		// rather than one small one per read.
		return nil, false
	}
	s.window = min(max(2*s.window, initWindow), f.window)
	target := min(s.next+s.window, f.obj.Size)
	from := max(s.ahead, s.next)
	if target <= from {
		return nil, false
	}
	s.ahead = target
	var runs [][2]int64
	for i := from / f.bs; i <= (target-1)/f.bs; i++ {
		b := f.blocks[i]
		// Not started (hi 0): the reader's own, which start makes whole.
		if b != nil && (b.hi == 0 || f.covers(b, i*f.bs, f.size(i))) {
			continue
		}
		if !f.room() {
			// The cache is all loading: readahead waits for room rather
			// than growing memory past the cache size.
			s.ahead = i * f.bs
			break
		}
		if b != nil {
			f.evict(b) // partial: the stream will want all of it
		}
		f.insert(i)
		if k := len(runs) - 1; k >= 0 && runs[k][1] == i {
			runs[k][1]++
		} else {
			runs = append(runs, [2]int64{i, i + 1})
		}
	}
	return runs, false
}

// start fetches runs of loading blocks, each in GETs of up to maxGet.
// Called with mu held, the file open. own: a reader waits on them
// (readahead waits for connections behind them). inline: the first GET
// is returned unstarted instead, holding a connection, if one is free
// and no other reader queues for one: the reader makes it itself.
func (f *File) start(runs [][2]int64, own, inline bool) (mine *fetch) {
	per := maxGet / f.bs
	asked := time.Now()
	for _, r := range runs {
		for i := r[0]; i < r[1]; i += per {
			j := min(i+per, r[1])
			bl := make([]*block, 0, j-i)
			done := make(chan struct{})
			for k := i; k < j; k++ {
				b := f.blocks[k]
				b.done = done
				if b.hi == 0 {
					b.lo, b.hi = 0, f.size(k) // all of it, unless partial
				}
				bl = append(bl, b)
			}
			f.wg.Add(1)
			x := fetch{bl: bl, i: i, j: j, asked: asked, own: own}
			if inline && mine == nil && f.conns.tryGet() {
				mine = &x
				continue
			}
			if own {
				// A reader's fetch takes its place in the queue now, in
				// the reader's order, not when its goroutine first runs:
				// on a loaded machine readahead queued meanwhile went
				// first (a random read behind four readahead GETs, 477 ms, in a
				// full test run beside other -race tests).
				x.ch = f.conns.get(true)
			}
			f.spawn(x)
		}
	}
	return mine
}

// fetch is one GET for load: blocks bl, [i, j).
type fetch struct {
	bl    []*block
	i, j  int64
	asked time.Time
	own   bool
	// ch is where a reader's own fetch (own) gets its connection: start
	// asked for it already (nil: it was free). Readahead asks in slot.
	ch chan struct{}
}

// workerIdle is how long a fetching goroutine waits for the next fetch
// before it exits.
const workerIdle = time.Second

// spawn runs x on a goroutine of its own: an idle one that fetched
// before, or a new one. Reused goroutines keep the stacks they grew: a
// new goroutine per GET grew its stack on every request, 12% of the CPU
// of 4 KiB random reads at qd16.
func (f *File) spawn(x fetch) {
	select {
	case f.jobs <- x:
	default:
		go f.worker(x)
	}
}

func (f *File) worker(x fetch) {
	t := time.NewTimer(workerIdle)
	defer t.Stop()
	for {
		f.load(x, false)
		t.Reset(workerIdle)
		select {
		case x = <-f.jobs:
		case <-t.C:
			return
		case <-f.ctx.Done():
			return
		}
	}
}

func (f *File) timeout() time.Duration { return max(f.o.ReconnectTimeout, minAttempt) }

// deadline is when a fetch asked for at asked fails: the reconnect
// timeout after it was asked for or after the last request that
// succeeded, whichever is later. Waiting for a connection counts: behind
// a server that hangs, a queued fetch fails when the one in flight does,
// not one timeout after another; behind a busy but working one it waits
// its turn.
func (f *File) deadline(asked time.Time) time.Time {
	last := time.Unix(0, f.lastOK.Load())
	if last.After(asked) {
		asked = last
	}
	return asked.Add(f.timeout())
}

// slots is a semaphore of connections whose waiters are served in
// two queues, readers' own fetches before readahead.
type slots struct {
	mu     sync.Mutex
	free   int
	own, a []chan struct{}
}

// get takes a connection (nil) or queues for one: the channel is closed
// when it is handed over.
func (s *slots) get(own bool) chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.free > 0 && len(s.own) == 0 && (own || len(s.a) == 0) {
		s.free--
		return nil
	}
	ch := make(chan struct{})
	if own {
		s.own = append(s.own, ch)
	} else {
		s.a = append(s.a, ch)
	}
	return ch
}

// drop leaves the queue; false: the connection was handed over already
// (the caller holds it).
func (s *slots) drop(ch chan struct{}, own bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	q := &s.a
	if own {
		q = &s.own
	}
	for i, c := range *q {
		if c == ch {
			*q = append((*q)[:i], (*q)[i+1:]...)
			return true
		}
	}
	return false
}

// tryGet takes a connection if one is free and no reader's fetch
// queues for one (readahead waiting does not count: readers go first).
func (s *slots) tryGet() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.free > 0 && len(s.own) == 0 {
		s.free--
		return true
	}
	return false
}

// put gives a connection back, to the first waiter if any.
func (s *slots) put() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, q := range []*[]chan struct{}{&s.own, &s.a} {
		if len(*q) > 0 {
			close((*q)[0])
			*q = (*q)[1:]
			return
		}
	}
	s.free++
}

// slot takes a connection, or fails at the fetch's deadline or Close.
func (f *File) slot(x fetch) error {
	asked, ch := x.asked, x.ch
	if !x.own {
		ch = f.conns.get(false)
	}
	if ch == nil {
		return nil
	}
	for {
		var err error
		d := time.Until(f.deadline(asked))
		if d <= 0 {
			err = &timeoutError{after: f.timeout(), last: errors.New("waited for a connection while none succeeded")}
		} else {
			t := time.NewTimer(d)
			select {
			case <-ch:
				t.Stop()
				return nil
			case <-f.ctx.Done():
				t.Stop()
				err = fmt.Errorf("%s: %w", f.name, errClosed)
			case <-t.C:
				continue // fails unless a request succeeded meanwhile (deadline moved)
			}
		}
		if !f.conns.drop(ch, x.own) {
			f.conns.put() // handed over as it gave up
		}
		return err
	}
}

// load makes fetch x: it fetches blocks x.bl ([x.i, x.j)) with one range
// GET (retried) and completes their entries, whatever happens. The GET
// reads straight into the blocks' buffers, taken before it starts (the
// blocks count against the cache from their insertion, loading or not).
// held: the caller took the connection already (start).
func (f *File) load(x fetch, held bool) {
	defer f.wg.Done()
	bl, i, j, asked := x.bl, x.i, x.j, x.asked
	off := i * f.bs
	end := min(j*f.bs, f.obj.Size)
	// A partial block (one, alone in its GET) asks for its pages only.
	roff, rend := off, end
	if len(bl) == 1 {
		roff, rend = off+bl[0].lo, off+bl[0].hi
	}
	var bufs [][]byte
	var err error
	if !held {
		err = f.slot(x)
	}
	if err == nil {
		bufs = make([][]byte, len(bl))
		f.mu.Lock()
		for n := range bufs {
			lo := off + int64(n)*f.bs
			bufs[n] = f.newBuf()[:min(f.bs, end-lo)]
		}
		f.mu.Unlock()
		vec := bufs
		if roff > off || rend < end {
			vec = [][]byte{bufs[0][roff-off : rend-off]}
		}
		f.gets.Add(1)
		// held: the reader's own GET, made on its goroutine because nothing
		// else is in flight (loaded); the backend may spin on its reply.
		base := f.ctx
		if held {
			base = f.loneCtx
		}
		err = f.retry(base, f.deadline(asked), func(ctx context.Context) error {
			return f.readv(ctx, vec, roff)
		})
		if err == nil {
			f.lastOK.Store(time.Now().UnixNano())
		}
		f.conns.put()
	}
	if err != nil {
		err = f.ioError(err, roff, rend-roff)
	}
	f.mu.Lock()
	for n, b := range bl {
		k := i + int64(n)
		if b.loaded || b.err != nil {
			continue // cannot be: loading entries are completed here only
		}
		if err != nil || f.blocks == nil {
			if err == nil {
				err = fmt.Errorf("%s: %w", f.name, errClosed)
			}
			if f.blocks[k] == b {
				delete(f.blocks, k)
			}
			b.evicted = true
			b.err = err
			continue
		}
		b.data, b.loaded = bufs[n], true
		bufs[n] = nil
		if b.evicted {
			// Evicted while loading: its readers get it, then it goes.
			if b.refs == 0 {
				f.recycle(b)
			}
			continue
		}
		f.touch(b)
	}
	if len(bl) > 0 {
		close(bl[0].done)
	}
	if f.blocks != nil {
		// A reader that found the cache all loading overshot it (insert);
		// now that blocks are loaded, the cache goes back to its size
		// rather than keeping the overshoot until the next insert.
		f.shrink(f.capacity)
		for _, d := range bufs {
			if d != nil && len(f.free) < f.capacity {
				f.free = append(f.free, d[:cap(d)])
			}
		}
	}
	f.mu.Unlock()
}

// newBuf is a block's buffer: a recycled one, else a new one. Called
// with mu held. (Huge pages for a growing cache were tried: clearing a
// 2 MiB page at a time cost more CPU than the 4 KiB faults it saved,
// 1.6-2.5 ms a cold MiB through FUSE against 1.2-1.3.)
//
// While the cache is still growing, fresh buffers are made ahead of need
// (grow): a buffer made here is faulted in page by page by the GET that
// fills it, and on this VM a first touch costs about 12 µs a page, so a
// cold random 4 KiB read into a fresh 16 KiB block took 3.7-3.9k IOPS at
// queue depth 1 against 5.5-5.7k once buffers were recycled.
func (f *File) newBuf() []byte {
	if len(f.free) < growLow && !f.growing && !f.closed && f.made < f.growTo {
		n := min(max(growBytes/f.bs, 1), int64(f.growTo-f.made))
		f.growing, f.made = true, f.made+int(n) // counted now: no second grow overlaps it
		go f.grow(n)
	}
	if n := len(f.free); n > 0 {
		d := f.free[n-1]
		f.free = f.free[:n-1]
		return d
	}
	f.made++
	return make([]byte, f.bs)
}

const (
	// growBytes is how much fresh buffer memory one grow makes, and
	// growLow how few spare buffers start the next.
	growBytes = 1 << 20
	growLow   = 16
)

// grow makes n fresh block buffers in one allocation, faults them in with
// one madvise(MADV_POPULATE_WRITE) (7 µs a page here against 12 µs for
// page-by-page faults; where the kernel lacks it, the GETs fault them as
// before) and adds them to the spare buffers. It runs on its own
// goroutine, off the readers' path. The buffers count against the
// capacity (made, from when newBuf starts the grow), so a cache never
// makes more than it can hold.
func (f *File) grow(n int64) {
	slab := make([]byte, n*f.bs)
	_ = unix.Madvise(slab, unix.MADV_POPULATE_WRITE)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.growing = false
	if f.closed {
		return
	}
	for i := range n {
		f.free = append(f.free, slab[i*f.bs:(i+1)*f.bs:(i+1)*f.bs])
	}
}

// readv fills bufs, in order, from the object at off: straight into them
// when the backend reads vectors, else through a bounce buffer.
func (f *File) readv(ctx context.Context, bufs [][]byte, off int64) error {
	if vb, ok := f.b.(VectorBackend); ok {
		return vb.ReadRangev(ctx, f.obj, bufs, off)
	}
	if len(bufs) == 1 {
		return f.b.ReadRange(ctx, f.obj, bufs[0], off)
	}
	n := 0
	for _, d := range bufs {
		n += len(d)
	}
	bp := f.bounce.Get().(*[]byte)
	defer f.bounce.Put(bp)
	buf := (*bp)[:n]
	if err := f.b.ReadRange(ctx, f.obj, buf, off); err != nil {
		return err
	}
	for _, d := range bufs {
		buf = buf[copy(d, buf):]
	}
	return nil
}

// retry runs op until it succeeds, fails for good, or the deadline (the
// reconnect timeout after the fetch was asked for) has passed; each try's
// context ends at that deadline too, so that a server that hangs or
// trickles cannot hold a read past it.
func (f *File) retry(ctx context.Context, deadline time.Time, op func(context.Context) error) error {
	actx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	backoff := 10 * time.Millisecond
	for {
		err := op(actx)
		switch {
		case err == nil:
			return nil
		case ctx.Err() != nil:
			return ctx.Err() // the caller (or Close) gave up, not the server
		case errors.Is(err, ErrChanged):
			return err
		case actx.Err() != nil:
			return &timeoutError{after: max(f.o.ReconnectTimeout, minAttempt), last: err}
		case !errors.Is(err, ErrTemporary):
			return err
		}
		if time.Now().Add(backoff).After(deadline) {
			return &timeoutError{after: max(f.o.ReconnectTimeout, minAttempt), last: err}
		}
		t := time.NewTimer(backoff)
		select {
		case <-t.C:
		case <-actx.Done():
			t.Stop()
		}
		backoff = min(2*backoff, time.Second)
	}
}

// timeoutError: the reconnect timeout passed with no good answer. It does
// not wrap context.DeadlineExceeded: that is the caller's interruption
// (EINTR), this is the server's failure (EIO).
type timeoutError struct {
	after time.Duration
	last  error
}

func (e *timeoutError) Error() string {
	return fmt.Sprintf("no good answer within the reconnect timeout (%v); last: %v", e.after, e.last)
}

// IOError is what a failed read returns: EIO to errno mappers, and
// ErrChanged when that is the cause, but none of the cause's own errnos
// or context errors (a reset is not the reader's ECONNRESET, a request's
// timeout is not the reader's interruption).
type IOError struct {
	msg     string
	changed bool
}

func (e *IOError) Error() string { return e.msg }
func (e *IOError) Unwrap() []error {
	if e.changed {
		return []error{unix.EIO, ErrChanged}
	}
	return []error{unix.EIO}
}

func (f *File) ioError(err error, off, n int64) error {
	if errors.Is(err, errClosed) || errors.Is(err, context.Canceled) && f.ctx.Err() != nil {
		return fmt.Errorf("%s: %w", f.name, errClosed)
	}
	changed := errors.Is(err, ErrChanged)
	if changed && !f.changed.Swap(true) {
		f.log.Error("remote object changed while exported: reads fail with EIO from now on", "object", f.name,
			"etag", f.obj.ETag, "size", f.obj.Size)
	}
	return &IOError{msg: fmt.Sprintf("%s: read %d bytes at %d: %v", f.name, n, off, err), changed: changed}
}

// Close stops the fetches in flight and closes the backend.
func (f *File) Close() error {
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		return nil
	}
	f.closed = true
	f.mu.Unlock()
	f.cancel()
	f.wg.Wait()
	f.mu.Lock()
	f.blocks, f.free = nil, nil
	f.lru.next, f.lru.prev = &f.lru, &f.lru
	f.mu.Unlock()
	return f.b.Close()
}

var _ aio.File = (*File)(nil)
var _ formats.CacheLender = (*File)(nil)
var _ aio.Sized = (*File)(nil)
