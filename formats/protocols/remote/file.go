package remote

// The File, an object as a read-only aio.File; beside it the block cache
// (cache.go), readahead (readahead.go), the GETs (fetch.go) and retries (retry.go).

import (
	"cmp"
	"context"
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
	// reader at queue depth 16: with 8, half of them waited for one
	// (docs/design.md, Remote objects: connections).
	DefaultConnections = 16
	DefaultCacheSize   = 64 << 20
	DefaultBlockSize   = 16 << 10
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

// File is an object read through a Backend, as a read-only aio.File that
// formats open like a local file (no descriptor: Fd is -1, its size is
// Size). Reads are served from a cache of fixed-size blocks; a missing
// block is fetched once however many readers want it, runs of them by one
// range GET each (up to maxGet) over at most Connections requests at once.
// A reader seen continuing where it stopped gets readahead, growing with
// the stream; a random read gets none.
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
	o.Logger = cmp.Or(o.Logger, slog.Default())
	f := &File{b: b, name: b.String(), o: o, log: o.Logger, bs: int64(o.BlockSize),
		conns: slots{free: o.Connections}, blocks: map[int64]*block{}, jobs: make(chan fetch)}
	f.lru.next, f.lru.prev = &f.lru, &f.lru
	f.capacity = int(max(o.CacheSize/f.bs, 16))
	f.window = min(maxWindow, max(o.CacheSize/4, initWindow))
	f.bounce.New = func() any { b := make([]byte, maxGet); return &b }
	f.ctx, f.cancel = context.WithCancel(context.Background())
	f.loneCtx = coroutines.WithPath(f.ctx, coroutines.Lone)
	obj, err := f.stat(ctx)
	if err == nil && obj.Size < 0 {
		err = fmt.Errorf("%s: size %d: %w", f.name, obj.Size, ErrBadReply)
	}
	if err != nil {
		f.cancel()
		b.Close()
		return nil, err
	}
	f.obj = obj
	f.growTo = int(min(int64(f.capacity), obj.Size/f.bs+1))
	f.lastOK.Store(time.Now().UnixNano())
	return f, nil
}

// stat is Backend.Stat with the retries a read gets.
func (f *File) stat(ctx context.Context) (Object, error) {
	var obj Object
	err := f.retry(ctx, time.Now().Add(f.timeout()), func(ctx context.Context) (err error) {
		obj, err = f.b.Stat(ctx)
		return err
	})
	return obj, err // the backend's errors name the object
}

// Size is the object's size, pinned at open (aio.Sized).
func (f *File) Size() int64 { return f.obj.Size }

func (f *File) Fd() int              { return -1 }
func (f *File) Name() string         { return f.name }
func (f *File) Backend() aio.Backend { return aio.Backend("remote") }

func (f *File) WriteAt(context.Context, []byte, int64) (int, error)    { return 0, formats.ErrReadOnly }
func (f *File) WritevAt(context.Context, [][]byte, int64) (int, error) { return 0, formats.ErrReadOnly }
func (f *File) TryWriteAt([]byte, int64) (bool, error)                 { return true, formats.ErrReadOnly }
func (f *File) Fallocate(context.Context, uint32, int64, int64) error  { return formats.ErrReadOnly }

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
	// A reader that cannot give up (no Done: a serve loop's lone request)
	// makes its first GET itself, with the connection acquire took: handed
	// to a fetching goroutine it cost two thread wake-ups (docs/design.md,
	// Remote objects: a lone reader's own GET). One that may give up leaves
	// it to a fetching goroutine, which goes on for whoever else waits.
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
// (formats.CacheLender), saving the copy ReadAt makes (docs/design.md,
// Page lending); the blocks stay referenced until release.
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
