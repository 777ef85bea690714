// Package qcow2 reads and writes qcow2 images (versions 2 and 3): L1/L2
// translation with a bounded LRU of L2 tables, contiguous clusters merged
// into one host I/O, runs of one request read in parallel, zero clusters,
// compressed clusters (deflate and zstd) through a small cache of decoded
// clusters, and backing chains of qcow2 or raw files (always read-only).
//
// Writes allocate clusters (copy-on-write from the backing chain or a
// compressed cluster), keep refcounts, L2 tables and the L1 table in
// write-back caches, and write them at Flush in an order that leaves the
// file consistent at every instant: a crash may leak clusters, never
// corrupt the image. See write.go for the rules and flush.go for the
// order; each file opens with what it holds.
package qcow2

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/hostfile"
	"github.com/blockexport/blockexport/formats/internal/lru"
)

// DefaultL2CacheSize holds every L2 table of a 64 GiB image with 64 KiB
// clusters (128 tables of 64 KiB).
const DefaultL2CacheSize = 8 << 20

// maxExtentSteps bounds the cluster lookups of one Extent call.
const maxExtentSteps = 1 << 16

// decodedCacheBytes bounds the cache of decompressed clusters.
const decodedCacheBytes = 4 << 20

// Options say how to use an image file.
type Options struct {
	// L2CacheSize is the L2 table cache in bytes; 0 means the default.
	L2CacheSize int64
	// DecodedCacheSize is the cache of decompressed clusters in bytes;
	// 0 means the default (decodedCacheBytes).
	DecodedCacheSize int64
	// Direct: the file is O_DIRECT (behind aio.Aligned), so no page cache
	// is there to hit.
	Direct bool
	// Writable opens the image for writing; its backing chain stays
	// read-only.
	Writable bool
	// EditBitmaps opens a writable image to edit its bitmaps
	// (EditBitmaps): none is marked in use or tracked at open, so that a
	// crash before the edit is written leaves them exactly as they were.
	EditBitmaps bool
	Logger      *slog.Logger
	// OpenBacking opens the backing file, if the image has one (the
	// registry gives it: this package knows no other format).
	OpenBacking formats.BackingOpener
	// Shown is a name the header holds as a message may show it (the
	// opener's: a URL without its user, password or query); nil: as it
	// is. This package knows no protocol, and so no secret in a URL.
	Shown func(string) string
}

// Image is an open qcow2 image.
type Image struct {
	f       aio.File
	noFlush atomic.Bool // SetNoFlush: write-backs issue no fdatasync
	path    string
	h       *header
	size    atomic.Int64 // virtual size; h.size is the value at open
	// end is where this layer's clusters stop counting as inside the
	// image, for the bookkeeping that decides what a cluster reads as
	// past the end (readsZero, readOld, wholeClusters). It is size, except
	// while a grow zeroes the new part: then it is already the new size,
	// which size only becomes once that part reads as zeroes, so that no
	// writer can reach the new part before the zeroing is done.
	end atomic.Int64
	// l2cache holds clean L2 tables: lookups insert with PutIfGen, so a
	// table read from the file while a write-back replaced it never lands
	// over the newer one; changed tables live outside it (writeState's
	// pinned maps) until they are written.
	l2cache *lru.Cache[[]uint64]
	dcache  *lru.Cache[[]byte] // decompressed clusters
	rcache  *lru.Cache[[]byte] // clean refcount blocks
	backing formats.Image      // nil: unallocated clusters read as zeroes
	direct  bool               // O_DIRECT host file: no page cache to hit
	// preallocated: metadata preallocation detected, so block status asks
	// the host file which data clusters are holes (as QEMU does). Found out
	// on the first block status that needs it, never at open: the scan
	// grows with the refcount table.
	preallocOnce sync.Once
	preallocated bool
	// snaps is the snapshot table, read and checked at open.
	snaps []snapshotEntry
	// snapTableBytes is the snapshot table's length in the file.
	snapTableBytes int64
	// corrupt: a write would have landed on metadata; the image is marked
	// corrupt and refuses writes from then on (see overlap.go).
	corrupt atomic.Bool

	// The locks, in the one order they are taken (none is taken while
	// one further down is held); the fields they guard say which:
	//
	//  1. w.flushMu: one Flush at a time, so write-backs land in order.
	//  2. w.users: shared by every read, write and zeroing; exclusive
	//     only while Flush applies deferred frees (no request may be
	//     using a cluster it frees).
	//  3. w.clusters: range lock on the virtual clusters whose mapping a
	//     request changes (allocating writes, zeroing, discard).
	//  4. w.alloc: every metadata change (allocation, L1 and L2 entries,
	//     refcounts, header fields); held across metadata loads from the
	//     file, never across data I/O.
	//  5. meta: what lookups read (l1, the pinned L2 tables, fileSize);
	//     shared for a few loads, exclusive only to store, never across
	//     I/O.
	//  6. the caches' own mutexes (formats/internal/lru).
	//
	// The try paths (TryReadAt, TryWriteAt) only TryLock 2 and 5: they
	// give up rather than wait.
	meta sync.RWMutex
	l1   []uint64
	// fileSize is the end of the host file as the metadata knows it:
	// allocation moves it before the file itself grows.
	fileSize int64

	w   *writeState // nil when read-only
	log *slog.Logger
	// editBitmaps: Options.EditBitmaps.
	editBitmaps bool
}

