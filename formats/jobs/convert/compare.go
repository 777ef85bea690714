// Package convert copies and compares images the way qemu-img convert and
// qemu-img compare do, driven by block status: runs that every side knows
// to read as zeroes are never read, data is read in large pieces by
// several requests at once, and nothing is read twice.
package convert

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"sync"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
)

// CompareOptions say how to compare.
type CompareOptions struct {
	// Strict is qemu-img compare -s: sizes and block status must match too.
	Strict bool
	// Parallel is how many reads may be in flight (default 8).
	Parallel int
	// Chunk is the largest read (default 256 KiB: the buffers in flight
	// stay in the CPU's caches; docs/design.md, Convert's chunk sizes).
	Chunk int64
	// Progress, when set, is told how far the walk has come.
	Progress func(done, total int64)
}

// Mismatch kinds, in qemu-img compare's terms.
const (
	MismatchContent = "content"      // "Content mismatch at offset N!"
	MismatchSize    = "size"         // strict: "Strict mode: Image size mismatch!"
	MismatchStatus  = "block-status" // strict: "Strict mode: Offset N block status mismatch!"
)

// CompareResult is what a comparison found.
type CompareResult struct {
	Identical bool   `json:"identical"`
	Mismatch  string `json:"mismatch,omitempty"`
	// Offset is where the first difference lies: as qemu-img prints it,
	// the start of the first differing 512-byte sector.
	Offset       int64 `json:"offset"`
	SizeMismatch bool  `json:"size-mismatch"`
	SizeA        int64 `json:"size-a"`
	SizeB        int64 `json:"size-b"`
}

// Lines are what qemu-img compare prints on stdout for r.
func (r CompareResult) Lines() []string {
	switch r.Mismatch {
	case MismatchSize:
		return []string{"Strict mode: Image size mismatch!"}
	case MismatchStatus:
		return []string{fmt.Sprintf("Strict mode: Offset %d block status mismatch!", r.Offset)}
	}
	var l []string
	common := min(r.SizeA, r.SizeB)
	if r.SizeMismatch && (r.Identical || r.Offset >= common) {
		l = append(l, "Warning: Image size mismatch!")
	}
	if r.Identical {
		return append(l, "Images are identical.")
	}
	return append(l, fmt.Sprintf("Content mismatch at offset %d!", r.Offset))
}

// zeroKnown says the extent reads as zeroes without reading it: zeroes,
// or allocated by no layer of the chain.
func zeroKnown(e formats.Extent) bool { return e.Zero || !e.Present }

// status is the part of an extent qemu-img compare -s compares: QEMU's
// DATA, ZERO, ALLOCATED, OFFSET_VALID and EOF flags. EOF: the run reaches
// the end of the image, in whole sectors as QEMU sees it (a 1000-byte
// raw file's data ends before its EOF, a qcow2 cluster's at it).
type status struct{ data, zero, present, offset, eof bool }

func statusOf(e formats.Extent, size int64) status {
	return status{e.Data, e.Zero, e.Present, e.HasOffset, e.Length > 0 && end(e) >= sectorsUp(size)}
}

// sectorsUp is n rounded up to whole 512-byte sectors.
func sectorsUp(n int64) int64 {
	if n > math.MaxInt64-511 {
		return math.MaxInt64
	}
	return n + (512-n%512)%512
}

// extentWalker hands out an image's extents in order, cut where asked.
type extentWalker struct {
	img formats.Image
	cur formats.Extent
	ok  bool
}

// at returns the extent that covers off (off < Size), asking the image
// only when off has left the one it has.
func (w *extentWalker) at(ctx context.Context, off int64) (formats.Extent, error) {
	if w.ok && off >= w.cur.Start && off-w.cur.Start < w.cur.Length {
		return w.cur, nil
	}
	size := w.img.Size()
	e, err := w.img.Extent(ctx, off, size-off)
	if err != nil {
		return formats.Extent{}, err
	}
	if e.Start != off || e.Length <= 0 || e.Length > size-off {
		return formats.Extent{}, fmt.Errorf("block status at %d: the image answered [%d, +%d) (size %d)", off, e.Start, e.Length, size)
	}
	w.cur, w.ok = e, true
	return e, nil
}

