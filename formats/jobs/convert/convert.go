package convert

import (
	"bytes"
	"context"
	"fmt"
	"runtime"
	"sync"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
)

// Target is what a conversion writes to: a formats.Image opened writable
// is one.
type Target interface {
	WriteAt(ctx context.Context, p []byte, off int64) (int, error)
	WriteZeroes(ctx context.Context, off, n int64, mayUnmap bool) error
}

// CompressedTarget stores whole clusters compressed (a qcow2 image).
// Compression is separate from the write so that it runs in the workers,
// on all cores, while writes keep their order.
type CompressedTarget interface {
	ClusterSize() int64
	// CompressCluster returns p (one cluster, or the image's last partial
	// one) compressed, or ok false when that is not smaller.
	CompressCluster(p []byte) (comp []byte, ok bool, err error)
	// WriteCompressed stores comp as the cluster at off.
	WriteCompressed(ctx context.Context, comp []byte, off int64) error
}

// CompressedOnly is a target that stores every cluster compressed (a
// stream-optimized vmdk; QEMU's needs_compressed_writes): a conversion
// to it compresses as -c does, whether -c is given or not.
type CompressedOnly interface {
	NeedsCompressedWrites() bool
}

// Options say how to convert.
type Options struct {
	// Parallel is how many chunks are read (and written) at once: qemu-img
	// convert -m, default 8. With Compressed, at least one per CPU, so
	// that compression has every core.
	Parallel int
	// OutOfOrder lets writes complete in any order (-W); otherwise each
	// chunk is written after the one before it, as qemu-img does.
	OutOfOrder bool
	// MinSparse is -S: a run of zeroes inside data this long (aligned to
	// it) is not written. 0 writes every data byte the source has.
	MinSparse int64
	// TargetZero: the target reads as zeroes wherever it is not written
	// (a new image, or --target-is-zero). Otherwise zero runs are written
	// as zeroes, unless Backing says what the target reads.
	TargetZero bool
	// Backing: the target reads as this image where it is not written
	// (qemu-img convert -B). Only what differs from it is written.
	Backing formats.Image
	// Compressed: data clusters are stored compressed (-c).
	Compressed CompressedTarget
	// Chunk is the unit of work, the largest read; default 256 KiB (or a
	// cluster, or a -S granule, when larger): small enough that the
	// buffers in flight stay in the CPU's caches from the read to the
	// write (docs/design.md, Convert's chunk sizes).
	Chunk int64
	// Progress is told how far the target holds the source (Stats.Done),
	// from any goroutine, one call at a time.
	Progress func(done, total int64)
}

// Stats say what a conversion did.
type Stats struct {
	// Done is how far the target holds the source: every byte below it
	// is converted (the rest may be in part).
	Done int64
}

// defaultGranule is what -B compares in when -S is 0.
const defaultGranule = 4096

// span is a run [start, end) of a chunk, data or known zeroes.
type span struct {
	start, end int64
	data       bool
}

type job struct {
	seq      int64
	off, n   int64
	src      []span // the source's data runs in the chunk (absolute)
	backing  bool   // the backing file has data in the chunk
	srcZero  bool   // the source reads as zeroes across the chunk
	zeroOnly bool   // write zeroes across the chunk, nothing to read
}

type engine struct {
	src     formats.Image
	dst     Target
	o       Options
	granule int64

	bufs chan []byte
	// csem admits one compressing worker per CPU: more would only take
	// turns on the cores, each with its own encoder's tables, and evict
	// one another's from the caches (zstd ran at half speed).
	csem chan struct{}

	mu       sync.Mutex
	cond     *sync.Cond
	nextSeq  int64 // the seq whose turn it is to write (in order)
	stats    Stats
	finished map[int64]int64 // chunks done past stats.Done: start -> end
	err      error
}

