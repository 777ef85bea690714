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
	// Chunk is the largest read (default 256 KiB: the buffers of all the
	// reads in flight then stay in the CPU's caches between the read that
	// fills them and the comparison; with 4 MiB ones, each byte went to
	// memory and back, and a page-cached compare cost half again more CPU).
	Chunk int64
	// Progress, when set, is told how far the walk has come.
	Progress func(done, total int64)
}

// Mismatch kinds, in qemu-img compare's terms.
const (
	MismatchNone    = ""
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
	par := o.Parallel
	if par <= 0 {
		par = 8
	}
	chunk := o.Chunk
	if chunk <= 0 {
		chunk = 256 << 10
	}
	sa, sb := a.Size(), b.Size()
	// QEMU sees sizes in whole sectors: a 1000-byte raw file and a
	// 1024-byte image are the same size to qemu-img compare.
	sectors := func(n int64) int64 { return n/512 + min(n%512, 1) }
	r := CompareResult{Identical: true, SizeA: sa, SizeB: sb, SizeMismatch: sectors(sa) != sectors(sb)}
	if o.Strict && r.SizeMismatch {
		r.Identical, r.Mismatch = false, MismatchSize
		return r, nil
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	var (
		mu       sync.Mutex
		first    = int64(-1) // lowest content difference found
		firstErr error
		errOff   int64
	)
	found := func(off int64) {
		mu.Lock()
		if first < 0 || off < first {
			first = off
		}
		mu.Unlock()
	}
	// done says the walk need not go on at off: past a difference found
	// nothing can come first, and after an error nothing matters.
	done := func(off int64) bool {
		mu.Lock()
		defer mu.Unlock()
		return firstErr != nil || first >= 0 && first <= off
	}
	bufs := make(chan []byte, 2*par)
	for range 2 * par {
		bufs <- nil // allocated on first use: small images stay small
	}
	getBuf := func(n int64) []byte {
		p := <-bufs
		if int64(cap(p)) < chunk {
			p = aio.AlignedBuf(int(chunk), 4096) // for O_DIRECT hosts
		}
		return p[:n]
	}
	sem := make(chan struct{}, par)
	var wg sync.WaitGroup
	run := func(j compareJob) {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			off, diff, err := compareChunk(ctx, j, getBuf, bufs)
			mu.Lock()
			if err != nil && (firstErr == nil || j.off < errOff) {
				firstErr, errOff = err, j.off
				cancel()
			}
			mu.Unlock()
			if diff {
				found(off)
			}
		}()
	}

	total := max(sa, sb)
	common := min(sa, sb)
	wa, wb := &extentWalker{img: a}, &extentWalker{img: b}
	var walkErr error
	off := int64(0)
	for off < total {
		if done(off) {
			break
		}
		if ctx.Err() != nil {
			break
		}
		var ea, eb formats.Extent
		var err error
		next := total
		if off < sa {
			if ea, err = wa.at(ctx, off); err != nil {
				walkErr = fmt.Errorf("block status of the first image at %d: %w", off, err)
				break
			}
			next = min(next, end(ea))
		}
		if off < sb {
			if eb, err = wb.at(ctx, off); err != nil {
				walkErr = fmt.Errorf("block status of the second image at %d: %w", off, err)
				break
			}
			next = min(next, end(eb))
		}
		if off < common {
			next = min(next, common)
		}
		if o.Strict && statusOf(ea, sa) != statusOf(eb, sb) {
			// A content difference before it is reported first, as
			// qemu-img's in-order walk would: wait for the reads.
			wg.Wait()
			if first < 0 && firstErr == nil { // no reader is left to set them
				r.Identical, r.Mismatch, r.Offset = false, MismatchStatus, off
				return r, nil
			}
			break
		}
		j := compareJob{off: off}
		if off < sa && !zeroKnown(ea) {
			j.a = a
		}
		if off < sb && !zeroKnown(eb) {
			j.b = b
		}
		for p := off; p < next && (j.a != nil || j.b != nil); {
			n := min(chunk-p%chunk, next-p)
			jj := j
			jj.off, jj.n = p, n
			run(jj)
			p += n
			if done(p) {
				break
			}
		}
		off = next
		if o.Progress != nil {
			o.Progress(off, total)
		}
	}
	wg.Wait()
	if firstErr != nil {
		return r, firstErr
	}
	if walkErr != nil {
		return r, walkErr
	}
	if err := ctx.Err(); err != nil && first < 0 {
		return r, err
	}
	if first >= 0 {
		r.Identical, r.Mismatch, r.Offset = false, MismatchContent, first
	}
	return r, nil
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