// end is where extent e ends (e.Start+e.Length without overflow: both lie
// within an image size, an int64).
func end(e formats.Extent) int64 { return e.Start + e.Length }

// compareJob is one piece to read: from a (and b), or nil for a side
// known to read as zeroes.
type compareJob struct {
	off, n int64
	a, b   formats.Image
}

// Compare compares a and b as qemu-img compare does. The first difference
// is the lowest one: reads run in parallel, but a difference found past
// one still being looked for waits for it.
func Compare(ctx context.Context, a, b formats.Image, o CompareOptions) (CompareResult, error) {
	if o.Parallel <= 0 {
		o.Parallel = 8
	}
	if o.Chunk <= 0 {
		o.Chunk = 256 << 10
	}
	sa, sb := a.Size(), b.Size()
	// QEMU sees sizes in whole sectors: a 1000-byte raw file and a
	// 1024-byte image are the same size to qemu-img compare.
	r := CompareResult{Identical: true, SizeA: sa, SizeB: sb, SizeMismatch: sectorsUp(sa) != sectorsUp(sb)}
	if o.Strict && r.SizeMismatch {
		r.Identical, r.Mismatch = false, MismatchSize
		return r, nil
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	c := &comparer{cancel: cancel, chunk: o.Chunk, first: -1,
		bufs: make(chan []byte, 2*o.Parallel), sem: make(chan struct{}, o.Parallel)}
	for range 2 * o.Parallel {
		c.bufs <- nil // allocated on first use: small images stay small
	}
	statusAt, walkErr := c.walk(ctx, a, b, o)
	c.wg.Wait()
	switch {
	case c.firstErr != nil:
		return r, c.firstErr
	case walkErr != nil:
		return r, walkErr
	case statusAt >= 0 && c.first < 0:
		r.Identical, r.Mismatch, r.Offset = false, MismatchStatus, statusAt
		return r, nil
	case ctx.Err() != nil && c.first < 0:
		return r, ctx.Err()
	case c.first >= 0:
		r.Identical, r.Mismatch, r.Offset = false, MismatchContent, c.first
	}
	return r, nil
}

// comparer runs a comparison's reads, several at once, and keeps the
// lowest difference and the lowest error they find.
type comparer struct {
	cancel func()
	chunk  int64
	bufs   chan []byte
	sem    chan struct{}
	wg     sync.WaitGroup

	mu       sync.Mutex
	first    int64 // lowest content difference found, -1 for none
	firstErr error
	errOff   int64
}

// done says the walk need not go on at off: past a difference found
// nothing can come first, and after an error nothing matters.
func (c *comparer) done(off int64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.firstErr != nil || c.first >= 0 && c.first <= off
}

func (c *comparer) getBuf(n int64) []byte {
	p := <-c.bufs
	if int64(cap(p)) < c.chunk {
		p = aio.AlignedBuf(int(c.chunk), 4096) // for O_DIRECT hosts
	}
	return p[:n]
}

// run compares j once one of the reading slots is free.
func (c *comparer) run(ctx context.Context, j compareJob) {
	c.sem <- struct{}{}
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		defer func() { <-c.sem }()
		off, diff, err := compareChunk(ctx, j, c.getBuf, c.bufs)
		c.mu.Lock()
		defer c.mu.Unlock()
		if err != nil && (c.firstErr == nil || j.off < c.errOff) {
			c.firstErr, c.errOff = err, j.off
			c.cancel()
		}
		if diff && (c.first < 0 || off < c.first) {
			c.first = off
		}
	}()
}

