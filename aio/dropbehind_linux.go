package aio

import (
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Drop-behind (docs/design.md, Drop-behind): a buffered read still goes
// through the page cache and its read-ahead, but the pages it brought in
// leave once read, so that a front end that caches what it serves (FUSE
// under the kernel cache) does not hold the same bytes twice, and keeps
// the disk's read-ahead, which O_DIRECT gives up. Pages are
// dropped a granule at a time (FADV_DONTNEED; RWF_DONTCACHE would drop
// read-ahead a later READ uses): once every block of a granule was read, or
// when no read reached it for a sweep's interval, and the read-ahead past
// where reads stop (dropAhead). FADV_DONTNEED leaves mapped pages alone.

// dropGranule is the unit dropped: a power of two no smaller than the
// largest folio of the page cache (PMD order with 4 KiB pages), so that a
// granule holds whole folios and a drop never takes part of one a read is
// still working through.
const dropGranule = 2 << 20

// dropBlock is the unit a granule's reads are marked in.
const dropBlock = 4096

// dropIdle is how long a granule read only in part stays cached: it is
// dropped at the first sweep that finds it unread since the one before,
// after one to two intervals.
const dropIdle = 500 * time.Millisecond

// dropAhead is how far past a granule where reads stopped the file's own
// read-ahead may have brought pages in that no read reached: when no read
// comes after it for a sweep's interval, that much is dropped too. Twice
// the largest read-ahead window this project sets up (8 MiB, the disk's),
// as the kernel doubles a window for FADV_SEQUENTIAL.
const dropAhead = 16 << 20

// dropMaxTracked bounds the granules tracked between sweeps (random reads
// over a large image touch a new one each); past it, all are dropped at
// once.
const dropMaxTracked = 1 << 16

// dropper tracks what the reads of one file have covered since its
// granules were last dropped, and drops them from a goroutine of its own:
// FADV_DONTNEED also starts the writeback of dirty pages in its range, so
// a read (TryReadAt in the FUSE serve loop among them) only marks, and
// never waits for a drop.
type dropper struct {
	fd   int
	idle time.Duration // dropIdle, shorter in tests

	mu      sync.Mutex
	read    map[int64]granuleReads // by granule index
	ends    map[int64]uint32       // granules after which reads stopped, by the sweep that saw it
	pending []int64                // granules read whole, to drop
	gen     uint32                 // sweeps so far
	closed  bool

	kick chan struct{} // pending has granules (buffered, 1)
	quit chan struct{} // closed by close
	gone chan struct{} // closed when the goroutine has returned
}

// granuleReads marks the blocks of a granule that reads have reached (a
// block read in part counts: its page was read).
type granuleReads struct {
	blocks [dropGranule / dropBlock / 64]uint64
	gen    uint32 // the sweep generation of the last read
}

// mark sets the bits of blocks [from, to) and says whether all are set.
func (r *granuleReads) mark(from, to int64) bool {
	for b := from; b < to; b++ {
		r.blocks[b/64] |= 1 << (b % 64)
	}
	for _, w := range r.blocks {
		if w != ^uint64(0) {
			return false
		}
	}
	return true
}

func newDropper(fd int, idle time.Duration) *dropper {
	d := &dropper{fd: fd, idle: idle, read: make(map[int64]granuleReads), ends: make(map[int64]uint32),
		kick: make(chan struct{}, 1), quit: make(chan struct{}), gone: make(chan struct{})}
	go d.run()
	return d
}

// done records a read of n bytes at off that has completed; the granules
// it completed are dropped soon after. Nil-safe: a file without
// drop-behind has none. Reads no file has (past 2^62, or of more than 2
// GiB: the export's are of 1 MiB at most) are not tracked.
func (d *dropper) done(off int64, n int) {
	if d == nil || n <= 0 || n > 1<<31 || off < 0 || off > 1<<62 {
		return
	}
	end := off + int64(n)
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return
	}
	idle := len(d.read)+len(d.ends) == 0
	kick := false
	for g := off / dropGranule; g*dropGranule < end; g++ {
		base := g * dropGranule
		lo, hi := max(off, base), min(end, base+dropGranule)
		delete(d.ends, g) // reads go on here
		r := d.read[g]
		r.gen = d.gen
		if r.mark((lo-base)/dropBlock, (hi-base+dropBlock-1)/dropBlock) {
			delete(d.read, g)
			d.pending = append(d.pending, g)
			d.ends[g+1] = d.gen
			kick = true
			continue
		}
		d.read[g] = r
	}
	// The goroutine sweeps only while something is tracked, and sees the
	// bound.
	tracked := len(d.read) + len(d.ends)
	if kick || (idle && tracked > 0) || tracked >= dropMaxTracked {
		select {
		case d.kick <- struct{}{}:
		default:
		}
	}
}