// New opens the qcow2 image in f, which it owns from now on (Close closes
// it; so does a failed New), with its backing chain.
func New(ctx context.Context, f aio.File, o Options) (*Image, error) {
	path := f.Name()
	q, err := load(f, path, o)
	if err != nil {
		f.Close()
		return nil, err
	}
	if o.Writable {
		if err := q.openForWriting(ctx); err != nil {
			f.Close()
			return nil, fmt.Errorf("%s: %w", path, err)
		}
	}
	if err := q.openBacking(o.OpenBacking, o.Shown); err != nil {
		f.Close()
		return nil, err
	}
	return q, nil
}

// load reads and checks the header and the L1 table.
func load(f aio.File, path string, o Options) (*Image, error) {
	ctx := context.Background()
	fileSize, head, err := readHead(ctx, f)
	if err != nil {
		return nil, err
	}
	h, err := parseHeader(head, fileSize)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	q := &Image{f: f, path: path, h: h, fileSize: fileSize, direct: o.Direct, log: o.Logger, editBitmaps: o.EditBitmaps}
	q.size.Store(int64(h.size))
	q.end.Store(int64(h.size))
	if h.l1Size > 0 {
		raw := make([]byte, int64(h.l1Size)*8)
		if _, err := f.ReadAt(ctx, raw, int64(h.l1Offset)); err != nil {
			return nil, fmt.Errorf("qcow2: %s: L1 table at %#x: %w", path, h.l1Offset, err)
		}
		q.l1 = decodeTable(raw)
	}
	cacheBytes := o.L2CacheSize
	if cacheBytes <= 0 {
		cacheBytes = DefaultL2CacheSize
	}
	q.l2cache = lru.New[[]uint64](int(cacheBytes / h.clusterSize))
	decoded := o.DecodedCacheSize
	if decoded <= 0 {
		decoded = decodedCacheBytes
	}
	q.dcache = lru.New[[]byte](int(max(2, decoded/h.clusterSize)))
	q.rcache = lru.New[[]byte](4)
	if q.snaps, q.snapTableBytes, err = q.readSnapshots(ctx); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return q, nil
}

// defaultClusterBits is the cluster size qemu-img create gives, 64 KiB:
// what readHead reads first.
const defaultClusterBits = 16

