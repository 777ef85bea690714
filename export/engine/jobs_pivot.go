package engine

import (
	"context"
	"fmt"
	"slices"
	"sync"

	"github.com/blockexport/blockexport/coroutines"
	"github.com/blockexport/blockexport/formats"
)

// pivotImage is a format node's image as its exports hold it: the image
// under it can be replaced while they serve (a job's graph change: an
// active commit's pivot to the base, a chain opened again after a commit
// or stream), as QEMU's exports follow the node a BlockBackend points
// at. Every request runs inside its InFlight (one atomic add each way);
// a swap drains them and keeps new ones out meanwhile. While an active
// commit runs it also notes every range written (dirty), to copy again.
type pivotImage struct {
	inflight coroutines.InFlight
	img      formats.Image // read inside inflight, replaced under its drain
	dirty    *dirtyMap     // set and cleared under the drain
	// fronts are the front ends serving the image whose requests outlive
	// their calls here: a FUSE export writes the pages TryLendAt lent
	// after it returned. A swap quiesces them first, as QEMU drains its
	// exports before a graph change, so that no reply is still to carry
	// pages of the image it closes.
	frontsMu sync.Mutex
	fronts   []quiescer
}

// quiescer is a front end that can finish the requests it has begun and
// hold new ones back until release (fuse.Export.Quiesce).
type quiescer interface {
	Quiesce(ctx context.Context) (release func(), err error)
}

func newPivotImage(img formats.Image) *pivotImage { return &pivotImage{img: img} }

// addFront has a swap quiesce q first; the func returned undoes it.
func (p *pivotImage) addFront(q quiescer) (remove func()) {
	p.frontsMu.Lock()
	defer p.frontsMu.Unlock()
	p.fronts = append(p.fronts, q)
	return func() {
		p.frontsMu.Lock()
		defer p.frontsMu.Unlock()
		p.fronts = slices.DeleteFunc(p.fronts, func(f quiescer) bool { return f == q })
	}
}

// swap runs change with no request in flight and none let in, the front
// ends' included (their requests come here, so they are quiesced first):
// change may replace p.img and p.dirty, and close the image replaced.
func (p *pivotImage) swap(ctx context.Context, change func() error) error {
	p.frontsMu.Lock()
	defer p.frontsMu.Unlock()
	for _, f := range p.fronts {
		release, err := f.Quiesce(ctx)
		if err != nil {
			return fmt.Errorf("quiesce the node's exports: %w", err)
		}
		defer release()
	}
	release, err := p.inflight.Drain(ctx)
	if err != nil {
		return err
	}
	defer release()
	return change()
}

// wrote notes a write's range for an active commit (inside inflight).
func (p *pivotImage) wrote(off, n int64) {
	if p.dirty != nil {
		p.dirty.mark(off, n)
	}
}

func (p *pivotImage) ReadAt(ctx context.Context, b []byte, off int64) (int, error) {
	p.inflight.Begin()
	defer p.inflight.End()
	return p.img.ReadAt(ctx, b, off)
}

func (p *pivotImage) WriteAt(ctx context.Context, b []byte, off int64) (int, error) {
	p.inflight.Begin()
	defer p.inflight.End()
	n, err := p.img.WriteAt(ctx, b, off)
	p.wrote(off, int64(len(b))) // after it landed: a copy from here on sees it
	return n, err
}

func (p *pivotImage) WriteZeroes(ctx context.Context, off, n int64, mayUnmap bool) error {
	p.inflight.Begin()
	defer p.inflight.End()
	err := p.img.WriteZeroes(ctx, off, n, mayUnmap)
	p.wrote(off, n)
	return err
}

func (p *pivotImage) Discard(ctx context.Context, off, n int64) error {
	p.inflight.Begin()
	defer p.inflight.End()
	err := p.img.Discard(ctx, off, n)
	p.wrote(off, n)
	return err
}

func (p *pivotImage) Flush(ctx context.Context) error {
	p.inflight.Begin()
	defer p.inflight.End()
	return p.img.Flush(ctx)
}

