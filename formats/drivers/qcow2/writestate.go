package qcow2

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/blockexport/blockexport/coroutines"

	"github.com/blockexport/blockexport/formats/internal/lru"
)

// The write state of a writable image: what it keeps beside a read-only
// one, and the checks that make writing it safe.

// writeState is what a writable image adds to a read-only one.
type writeState struct {
	// The locks: see Image.meta for what each is for and their order.
	// Writes into clusters the image owns take only users.
	users    sync.RWMutex
	alloc    sync.Mutex
	flushMu  sync.Mutex
	clusters coroutines.RangeLock

	// l2pin holds L2 tables that changed (dirty) or that a writer holds
	// for changing; lookups see them before the LRU. Guarded by meta for
	// readers, alloc+meta for changes.
	l2pin map[int64]*pinnedL2
	// Guarded by alloc:
	rbpin map[int64]*pinnedBlock // refcount blocks, same rule
	// rtable is the refcount table without its trailing zero entries
	// (the file's table is a whole cluster or more, mostly zeros: 64 KiB
	// held per small image, a daemon's 200 nodes 12.5 MB); rtEntries is
	// the file's, which an index below it may reach (extendRefTable).
	rtable      []uint64
	rtEntries   int64
	rtOffset    int64
	rtDirty     bool // the table must be written
	rtMoved     bool // ...and the header pointed at its new place
	l1Offset    int64
	l1Lo, l1Hi  int  // dirty L1 entries [lo, hi)
	l1Moved     bool // the header must point at a new L1 table
	sizeDirty   bool // the header's size must be written
	pendingFree []int64
	freeHint    int64 // no cluster below it is free
	growAhead   int64 // SetGrowAhead's step; 0: the writes extend the file
	physEnd     int64 // the file's length as grown ahead (0: not grown)
	// Dirty pinned tables, to bound what waits for write-back; atomic so
	// that writers check them without alloc.
	dirtyL2, dirtyRB atomic.Int64

	// writes counts the changes completed (wrote); flushed is what it was
	// when the last flush that made them durable began (under flushMu).
	// Equal, with no metadata dirty, a flush has nothing to make durable
	// and issues no fdatasync, as QEMU skips a flush when its write
	// generation has not moved: a close of an image not written since its
	// last flush (blockdev-del of one only read) costs no sync.
	writes  atomic.Uint64
	flushed uint64

	// noZeroRange: the host file system cannot FALLOC_FL_ZERO_RANGE.
	noZeroRange atomic.Bool

	// metaMap is where the metadata lies (overlap.go); guarded by meta.
	metaMap *metaMap

	bits     int64 // refcount width
	perBlock int64 // refcounts per block
	maxRef   uint64

	// bitmaps are the persistent dirty bitmaps (bitmapstore.go); nil:
	// none. Set at open; changed only by the close.
	bitmaps *bitmapSet

	// compNext is where the next compressed cluster goes: a byte in a
	// host cluster that compressed clusters fill (compresswrite.go); 0
	// or cluster-aligned: none. Guarded by alloc.
	compNext int64
}

type pinnedL2 struct {
	t     []uint64
	dirty bool
}

type pinnedBlock struct {
	b     []byte
	dirty bool
}

// openForWriting checks that we can write this image safely and sets up
// the write state.
func (q *Image) openForWriting(ctx context.Context) error {
	h := q.h
	switch {
	case h.incompatible&incCorrupt != 0:
		return fmt.Errorf("%w: the image is marked corrupt; check and repair it with qemu-img check -r all before writing", ErrCorrupt)
	case h.incompatible&incDirty != 0:
		return fmt.Errorf("%w: the image was not closed cleanly (lazy refcounts); repair its refcounts with qemu-img check -r all before writing", ErrUnsupported)
	}
	rt, err := q.refcountTable(ctx)
	if err != nil {
		return err
	}
	if len(rt) == 0 {
		return fmt.Errorf("%w: no refcount table", ErrCorrupt)
	}
	bits := int64(1) << h.refcountOrder
	w := &writeState{
		l2pin: map[int64]*pinnedL2{}, rbpin: map[int64]*pinnedBlock{},
		rtable: trimRefTable(rt), rtEntries: int64(len(rt)), rtOffset: int64(h.refcountOffset), l1Offset: int64(h.l1Offset),
		freeHint: 1, bits: bits, perBlock: h.clusterSize * 8 / bits,
	}
	w.maxRef = 1<<bits - 1
	if bits == 64 {
		w.maxRef = ^uint64(0)
	}
	// Autoclear features are ones a writer that does not understand them
	// must clear: we understand only the bitmaps one (bitmapstore.go),
	// and keep it only where its extension is in effect.
	keep := uint64(0)
	if h.hasBitmaps {
		keep = autoclearBitmaps
	}
	if h.version >= 3 && h.autoclear != keep {
		if err := writeHeaderField(ctx, q.f, hdrAutoclear, keep); err != nil {
			return fmt.Errorf("qcow2: clear autoclear features: %w", err)
		}
		h.autoclear = keep
		w.writes.Add(1) // not synced here: the first flush does
	}
	// Allocation reads refcounts cluster by cluster: keep more clean
	// blocks than a read-only open needs (4 MiB of them).
	q.rcache = lru.New[[]byte](max(4, int(refBlockCacheBytes/h.clusterSize)))
	q.w = w
	q.buildMetaMap()
	return q.openBitmaps(ctx)
}

// wrote notes a change completed (or failed part way), for the next flush
// to make durable: one atomic add. Every method that writes the file
// calls it once it is done.
func (q *Image) wrote() {
	if q.w != nil {
		q.w.writes.Add(1)
	}
}

// refBlockCacheBytes bounds the clean refcount blocks a writable image
// keeps.
const refBlockCacheBytes = 4 << 20

// trimRefTable is rt without its trailing zero entries, in an array of
// its own (rt's goes to the collector).
func trimRefTable(rt []uint64) []uint64 {
	n := len(rt)
	for n > 0 && rt[n-1] == 0 {
		n--
	}
	return slices.Clone(rt[:n])
}

// extendRefTable makes entry i of the refcount table, below rtEntries,
// addressable in w.rtable. The caller holds alloc.
func (w *writeState) extendRefTable(i int64) {
	if i >= int64(len(w.rtable)) {
		w.rtable = append(w.rtable, make([]uint64, i+1-int64(len(w.rtable)))...)
	}
}