// readHead returns the length of f (a block device's by seeking to its
// end) and its first cluster: the header and its extensions. It reads 64
// KiB (the default cluster) and the rest of a larger cluster only when the
// header says so: reading and zeroing the largest cluster, 2 MiB, was a
// tenth of a `measure` process's time.
func readHead(ctx context.Context, f aio.File) (int64, []byte, error) {
	var st unix.Stat_t
	if !aio.HasFd(f) {
		// A remote object: its size is all there is to stat.
		n, err := aio.FileSize(f)
		if err != nil {
			return 0, nil, fmt.Errorf("qcow2: %w", err)
		}
		st.Size, st.Mode = n, unix.S_IFREG
	} else if err := unix.Fstat(f.Fd(), &st); err != nil {
		return 0, nil, fmt.Errorf("qcow2: stat %s: %w", f.Name(), err)
	}
	if st.Mode&unix.S_IFMT == unix.S_IFBLK {
		if n, err := unix.Seek(f.Fd(), 0, io.SeekEnd); err == nil {
			st.Size = n
		}
	}
	head := make([]byte, min(st.Size, 1<<defaultClusterBits))
	if _, err := f.ReadAt(ctx, head, 0); err != nil && err != io.EOF {
		return 0, nil, fmt.Errorf("qcow2: read header of %s: %w", f.Name(), err)
	}
	if len(head) < hdrClusterBits+4 {
		return st.Size, head, nil // parseHeader refuses it
	}
	bits := binary.BigEndian.Uint32(head[hdrClusterBits:])
	if bits <= defaultClusterBits || bits > maxClusterBits || st.Size <= int64(len(head)) {
		return st.Size, head, nil // what parseHeader reads is here, or it refuses the cluster size
	}
	cluster := make([]byte, min(st.Size, 1<<bits))
	copy(cluster, head)
	if _, err := f.ReadAt(ctx, cluster[len(head):], int64(len(head))); err != nil && err != io.EOF {
		return 0, nil, fmt.Errorf("qcow2: read header of %s: %w", f.Name(), err)
	}
	return st.Size, cluster, nil
}

func (q *Image) Size() int64 { return q.size.Load() }

// ReadAt reads p at off. Clusters are classified first; every run of host
// I/O (contiguous data clusters, or a stretch to read from the backing file)
// becomes one read, and the runs of one request go in parallel.
func (q *Image) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	if off < 0 || off+int64(len(p)) > q.Size() {
		return 0, fmt.Errorf("qcow2: read [%d, +%d): %w", off, len(p), formats.ErrOutOfRange)
	}
	if q.w != nil {
		// No cluster we read is freed and reused under us.
		q.w.users.RLock()
		defer q.w.users.RUnlock()
	}
	var runs []ioRun
	var first ioRun
	cs := q.h.clusterSize
	for pos := int64(0); pos < int64(len(p)); {
		voff := off + pos
		n := min(cs-voff%cs, int64(len(p))-pos)
		m, _, err := q.lookup(ctx, voff/cs)
		if err != nil {
			return 0, err
		}
		switch m.kind {
		case zero:
			clear(p[pos : pos+n])
		case compressed:
			c, err := q.compressedCluster(ctx, m)
			if err != nil {
				return 0, err
			}
			copy(p[pos:pos+n], c[voff%cs:])
		case data, unallocated:
			run := ioRun{buf: p[pos : pos+n], off: voff, backing: m.kind == unallocated}
			if m.kind == data {
				run.off = m.host + voff%cs
			}
			// Extend over following clusters that continue the run.
			for pos+n < int64(len(p)) {
				next, _, err := q.lookup(ctx, (voff+n)/cs)
				if err != nil {
					return 0, err
				}
				if next.kind != m.kind || (m.kind == data && next.host != run.off+n) {
					break
				}
				n += min(cs, int64(len(p))-pos-n)
			}
			run.buf = p[pos : pos+n]
			if first.buf == nil {
				first = run
			} else {
				runs = append(runs, run)
			}
		}
		pos += n
	}
	if err := q.doRuns(ctx, first, runs); err != nil {
		return 0, err
	}
	return len(p), nil
}

// ioRun is one host read: from this file at off, or from the backing chain
// at virtual offset off.
type ioRun struct {
	buf     []byte
	off     int64
	backing bool
}

func (q *Image) doRuns(ctx context.Context, first ioRun, rest []ioRun) error {
	if first.buf == nil {
		return nil
	}
	if len(rest) == 0 {
		return q.doRun(ctx, first)
	}
	var wg sync.WaitGroup
	errs := make([]error, len(rest))
	for i, r := range rest {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = q.doRun(ctx, r)
		}()
	}
	err := q.doRun(ctx, first)
	wg.Wait()
	if err != nil {
		return err
	}
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