// Convert copies src into dst as qemu-img convert does. dst must be at
// least src's size. Runs the source knows to be zeroes are not read; what
// the target already reads as (zeroes, or Backing) is not written.
func Convert(ctx context.Context, src formats.Image, dst Target, o Options) (Stats, error) {
	if o.Parallel <= 0 {
		o.Parallel = 8
	}
	if o.Compressed != nil {
		o.Parallel = max(o.Parallel, runtime.GOMAXPROCS(0))
	}
	if o.MinSparse < 0 {
		return Stats{}, fmt.Errorf("convert: -S %d: must not be negative", o.MinSparse)
	}
	if o.Chunk <= 0 {
		o.Chunk = 256 << 10
	}
	e := &engine{src: src, dst: dst, o: o, finished: map[int64]int64{}}
	e.cond = sync.NewCond(&e.mu)
	switch {
	case o.Compressed != nil:
		cs := o.Compressed.ClusterSize()
		if cs <= 0 || cs > 64<<20 {
			return Stats{}, fmt.Errorf("convert: cluster size %d", cs)
		}
		e.granule = cs // chunks of whole clusters, below
	case o.MinSparse > 0:
		e.granule = o.MinSparse
	case o.Backing != nil:
		e.granule = defaultGranule
	}
	if e.granule > 0 {
		// Chunks hold whole granules, so that a granule is judged once.
		o.Chunk = (max(o.Chunk, e.granule) + e.granule - 1) / e.granule * e.granule
	}
	e.o = o
	if o.Compressed != nil {
		e.csem = make(chan struct{}, runtime.GOMAXPROCS(0))
	}
	nbufs := o.Parallel
	if o.Backing != nil {
		nbufs *= 2
	}
	e.bufs = make(chan []byte, nbufs)
	for range nbufs {
		e.bufs <- nil // allocated on first use
	}
	err := e.run(ctx)
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.err != nil {
		err = e.err // the first failure, not the cancellation it caused
	}
	return e.stats, err
}

func (e *engine) getBuf() []byte {
	p := <-e.bufs
	if int64(cap(p)) < e.o.Chunk {
		// Aligned, so that an O_DIRECT target (-t none) takes it as it is.
		p = aio.AlignedBuf(int(e.o.Chunk), 4096)
	}
	return p[:e.o.Chunk]
}

func (e *engine) fail(err error) {
	e.mu.Lock()
	if e.err == nil {
		e.err = err
	}
	e.cond.Broadcast()
	e.mu.Unlock()
}

func (e *engine) failed() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.err != nil
}

// finish records chunk [off, off+n) as converted and moves Done on.
func (e *engine) finish(off, n int64) {
	e.mu.Lock()
	e.finished[off] = off + n
	for {
		end, ok := e.finished[e.stats.Done]
		if !ok {
			break
		}
		delete(e.finished, e.stats.Done)
		e.stats.Done = end
	}
	if e.o.Progress != nil {
		e.o.Progress(e.stats.Done, e.src.Size())
	}
	e.mu.Unlock()
}