// run drops what done hands it, and sweeps every d.idle while anything
// is tracked: the granules no read has reached since the sweep before,
// and past each place where reads stopped (a granule read whole or
// swept, and nothing read after it since), dropAhead more that no read
// has reached.
func (d *dropper) run() {
	defer close(d.gone)
	var timer *time.Timer
	var tick <-chan time.Time // nil while no sweep is due
	var work []dropRange
	for {
		sweep := false
		select {
		case <-d.quit:
			if timer != nil {
				timer.Stop()
			}
			return
		case <-d.kick:
		case <-tick:
			sweep, tick = true, nil
		}
		d.mu.Lock()
		work = d.take(work[:0], sweep, false)
		busy := len(d.read)+len(d.ends) > 0
		d.mu.Unlock()
		for _, r := range work {
			unix.Fadvise(d.fd, r.off, r.n, unix.FADV_DONTNEED)
		}
		if busy && tick == nil {
			if timer == nil {
				timer = time.NewTimer(d.idle)
			} else {
				timer.Reset(d.idle)
			}
			tick = timer.C
		}
	}
}

// dropRange is a byte range to drop.
type dropRange struct{ off, n int64 }

// take appends what is to be dropped now to work, and forgets it: the
// granules read whole, on a sweep the idle ones, and with all (or more
// tracked than dropMaxTracked) everything. Under d.mu.
func (d *dropper) take(work []dropRange, sweep, all bool) []dropRange {
	for _, g := range d.pending {
		work = append(work, dropRange{g * dropGranule, dropGranule})
	}
	d.pending = d.pending[:0]
	all = all || len(d.read)+len(d.ends) >= dropMaxTracked
	if !sweep && !all {
		return work
	}
	for g, r := range d.read {
		if all || r.gen != d.gen {
			delete(d.read, g)
			work = append(work, dropRange{g * dropGranule, dropGranule})
			d.ends[g+1] = d.gen
		}
	}
	for g, gen := range d.ends {
		if !all && gen == d.gen {
			continue // reads may come yet
		}
		delete(d.ends, g)
		// Up to dropAhead, short of granules reads are working through.
		from := g
		for g < from+dropAhead/dropGranule {
			if _, ok := d.read[g]; ok {
				break
			}
			g++
		}
		if g > from {
			work = append(work, dropRange{from * dropGranule, (g - from) * dropGranule})
		}
	}
	if all || len(d.read)+len(d.ends) == 0 {
		// Maps keep their buckets; a tracker of a burst of random reads
		// should not.
		d.read = make(map[int64]granuleReads)
		d.ends = make(map[int64]uint32)
	}
	d.gen++
	return work
}

// close stops the goroutine, then drops what is still tracked (and what
// may have been read ahead past it); it runs before the file's
// descriptor is closed, and no drop runs after it returns.
func (d *dropper) close() {
	if d == nil {
		return
	}
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return
	}
	d.closed = true
	d.mu.Unlock()
	close(d.quit)
	<-d.gone
	d.mu.Lock()
	work := d.take(nil, true, true)
	d.read, d.ends = nil, nil
	d.mu.Unlock()
	for _, r := range work {
		unix.Fadvise(d.fd, r.off, r.n, unix.FADV_DONTNEED)
	}
}

// SetDropBehind makes the pages that f's reads bring into the page cache
// leave it again (see dropGranule for when), where f is a buffered host
// file; it says whether it did. Set it before f serves reads.
func SetDropBehind(f File) bool { return setDropBehind(f, dropIdle) }

func setDropBehind(f File, idle time.Duration) bool {
	d, ok := f.(interface{ setDropBehind(time.Duration) bool })
	return ok && d.setDropBehind(idle)
}

// setDropBehind gives a buffered file its dropper, unless it has one;
// false for an O_DIRECT file, which leaves nothing in the page cache to
// drop.
func (h *hostFile) setDropBehind(idle time.Duration) bool {
	if h.direct {
		return false
	}
	if h.behind.Load() == nil {
		d := newDropper(h.fd, idle)
		if !h.behind.CompareAndSwap(nil, d) {
			d.close() // set meanwhile
		}
	}
	return true
}