func (q *Image) doRun(ctx context.Context, r ioRun) error {
	if r.backing {
		return q.readBacking(ctx, r.buf, r.off)
	}
	n, err := q.f.ReadAt(ctx, r.buf, r.off)
	if err == io.EOF {
		// A cluster the file ends inside of: the rest reads as zeroes.
		clear(r.buf[n:])
		return nil
	}
	if err != nil {
		return fmt.Errorf("qcow2: read %d bytes at host %#x: %w", len(r.buf), r.off, err)
	}
	return nil
}

// readBacking fills p from the backing chain at virtual offset off; what
// lies past the backing file's end (or everything, without one) is zeroes.
func (q *Image) readBacking(ctx context.Context, p []byte, off int64) error {
	if q.backing == nil {
		clear(p)
		return nil
	}
	bsize := q.backing.Size()
	inBacking := max(0, min(int64(len(p)), bsize-off))
	if inBacking > 0 {
		if _, err := q.backing.ReadAt(ctx, p[:inBacking], off); err != nil {
			return err
		}
	}
	clear(p[inBacking:])
	return nil
}

// Extent reports the run at off with one status, as QEMU's block status
// does: this layer's data, zero and compressed clusters at depth 0, and for
// unallocated ones whatever the backing chain says, one level deeper.
func (q *Image) Extent(ctx context.Context, off, n int64) (formats.Extent, error) {
	size := q.Size()
	if off < 0 || off >= size {
		return formats.Extent{}, fmt.Errorf("qcow2: extent at %d: %w", off, formats.ErrOutOfRange)
	}
	n = min(n, size-off)
	cs := q.h.clusterSize
	m, absent, err := q.lookup(ctx, off/cs)
	if err != nil {
		return formats.Extent{}, err
	}
	// Length of the run of clusters like the first.
	length := cs - off%cs
	if absent {
		length = q.h.l2Entries*cs - off%(q.h.l2Entries*cs)
	}
	// Host offsets must continue too, for runs that have them: the cluster
	// at virtual off+length lies at m.host+off%cs+length.
	continues := func(next mapping) bool {
		if next.kind != m.kind {
			return false
		}
		switch {
		case m.kind == data, m.kind == zero && m.host != 0:
			return next.host == m.host+off%cs+length
		case m.kind == zero:
			return next.host == 0
		}
		return true
	}
	// Bound the work of one call: a crafted image can point every L1 entry
	// at one L2 table of unallocated entries, and callers loop anyway.
	for steps := 0; length < n && steps < maxExtentSteps; steps++ {
		// Where the table is in memory, its entries are compared in one
		// pass under one lock: a lookup per cluster was most of the time
		// `measure` spent walking a large image's allocated tables.
		k, stopped, ok, err := q.scanCachedL2((off+length)/cs, func(next mapping) bool {
			if length >= n || !continues(next) {
				return false
			}
			length += cs
			return true
		})
		if err != nil {
			return formats.Extent{}, err
		}
		if stopped {
			break
		}
		if ok {
			steps += int(k)
			continue
		}
		next, nAbsent, err := q.lookup(ctx, (off+length)/cs)
		if err != nil {
			return formats.Extent{}, err
		}
		if !continues(next) {
			break
		}
		if nAbsent {
			length += q.h.l2Entries*cs - (off+length)%(q.h.l2Entries*cs)
		} else {
			length += cs
		}
	}
	length = min(length, n)
	switch m.kind {
	case data:
		// Like QEMU, ask the host file whether the clusters read as zeroes
		// (preallocated, never written: a hole in the file).
		host := m.host + off%cs
		zero := false
		if q.isPreallocated(ctx) {
			length, zero = q.hostZero(host, length)
		}
		return formats.Extent{Start: off, Length: length, Data: true, Zero: zero, Present: true, Offset: host, HasOffset: true, File: q.path}, nil
	case compressed:
		return formats.Extent{Start: off, Length: length, Data: true, Present: true, File: q.path}, nil
	case zero:
		e := formats.Extent{Start: off, Length: length, Zero: true, Present: true, File: q.path}
		if m.host != 0 {
			e.Offset, e.HasOffset = m.host+off%cs, true
		}
		return e, nil
	}
	// Unallocated here: ask the backing chain.
	if q.backing == nil {
		return formats.Extent{Start: off, Length: length, Zero: true, File: q.path}, nil
	}
	bsize := q.backing.Size()
	if off >= bsize {
		// Past the backing file's end this layer answers: zeroes.
		return formats.Extent{Start: off, Length: length, Zero: true, File: q.path}, nil
	}
	e, err := q.backing.Extent(ctx, off, min(length, bsize-off))
	if err != nil {
		return formats.Extent{}, err
	}
	e.Depth++
	return e, nil
}