func (e *engine) run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	size := e.src.Size()
	sw := &extentWalker{img: e.src}
	var bw *extentWalker
	var bsize int64
	if e.o.Backing != nil {
		bw = &extentWalker{img: e.o.Backing}
		bsize = e.o.Backing.Size()
	}
	sem := make(chan struct{}, e.o.Parallel)
	var wg sync.WaitGroup
	defer wg.Wait()
	seq := int64(0)
	chunk := e.o.Chunk
	g := e.granule
	for off := int64(0); off < size; {
		if err := ctx.Err(); err != nil {
			return err
		}
		if e.failed() {
			break
		}
		// A run known to be zeroes on the source side is passed over
		// whole (an image may be 2^63 bytes of one hole), or zeroed in
		// one request, as long as the target needs nothing else there;
		// with granules, only from one granule boundary to another.
		x, err := sw.at(ctx, off)
		if err != nil {
			return fmt.Errorf("convert: block status of the source at %d: %w", off, err)
		}
		if zeroKnown(x) {
			skipTo := end(x)
			if bw != nil && off < bsize {
				bx, err := bw.at(ctx, off)
				if err != nil {
					return fmt.Errorf("convert: block status of the backing file at %d: %w", off, err)
				}
				if !zeroKnown(bx) {
					skipTo = off // the backing file's data must be zeroed
				} else {
					skipTo = min(skipTo, end(bx))
				}
			}
			if g > 0 && skipTo < size {
				skipTo -= skipTo % g
			}
			if skipTo > off {
				if bw != nil || e.o.TargetZero {
					e.finish(off, skipTo-off)
					off = skipTo
					continue
				}
				j := job{seq: seq, off: off, n: skipTo - off, zeroOnly: true}
				seq++
				e.spawn(ctx, cancel, sem, &wg, j)
				off = skipTo
				continue
			}
		}
		n := min(chunk-off%chunk, size-off)
		j := job{off: off, n: n}
		// The source's runs in the chunk.
		for p := off; p < off+n; {
			x, err := sw.at(ctx, p)
			if err != nil {
				return fmt.Errorf("convert: block status of the source at %d: %w", p, err)
			}
			q := min(end(x), off+n)
			if !zeroKnown(x) {
				if k := len(j.src) - 1; k >= 0 && j.src[k].end == p {
					j.src[k].end = q
				} else {
					j.src = append(j.src, span{p, q, true})
				}
			}
			p = q
		}
		j.srcZero = len(j.src) == 0
		if bw != nil {
			for p := off; p < min(off+n, bsize); {
				x, err := bw.at(ctx, p)
				if err != nil {
					return fmt.Errorf("convert: block status of the backing file at %d: %w", p, err)
				}
				if !zeroKnown(x) {
					j.backing = true
					break
				}
				p = min(end(x), off+n)
			}
		}
		switch {
		case j.srcZero && bw == nil && e.o.TargetZero:
			e.finish(off, n) // the target reads zeroes there already
			off += n
			continue
		case j.srcZero && bw != nil && !j.backing:
			e.finish(off, n)
			off += n
			continue
		case j.srcZero && bw == nil:
			j.zeroOnly = true
		}
		j.seq = seq
		seq++
		e.spawn(ctx, cancel, sem, &wg, j)
		off += n
	}
	wg.Wait()
	return nil
}

// spawn runs j once one of the sem's slots is free.
func (e *engine) spawn(ctx context.Context, cancel func(), sem chan struct{}, wg *sync.WaitGroup, j job) {
	sem <- struct{}{}
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer func() { <-sem }()
		if err := e.do(ctx, j); err != nil {
			e.fail(err)
			cancel()
		}
	}()
}

// turn waits until it is job seq's turn to write (in-order writes), and
// returns the function that passes the turn on.
func (e *engine) turn(ctx context.Context, seq int64) (func(), error) {
	if e.o.OutOfOrder {
		return func() {}, nil
	}
	e.mu.Lock()
	for e.nextSeq != seq && e.err == nil && ctx.Err() == nil {
		e.cond.Wait()
	}
	err := e.err
	e.mu.Unlock()
	if err == nil {
		err = ctx.Err()
	}
	if err != nil {
		return nil, err
	}
	return func() {
		e.mu.Lock()
		e.nextSeq++
		e.cond.Broadcast()
		e.mu.Unlock()
	}, nil
}

// clearGap clears what plan and the writes will look at of the gap
// [a, b) between data runs of job j's buffer.
func (e *engine) clearGap(buf []byte, j job, a, b int64) {
	g := e.granule
	switch {
	case a >= b:
		return
	case j.backing:
		clear(buf[a-j.off : b-j.off])
		return
	case g == 0:
		return
	}
	// The granule a lies in, and the one b-1 lies in, may hold data.
	head := min(b, a+(g-a%g)%g)
	clear(buf[a-j.off : head-j.off])
	tail := max(head, b-b%g)
	clear(buf[tail-j.off : b-j.off])
}

// action is what a granule of a chunk needs.
type action uint8

const (
	skip action = iota
	writeZero
	writeData
)

