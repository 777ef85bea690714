package remote

// The block cache: blocks loading, then loaded, in LRU order within the capacity.

import (
	"golang.org/x/sys/unix"
)

// page is the unit of a partial fetch (see block): a random read fetches
// the pages of its block that it covers, not the block.
const page = 4 << 10

// block is one cache entry: loading until done is closed, then loaded
// (data valid) or failed (err; already out of the map). The blocks of one
// GET share its done (start makes it, load closes it once they are all
// complete).
//
// A block holds (or is fetching) the bytes [lo, hi) of its range; that is
// all of it but where a random read fetched only the pages it covers (a
// partial block: smaller blocks for everything would cost sequential
// reads; docs/design.md, Remote objects: partial blocks). A read that
// needs bytes a block lacks replaces it (evict).
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

// acquire returns the blocks of [off, off+n), referenced, starting the
// fetches of those missing and the readahead the read earns. With inline,
// the first of the reader's own GETs comes back unstarted (mine) when a
// connection was free: the caller runs it, then waits for the rest.
func (f *File) acquire(off, n int64, inline bool) (want []*block, mine *fetch, err error) {
	first, last := off/f.bs, (off+n-1)/f.bs
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		return nil, nil, f.closedError()
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
			runs = addRun(runs, i)
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

// insert makes a loading entry for block i (see room). Loading blocks are
// never evicted: when all are loading, the cache overshoots by what
// readers asked for themselves (readahead is cut instead) until their
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

// newBuf is a block's buffer, recycled or new, with mu held. While the
// cache still grows, fresh buffers are made ahead of need (grow): one made
// here is faulted in page by page by its GET, on the reader's path
// (docs/design.md, Remote objects: block buffers).
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

// grow makes n fresh block buffers in one allocation, off the readers'
// path, faults them in with one madvise(MADV_POPULATE_WRITE) (cheaper than
// the GETs' page-by-page faults, which remain where the kernel lacks it)
// and adds them to the spares. They count against the capacity from when
// newBuf starts the grow (made), so a cache never makes more than it holds.
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