// TryReadAt serves a read that stays inside one cluster whose L2 entry is
// in memory: data from the page cache (aio's try), zero clusters, and
// unallocated ones from the backing image's own try (or as zeroes without
// one). Anything else would wait, and so would a lock someone else holds:
// then it says no at once.
func (q *Image) TryReadAt(p []byte, off int64) bool {
	cs := q.h.clusterSize
	if len(p) == 0 || off < 0 || off+int64(len(p)) > q.Size() || off/cs != (off+int64(len(p))-1)/cs {
		return false
	}
	if q.w != nil {
		if !q.w.users.TryRLock() {
			return false
		}
		defer q.w.users.RUnlock()
	}
	m, ok := q.tryLookup(off / cs)
	if !ok {
		return false
	}
	switch m.kind {
	case zero:
		clear(p)
		return true
	case unallocated:
		if q.backing == nil {
			clear(p)
			return true
		}
		return off+int64(len(p)) <= q.backing.Size() && q.backing.TryReadAt(p, off)
	case data:
		return q.f.TryReadAt(p, m.host+off%cs)
	}
	return false // compressed: decompressing is not instant
}

// TryLendAt is TryReadAt lending the file's pages (formats.PageLender),
// for an image opened read-only: a writable one may free a cluster and
// reuse it for another between the lend and the reply's writev.
func (q *Image) TryLendAt(off, n int64, v [][]byte) ([][]byte, bool) {
	cs := q.h.clusterSize
	if q.w != nil || n <= 0 || off < 0 || off+n > q.Size() || off/cs != (off+n-1)/cs {
		return v, false
	}
	m, ok := q.tryLookup(off / cs)
	if !ok {
		return v, false
	}
	switch m.kind {
	case zero:
		return formats.LendZeroes(q.f, v, n)
	case unallocated:
		if q.backing == nil {
			return formats.LendZeroes(q.f, v, n)
		}
		if off+n > q.backing.Size() {
			return v, false
		}
		return formats.TryLend(q.backing, off, n, v)
	case data:
		return formats.LendFile(q.f, v, m.host+off%cs, n)
	}
	return v, false // compressed
}

// hostZero says whether [host, host+n) of the file is a hole (reads as
// zeroes), and for how long that answer holds.
func (q *Image) hostZero(host, n int64) (int64, bool) {
	q.meta.RLock()
	fileSize := q.fileSize
	q.meta.RUnlock()
	if host >= fileSize {
		return n, true
	}
	if !aio.HasFd(q.f) {
		return n, false // a remote object: no holes to ask about
	}
	return hostfile.Run(q.f.Fd(), host, n)
}

// AllocatedSize is the host allocation of this file (not the chain), as
// qemu-img info's actual-size.
func (q *Image) AllocatedSize(context.Context) (int64, error) {
	if !aio.HasFd(q.f) {
		return 0, errNoAllocation
	}
	a, err := hostfile.Allocated(q.f.Fd())
	if err != nil {
		return 0, fmt.Errorf("qcow2: stat: %w", err)
	}
	return a, nil
}

// errNoAllocation: a file without a descriptor (a remote object) has no
// host allocation to report (qemu-img's "disk size: unavailable").
var errNoAllocation = errors.New("no host allocation to report")