func (e *engine) do(ctx context.Context, j job) error {
	// A cancelled context also wakes writers waiting for their turn.
	stopWake := context.AfterFunc(ctx, func() {
		e.mu.Lock()
		e.cond.Broadcast()
		e.mu.Unlock()
	})
	defer stopWake()
	if j.zeroOnly {
		next, err := e.turn(ctx, j.seq)
		if err != nil {
			return err
		}
		defer next()
		if err := e.dst.WriteZeroes(ctx, j.off, j.n, true); err != nil {
			return fmt.Errorf("convert: write zeroes at %d (+%d): %w", j.off, j.n, err)
		}
		e.finish(j.off, j.n)
		return nil
	}
	buf := e.getBuf()[:j.n]
	defer func() { e.bufs <- buf }()
	// The bytes between the source's data runs read as zeroes. Only
	// those that plan or a write looks at are cleared: all of them when
	// they are compared with the backing file, else the ends of a gap
	// that share a granule with data (a granule wholly in a gap is
	// judged without its bytes, and without granules only data runs
	// are written).
	gap := j.off
	for i := 0; i <= len(j.src); i++ {
		end := j.off + j.n
		if i < len(j.src) {
			end = j.src[i].start
		}
		e.clearGap(buf, j, gap, end)
		if i < len(j.src) {
			gap = j.src[i].end
		}
	}
	for _, s := range j.src {
		if _, err := e.src.ReadAt(ctx, buf[s.start-j.off:s.end-j.off], s.start); err != nil {
			return fmt.Errorf("convert: read the source at %d (+%d): %w", s.start, s.end-s.start, err)
		}
	}
	var bbuf []byte
	if j.backing {
		bbuf = e.getBuf()[:j.n]
		defer func() { e.bufs <- bbuf }()
		clear(bbuf)
		if err := e.readBacking(ctx, bbuf, j.off); err != nil {
			return err
		}
	}
	runs := e.plan(j, buf, bbuf)

	// Compress before taking the turn: compression runs in parallel.
	var comps []comp
	ct := e.o.Compressed
	if ct != nil {
		select {
		case e.csem <- struct{}{}:
		case <-ctx.Done():
			return ctx.Err()
		}
		var err error
		comps, err = e.compress(j, buf, runs)
		<-e.csem
		if err != nil {
			return err
		}
	}
	next, err := e.turn(ctx, j.seq)
	if err != nil {
		return err
	}
	defer next()
	ci := 0
	for _, r := range runs {
		switch r.act {
		case writeZero:
			if err := e.dst.WriteZeroes(ctx, r.start, r.end-r.start, e.o.Backing == nil); err != nil {
				return fmt.Errorf("convert: write zeroes at %d (+%d): %w", r.start, r.end-r.start, err)
			}
		case writeData:
			if ct == nil {
				if _, err := e.dst.WriteAt(ctx, buf[r.start-j.off:r.end-j.off], r.start); err != nil {
					return fmt.Errorf("convert: write at %d (+%d): %w", r.start, r.end-r.start, err)
				}
				continue
			}
			for p := r.start; p < r.end; {
				q := p + min(e.granule, r.end-p)
				if ci < len(comps) && comps[ci].off == p {
					if err := ct.WriteCompressed(ctx, comps[ci].data, p); err != nil {
						return fmt.Errorf("convert: write the compressed cluster at %d: %w", p, err)
					}
					ci++
					p = q
					continue
				}
				// Not smaller compressed: stored as it is, as QEMU does,
				// with the clusters after it that are not either, in one
				// write (one allocation).
				for q < r.end && (ci >= len(comps) || comps[ci].off != q) {
					q += min(e.granule, r.end-q)
				}
				if _, err := e.dst.WriteAt(ctx, buf[p-j.off:q-j.off], p); err != nil {
					return fmt.Errorf("convert: write at %d (+%d): %w", p, q-p, err)
				}
				p = q
			}
		}
	}
	e.finish(j.off, j.n)
	return nil
}

// comp is a cluster at off, compressed.
type comp struct {
	off  int64
	data []byte
}

