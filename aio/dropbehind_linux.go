package aio

import (
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Drop-behind: a buffered read still goes through the page cache, read
// ahead as usual and finding what is cached, but the pages it brought in
// leave the cache once they have been read. A front end that caches what
// it serves (the FUSE export under the kernel cache) turns it on for the
// image's host files, so that the same bytes are not held twice, once for
// the export and once for the file, while the file keeps the disk's
// read-ahead that O_DIRECT (--cache none) gives up.
//
// The pages are dropped a granule at a time (FADV_DONTNEED), not per
// read: once every block of a granule has been read, or when no read has
// reached it for a sweep's interval. Per read, as RWF_DONTCACHE drops
// them, the file's read-ahead is lost: the page cache holds a file in
// folios of up to 2 MiB, such a read drops every folio it touched, whole,
// and the rest of a folio that a READ of the export reached only the
// start of is read from the disk again for the next READ. A loop-mounted
// ext4 read back cold (the bench's loop row) read 370-440 MiB from the
// disk for 273 MiB, against 270 for a loop on the image file, and took
// 0.78× of its speed (medians of five alternating runs); with granules,
// 0.9-1.0×. (It still reads about 375 MiB from the disk, though the
// daemon reads no dropped granule again; with nothing dropped, 270.)
// Unlike RWF_DONTCACHE, FADV_DONTNEED also drops pages that were cached
// before the read: the image is the export's (its lock says so).

// dropGranule is the unit dropped: a power of two no smaller than the
// largest folio of the page cache (PMD order on x86-64 and arm64 with 4
// KiB pages), so that, folios being aligned to their size, a granule
// holds whole folios, and dropping one never takes part of a folio a read
// is still working through.
const dropGranule = 2 << 20

// dropBlock is the unit a granule's reads are marked in.
const dropBlock = 4096

// dropIdle is how long a granule read only in part stays cached: it is
// dropped at the first sweep that finds it unread since the one before,
// after one to two intervals.
const dropIdle = 500 * time.Millisecond

// dropMaxTracked bounds the granules tracked between sweeps (random reads
// over a large image touch a new one each); past it, all are dropped at
// once.
const dropMaxTracked = 1 << 16

// dropper tracks what the reads of one file have covered since its
// granules were last dropped.
type dropper struct {
	mu     sync.Mutex
	fd     int
	read   map[int64]granuleReads // by granule index
	sweep  *time.Timer            // armed while read is not empty
	gen    uint32                 // sweeps so far
	closed bool
}

// granuleReads marks the blocks of a granule that reads have reached (a
// block read in part counts: its page was read).
type granuleReads struct {
	pages [dropGranule / dropBlock / 64]uint64
	gen   uint32 // the sweep generation of the last read
}

// mark sets the bits of blocks [from, to) and says whether all are set.
func (r *granuleReads) mark(from, to int64) bool {
	for p := from; p < to; p++ {
		r.pages[p/64] |= 1 << (p % 64)
	}
	for _, w := range r.pages {
		if w != ^uint64(0) {
			return false
		}
	}
	return true
}

func newDropper(fd int) *dropper {
	return &dropper{fd: fd, read: make(map[int64]granuleReads)}
}

// done records a read of n bytes at off that has completed, dropping the
// granules it completed. Nil-safe: a file without drop-behind has none.
// Reads no file has (past 2^62, or of more than 2 GiB: the export's are
// of 1 MiB at most) are not tracked.
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
	for g := off / dropGranule; g*dropGranule < end; g++ {
		base := g * dropGranule
		lo, hi := max(off, base), min(end, base+dropGranule)
		r := d.read[g]
		r.gen = d.gen
		if r.mark((lo-base)/dropBlock, (hi-base+dropBlock-1)/dropBlock) {
			delete(d.read, g)
			d.drop(g)
			continue
		}
		d.read[g] = r
	}
	switch {
	case len(d.read) >= dropMaxTracked:
		d.dropAll()
	case len(d.read) > 0 && d.sweep == nil:
		d.sweep = time.AfterFunc(dropIdle, d.sweepIdle)
	}
}

// sweepIdle drops the granules no read has reached since the last sweep,
// and comes back while some remain.
func (d *dropper) sweepIdle() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return
	}
	for g, r := range d.read {
		if r.gen != d.gen {
			delete(d.read, g)
			d.drop(g)
		}
	}
	d.gen++
	if len(d.read) > 0 {
		d.sweep.Reset(dropIdle)
	} else {
		d.sweep = nil
	}
}

// dropAll drops every tracked granule.
func (d *dropper) dropAll() {
	for g := range d.read {
		delete(d.read, g)
		d.drop(g)
	}
}

// drop asks the kernel to drop granule g's clean, unmapped pages (pages
// another process maps, or that a lend maps, stay). Under d.mu, so that
// close never frees the descriptor while a drop is using it.
func (d *dropper) drop(g int64) {
	unix.Fadvise(d.fd, g*dropGranule, dropGranule, unix.FADV_DONTNEED)
}

// close drops what is still tracked and stops the sweeps; it runs before
// the file's descriptor is closed.
func (d *dropper) close() {
	if d == nil {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return
	}
	d.dropAll()
	d.closed = true
	if d.sweep != nil {
		d.sweep.Stop()
	}
}

// dropBehinder is what files that can read drop-behind implement.
type dropBehinder interface {
	setDropBehind() bool
}

// SetDropBehind makes the pages that f's reads bring into the page cache
// leave it again (see dropGranule for when), where f is a buffered host
// file; it says whether it did. Set it before f serves reads.
func SetDropBehind(f File) bool {
	d, ok := f.(dropBehinder)
	return ok && d.setDropBehind()
}