// Info describes the image as qemu-img info does.
func (q *Image) Info() formats.Info {
	ctx := context.Background()
	actual, err := q.AllocatedSize(ctx)
	if err != nil {
		actual = -1
	}
	h := q.h
	compat := "1.1"
	if h.version == 2 {
		compat = "0.10"
	}
	compression := "zlib"
	if h.compressionType == compressionZstd {
		compression = "zstd"
	}
	info := formats.Info{
		Format: "qcow2", Filename: q.path, VirtualSize: q.Size(), ActualSize: actual,
		ClusterSize: h.clusterSize, DirtyFlag: h.incompatible&incDirty != 0,
		BackingFilename: h.backingFile, BackingFilenameFormat: h.backingFormat,
		RequestAlignment: 1,
	}
	d := Detail{
		Compat: compat, CompressionType: compression,
		LazyRefcounts: h.compatible&compatLazyRefcounts != 0,
		RefcountBits:  1 << h.refcountOrder,
		Corrupt:       h.incompatible&incCorrupt != 0 || q.corrupt.Load(),
		ExtendedL2:    h.incompatible&incExtendedL2 != 0,
	}
	lines := []string{
		"compat: " + d.Compat,
		"compression type: " + d.CompressionType,
		fmt.Sprintf("lazy refcounts: %t", d.LazyRefcounts),
		fmt.Sprintf("refcount bits: %d", d.RefcountBits),
		fmt.Sprintf("corrupt: %t", d.Corrupt),
		fmt.Sprintf("extended l2: %t", d.ExtendedL2),
	}
	if bitmaps, err := q.bitmapInfo(ctx); err != nil {
		lines = append(lines, fmt.Sprintf("bitmaps: unreadable (%v)", err))
	} else if bitmaps != nil {
		d.Bitmaps = bitmaps
		lines = slices.Insert(lines, 3, bitmapLines(bitmaps)...)
	}
	info.FormatSpecific = &formats.FormatSpecific{Type: "qcow2", Data: d, Lines: lines}
	if h.version == 2 {
		// QEMU shows a version 2 image's three fields alone.
		info.FormatSpecific.Data = detailV2{d.Compat, d.CompressionType, d.RefcountBits}
		info.FormatSpecific.Lines = []string{lines[0], lines[1], fmt.Sprintf("refcount bits: %d", d.RefcountBits)}
	}
	if h.backingFile != "" {
		info.FullBackingFilename = backingPath(q.path, h.backingFile) // as openBacking resolves it
	}
	info.Snapshots = q.snapshotList()
	return info
}

// Detail is the "data" of a qcow2 image's format-specific object in
// `qemu-img info --output=json`.
type Detail struct {
	Compat          string `json:"compat"`
	CompressionType string `json:"compression-type"`
	LazyRefcounts   bool   `json:"lazy-refcounts"`
	// Bitmaps are the persistent dirty bitmaps, in qemu-img's place.
	Bitmaps      []BitmapInfo `json:"bitmaps,omitempty"`
	RefcountBits int          `json:"refcount-bits"`
	Corrupt      bool         `json:"corrupt"`
	ExtendedL2   bool         `json:"extended-l2"`
}

// detailV2 is Detail as qemu-img shows a version 2 image.
type detailV2 struct {
	Compat          string `json:"compat"`
	CompressionType string `json:"compression-type"`
	RefcountBits    int    `json:"refcount-bits"`
}

// Features: zeroing whole clusters is metadata only in version 3 (zero
// flags); the host file's layout is not the image's.
func (q *Image) Features() formats.Features {
	stall := !aio.HasFd(q.f) || q.backing != nil && q.backing.Features().MayStall
	return formats.Features{FastZero: q.h.version >= 3, MayStall: stall}
}

// Backing returns the backing image, or nil.
func (q *Image) Backing() formats.Image { return q.backing }

// Close writes back cached metadata of a writable image, then closes it
// and its backing chain.
func (q *Image) Close() error {
	var err error
	if q.w != nil {
		err = q.closeFlush(context.Background())
		if terr := q.trimGrowAhead(); err == nil {
			err = terr
		}
	}
	if cerr := q.f.Close(); err == nil {
		err = cerr
	}
	if q.backing != nil {
		if berr := q.backing.Close(); err == nil {
			err = berr
		}
	}
	return err
}