// compress compresses the clusters of job j's runs to be written as data;
// those that do not shrink are left out (and written as they are).
func (e *engine) compress(j job, buf []byte, runs []run) ([]comp, error) {
	var comps []comp
	for _, r := range runs {
		if r.act != writeData {
			continue
		}
		for p := r.start; p < r.end; {
			q := p + min(e.granule, r.end-p) // no overflow near 2^63
			c, ok, err := e.o.Compressed.CompressCluster(buf[p-j.off : q-j.off])
			if err != nil {
				return nil, fmt.Errorf("convert: compress the cluster at %d: %w", p, err)
			}
			if ok {
				comps = append(comps, comp{p, c})
			}
			p = q
		}
	}
	return comps, nil
}

// readBacking fills p with the backing file's bytes at off: only its data
// runs are read, and past its end it reads as zeroes.
func (e *engine) readBacking(ctx context.Context, p []byte, off int64) error {
	b := e.o.Backing
	bsize := b.Size()
	limit := min(off+int64(len(p)), bsize)
	for pos := off; pos < limit; {
		x, err := b.Extent(ctx, pos, limit-pos)
		if err != nil {
			return fmt.Errorf("convert: block status of the backing file at %d: %w", pos, err)
		}
		if x.Start != pos || x.Length <= 0 {
			return fmt.Errorf("convert: block status of the backing file at %d: the image answered [%d, +%d)", pos, x.Start, x.Length)
		}
		q := min(end(x), limit)
		if !zeroKnown(x) {
			if _, err := b.ReadAt(ctx, p[pos-off:q-off], pos); err != nil {
				return fmt.Errorf("convert: read the backing file at %d: %w", pos, err)
			}
		}
		pos = q
	}
	return nil
}

// run is a run of a chunk with one action.
type run struct {
	start, end int64
	act        action
}

// plan decides, granule by granule, what the chunk needs written: nothing
// where the target already reads the same, zeroes where the source has a
// zero granule (or a hole), data elsewhere; neighbours with one action
// become one run.
func (e *engine) plan(j job, buf, bbuf []byte) []run {
	var runs []run
	add := func(a, b int64, act action) {
		if k := len(runs) - 1; k >= 0 && runs[k].end == a && runs[k].act == act && act != skip {
			runs[k].end = b
			return
		}
		runs = append(runs, run{a, b, act})
	}
	g := e.granule
	if g == 0 {
		// Without granules (-S 0, no backing, not compressed): the
		// source's own runs, data written, holes zeroed where needed.
		pos := j.off
		for _, s := range j.src {
			if s.start > pos && !e.o.TargetZero {
				add(pos, s.start, writeZero)
			}
			add(s.start, s.end, writeData)
			pos = s.end
		}
		if pos < j.off+j.n && !e.o.TargetZero {
			add(pos, j.off+j.n, writeZero)
		}
		return runs
	}
	si := 0
	for a := j.off; a < j.off+j.n; {
		b := a + min(g-a%g, j.off+j.n-a) // granules aligned to g from offset 0; no overflow
		// Does a data run of the source touch [a, b)?
		for si < len(j.src) && j.src[si].end <= a {
			si++
		}
		hasData := si < len(j.src) && j.src[si].start < b
		zero := !hasData
		if hasData && e.o.MinSparse > 0 {
			zero = isZero(buf[a-j.off : b-j.off])
		}
		var act action
		switch {
		case bbuf != nil:
			switch {
			case bytes.Equal(buf[a-j.off:b-j.off], bbuf[a-j.off:b-j.off]):
				act = skip
			case zero && isZero(buf[a-j.off:b-j.off]):
				act = writeZero
			default:
				act = writeData
			}
		case zero && e.o.TargetZero:
			act = skip
		case zero:
			act = writeZero
		default:
			act = writeData
		}
		add(a, b, act)
		a = b
	}
	return runs
}

func isZero(p []byte) bool { return firstNonZero(p) < 0 }