func (p *pivotImage) Size() int64 {
	p.inflight.Begin()
	defer p.inflight.End()
	return p.img.Size()
}

func (p *pivotImage) Resize(ctx context.Context, size int64) error {
	p.inflight.Begin()
	defer p.inflight.End()
	return p.img.Resize(ctx, size)
}

func (p *pivotImage) Extent(ctx context.Context, off, n int64) (formats.Extent, error) {
	p.inflight.Begin()
	defer p.inflight.End()
	return p.img.Extent(ctx, off, n)
}

func (p *pivotImage) AllocatedSize(ctx context.Context) (int64, error) {
	p.inflight.Begin()
	defer p.inflight.End()
	return p.img.AllocatedSize(ctx)
}

// TryReadAt and TryWriteAt never wait, a drain included: they say "would
// wait" then, and the request comes again by ReadAt or WriteAt.
func (p *pivotImage) TryReadAt(b []byte, off int64) bool {
	if !p.inflight.TryBegin() {
		return false
	}
	defer p.inflight.End()
	return p.img.TryReadAt(b, off)
}

func (p *pivotImage) TryWriteAt(b []byte, off int64) (bool, error) {
	if !p.inflight.TryBegin() {
		return false, nil
	}
	defer p.inflight.End()
	done, err := p.img.TryWriteAt(b, off)
	if done {
		p.wrote(off, int64(len(b)))
	}
	return done, err
}

func (p *pivotImage) Features() formats.Features {
	p.inflight.Begin()
	defer p.inflight.End()
	return p.img.Features()
}

func (p *pivotImage) Info() formats.Info {
	p.inflight.Begin()
	defer p.inflight.End()
	return p.img.Info()
}

// Close closes the image under it; nothing serves it any more.
func (p *pivotImage) Close() error { return p.img.Close() }

// Wrapped is the image under it now, for formats.As.
func (p *pivotImage) Wrapped() formats.Image {
	p.inflight.Begin()
	defer p.inflight.End()
	return p.img
}

func (p *pivotImage) Backing() formats.Image {
	p.inflight.Begin()
	defer p.inflight.End()
	if l, ok := p.img.(formats.Layered); ok {
		return l.Backing()
	}
	return nil
}

func (p *pivotImage) CanLend() bool {
	p.inflight.Begin()
	defer p.inflight.End()
	l, ok := p.img.(formats.CacheLender)
	return ok && l.CanLend()
}

// LendAt holds its request in flight until the loan is released: a
// swap closes the image the loan is from only after.
func (p *pivotImage) LendAt(ctx context.Context, off, n int64, max int) ([][]byte, func(), bool, error) {
	p.inflight.Begin()
	l, ok := p.img.(formats.CacheLender)
	if !ok {
		p.inflight.End()
		return nil, nil, false, nil
	}
	bufs, release, ok, err := l.LendAt(ctx, off, n, max)
	if !ok || err != nil || release == nil {
		p.inflight.End()
		return bufs, release, ok, err
	}
	var once sync.Once
	return bufs, func() { release(); once.Do(p.inflight.End) }, ok, err
}

// TryLendAt lends pages of the files' mappings, valid until the image is
// closed. The loan outlives the call (the front end's writev carries the
// pages after), which only a front end added by addFront may rely on: a
// swap quiesces it before closing the image, and a page of a closed image
// would fail that writev (EFAULT: aio leaves closed mappings
// inaccessible, never unmapped).
func (p *pivotImage) TryLendAt(off, n int64, v [][]byte) ([][]byte, bool) {
	if !p.inflight.TryBegin() {
		return v, false
	}
	defer p.inflight.End()
	return formats.TryLend(p.img, off, n, v)
}

// GrowPreallocated passes a FUSE fallocate's grow on to a raw image,
// which allocates the new tail on the host (iotest 308); others grow
// plainly, as the export grows an image without it.
func (p *pivotImage) GrowPreallocated(ctx context.Context, size int64, full bool) error {
	p.inflight.Begin()
	defer p.inflight.End()
	if g, ok := p.img.(interface {
		GrowPreallocated(ctx context.Context, size int64, full bool) error
	}); ok {
		return g.GrowPreallocated(ctx, size, full)
	}
	return p.img.Resize(ctx, size)
}