// walk goes through both images' block status in step and starts the
// reads of what is not known to be zeroes on both sides. With o.Strict
// it returns where the block status first differs (after the reads
// before it are done), else -1.
func (c *comparer) walk(ctx context.Context, a, b formats.Image, o CompareOptions) (int64, error) {
	sa, sb := a.Size(), b.Size()
	total, common := max(sa, sb), min(sa, sb)
	wa, wb := &extentWalker{img: a}, &extentWalker{img: b}
	for off := int64(0); off < total && !c.done(off) && ctx.Err() == nil; {
		var ea, eb formats.Extent
		var err error
		next := total
		if off < sa {
			if ea, err = wa.at(ctx, off); err != nil {
				return -1, fmt.Errorf("block status of the first image at %d: %w", off, err)
			}
			next = min(next, end(ea))
		}
		if off < sb {
			if eb, err = wb.at(ctx, off); err != nil {
				return -1, fmt.Errorf("block status of the second image at %d: %w", off, err)
			}
			next = min(next, end(eb))
		}
		if off < common {
			next = min(next, common)
		}
		if o.Strict && statusOf(ea, sa) != statusOf(eb, sb) {
			// A content difference before it is reported first, as
			// qemu-img's in-order walk would: the caller waits for the
			// reads.
			return off, nil
		}
		j := compareJob{off: off}
		if off < sa && !zeroKnown(ea) {
			j.a = a
		}
		if off < sb && !zeroKnown(eb) {
			j.b = b
		}
		for p := off; p < next && (j.a != nil || j.b != nil) && !c.done(p); {
			n := min(c.chunk-p%c.chunk, next-p)
			jj := j
			jj.off, jj.n = p, n
			c.run(ctx, jj)
			p += n
		}
		off = next
		if o.Progress != nil {
			o.Progress(off, total)
		}
	}
	return -1, nil
}

// compareChunk reads one piece and returns the first differing sector's
// offset. A side that is nil reads as zeroes.
func compareChunk(ctx context.Context, j compareJob, getBuf func(int64) []byte, bufs chan<- []byte) (int64, bool, error) {
	var pa, pb []byte
	if j.a != nil {
		pa = getBuf(j.n)
		defer func() { bufs <- pa }()
	}
	if j.b != nil {
		pb = getBuf(j.n)
		defer func() { bufs <- pb }()
	}
	// Both sides at once: a piece costs one read's time, not two.
	errB := make(chan error, 1)
	if pb != nil {
		go func() {
			_, err := j.b.ReadAt(ctx, pb, j.off)
			errB <- err
		}()
	} else {
		errB <- nil
	}
	var errA error
	if pa != nil {
		_, errA = j.a.ReadAt(ctx, pa, j.off)
	}
	if err := <-errB; err != nil {
		return 0, false, fmt.Errorf("error while reading offset %d of the second image: %w", j.off, err)
	}
	if errA != nil {
		return 0, false, fmt.Errorf("error while reading offset %d of the first image: %w", j.off, errA)
	}
	var idx int64
	switch {
	case pa != nil && pb != nil:
		idx = firstDiff(pa, pb)
	case pa != nil:
		idx = firstNonZero(pa)
	default:
		idx = firstNonZero(pb)
	}
	if idx < 0 {
		return 0, false, nil
	}
	// qemu-img reports the start of the sector the difference lies in,
	// counted from the piece it compared (pieces start on sectors).
	return j.off + idx&^511, true, nil
}

// firstDiff returns the index of the first byte where a and b differ, or
// -1.
func firstDiff(a, b []byte) int64 {
	const step = 4096
	for i := 0; i < len(a); i += step {
		k := min(i+step, len(a))
		if bytes.Equal(a[i:k], b[i:k]) {
			continue
		}
		for x := i; x < k; x++ {
			if a[x] != b[x] {
				return int64(x)
			}
		}
	}
	return -1
}

// firstNonZero returns the index of the first byte of p that is not zero,
// or -1.
func firstNonZero(p []byte) int64 {
	const step = 4096
	var zero [step]byte
	for i := 0; i < len(p); i += step {
		k := min(i+step, len(p))
		if bytes.Equal(p[i:k], zero[:k-i]) {
			continue
		}
		for x := i; x < k; x++ {
			if p[x] != 0 {
				return int64(x)
			}
		}
	}
	return -1
}