func (p *pivotImage) SetNoFlush(on bool) {
	p.inflight.Begin()
	defer p.inflight.End()
	if f, ok := p.img.(formats.NoFlusher); ok {
		f.SetNoFlush(on)
	}
}

func (p *pivotImage) SetGrowAhead(n int64) {
	p.inflight.Begin()
	defer p.inflight.End()
	if g, ok := p.img.(formats.GrowAheader); ok {
		g.SetGrowAhead(n)
	}
}

// dirtyMap is an active commit's record of the ranges written since it
// began, in granules (QEMU's mirror granularity: the base's cluster, 64
// KiB by default): a bit each.
type dirtyMap struct {
	mu      sync.Mutex
	granule int64
	bits    []uint64
	count   int64 // bits set
	// added counts bits ever set, in bytes: the job's length grows by
	// what is written while it runs, as QEMU's mirror counts it.
	added int64
}

func newDirtyMap(size, granule int64) *dirtyMap {
	n := (size + granule - 1) / granule
	return &dirtyMap{granule: granule, bits: make([]uint64, (n+63)/64)}
}

func (d *dirtyMap) mark(off, n int64) {
	if n <= 0 || off < 0 {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for g := off / d.granule; g <= (off+n-1)/d.granule && g/64 < int64(len(d.bits)); g++ {
		if d.bits[g/64]&(1<<(g%64)) == 0 {
			d.bits[g/64] |= 1 << (g % 64)
			d.count++
			d.added += d.granule
		}
	}
}

// take clears and returns the dirty granules as runs [off, off+n).
func (d *dirtyMap) take() [][2]int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	var runs [][2]int64
	for i, w := range d.bits {
		for w != 0 {
			b := int64(0)
			for w&(1<<b) == 0 {
				b++
			}
			w &^= 1 << b
			off := (int64(i)*64 + b) * d.granule
			if k := len(runs) - 1; k >= 0 && runs[k][0]+runs[k][1] == off {
				runs[k][1] += d.granule
			} else {
				runs = append(runs, [2]int64{off, d.granule})
			}
		}
		d.bits[i] = 0
	}
	d.count = 0
	return runs
}

// grown is the bytes marked so far.
func (d *dirtyMap) grown() int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.added
}

// core is the node's image under its pivotImage (under mu: no swap
// meanwhile), for what asks it for a format's own methods.
func (n *node) core() formats.Image {
	if p, ok := n.img.(*pivotImage); ok {
		return p.img
	}
	return n.img
}

// goneImage stands in for a node's image that could not be opened again
// after a job's graph change: every request fails with why.
type goneImage struct{ err error }

func (g goneImage) ReadAt(context.Context, []byte, int64) (int, error)    { return 0, g.err }
func (g goneImage) WriteAt(context.Context, []byte, int64) (int, error)   { return 0, g.err }
func (g goneImage) WriteZeroes(context.Context, int64, int64, bool) error { return g.err }
func (g goneImage) Discard(context.Context, int64, int64) error           { return g.err }
func (g goneImage) Flush(context.Context) error                           { return g.err }
func (g goneImage) Size() int64                                           { return 0 }
func (g goneImage) Resize(context.Context, int64) error                   { return g.err }
func (g goneImage) Extent(context.Context, int64, int64) (formats.Extent, error) {
	return formats.Extent{}, g.err
}
func (g goneImage) AllocatedSize(context.Context) (int64, error) { return 0, g.err }
func (g goneImage) TryReadAt([]byte, int64) bool                 { return false }
func (g goneImage) TryWriteAt([]byte, int64) (bool, error)       { return false, nil }
func (g goneImage) Features() formats.Features                   { return formats.Features{} }
func (g goneImage) Info() formats.Info                           { return formats.Info{} }
func (g goneImage) Close() error                                 { return nil }
