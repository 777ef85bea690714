package fuse

import (
	"sync"
	"sync/atomic"
)

// readMarks says where the kernel may hold pages of the export read from
// the image, so that a write the page cache did not see (an O_DIRECT
// open's) drops the kernel's pages only where there can be some.
//
// The page cache gets the image's bytes only through READs that fill pages
// (Export.cachesRead). Before an O_DIRECT WRITE the kernel writes back and
// drops its own pages of the range, but a READ answered before the write
// lands caches the old bytes, which FUSE_NOTIFY_INVAL_INODE must then drop.
// So every READ marks the granules it reaches before it reads the image,
// and a bypassing write, once landed, drops the pages of its whole
// granules only where one is marked (or a drop that cleared one is still
// under way: Export.invalidate). Such a READ marked before the write
// landed, so the write's notify drops its page, waiting for it if the
// READ is still being answered (the kernel locks the page meanwhile).
// Marks are cleared only as a drop of their whole granule is asked for.
//
// Memory: one bit per granule a READ reached, in chunks of 256 MiB of the
// export; past maxChunks chunks every granule counts as marked.
type readMarks struct {
	chunks sync.Map // chunk index (off >> chunkShift) -> *markChunk
	n      atomic.Int64
	all    atomic.Bool // too many chunks: every granule counts as marked
}

const (
	granuleShift = 16 // 64 KiB granules: what a notify drops around a write
	chunkShift   = 28 // 256 MiB per chunk: 4096 granules, 64 words
	maxChunks    = 1 << 16
)

type markChunk [1 << (chunkShift - granuleShift - 6)]atomic.Uint64

// chunkOf is the index of the chunk holding granule g.
func chunkOf(g int64) int64 { return g >> (chunkShift - granuleShift) }

// bitOf is the word of c and the bit in it that stand for granule g.
func (c *markChunk) bitOf(g int64) (*atomic.Uint64, uint64) {
	return &c[(g>>6)&(int64(len(c))-1)], uint64(1) << (g & 63)
}

// granules is the range of granules [g0, g1] that [off, off+n) reaches;
// ok false for an empty or negative range.
func granules(off, n int64) (g0, g1 int64, ok bool) {
	if off < 0 || n <= 0 || off > 1<<63-1-n {
		return 0, 0, false
	}
	return off >> granuleShift, (off + n - 1) >> granuleShift, true
}

// mark records that a READ of [off, off+n) may put the image's bytes in
// the kernel's cache. It must come before the READ reads the image.
func (m *readMarks) mark(off, n int64) {
	g0, g1, ok := granules(off, n)
	if !ok || m.all.Load() {
		return
	}
	var c *markChunk
	ci := int64(-1)
	for g := g0; g <= g1; g++ {
		if gi := chunkOf(g); gi != ci {
			if c, ci = m.chunk(gi, true), gi; c == nil {
				return // m.all is set
			}
		}
		if w, bit := c.bitOf(g); w.Load()&bit == 0 {
			w.Or(bit)
		}
	}
}

// marked reports whether a READ marked any granule [off, off+n) reaches:
// the caller, after the write has landed, then drops the pages of those
// whole granules, [from, from+length). It clears nothing: a mark stays
// until a drop asked for after its READ's page existed clears it.
func (m *readMarks) marked(off, n int64) (from, length int64, marked bool) {
	g0, g1, ok := granules(off, n)
	if !ok {
		return 0, 0, false
	}
	from, length = g0<<granuleShift, (g1-g0+1)<<granuleShift
	if m.all.Load() {
		return from, length, true
	}
	var c *markChunk
	ci := int64(-1)
	for g := g0; g <= g1; g++ {
		if gi := chunkOf(g); gi != ci {
			c, ci = m.chunk(gi, false), gi
		}
		if c == nil {
			continue
		}
		if w, bit := c.bitOf(g); w.Load()&bit != 0 {
			return from, length, true
		}
	}
	// A chunk made after the first look (m.all set meanwhile) counts too.
	return from, length, m.all.Load()
}

// clear clears the marks of the granules [off, off+n) covers whole: a
// drop of that range is about to start, and will drop every page a READ
// that marked them before now may have cached (the kernel makes a READ's
// page before it sends the READ, and a drop waits for a page whose READ
// is still being answered).
func (m *readMarks) clear(off, n int64) {
	if off < 0 || n <= 0 || off > 1<<63-1-n || m.all.Load() {
		return
	}
	g0, g1 := (off+1<<granuleShift-1)>>granuleShift, (off+n)>>granuleShift // [g0, g1)
	if g0 >= g1 {
		return
	}
	const perChunk = 1 << (chunkShift - granuleShift)
	clearChunk := func(ci int64, c *markChunk) {
		for g := max(g0, ci*perChunk); g < min(g1, (ci+1)*perChunk); {
			w, bit := c.bitOf(g)
			if g&63 == 0 && g+64 <= g1 {
				w.Store(0)
				g += 64
				continue
			}
			if w.Load()&bit != 0 {
				w.And(^bit)
			}
			g++
		}
	}
	if (g1-g0)/perChunk < 4 {
		for ci := chunkOf(g0); ci <= chunkOf(g1-1); ci++ {
			if c := m.chunk(ci, false); c != nil {
				clearChunk(ci, c)
			}
		}
		return
	}
	// A drop of a large range: only the chunks there are, not every
	// granule of it (a punch may reach 2^63).
	m.chunks.Range(func(k, v any) bool {
		clearChunk(k.(int64), v.(*markChunk))
		return true
	})
}

// chunk is chunk i, made if create and there is none; nil if there is
// none, or too many (m.all is then set).
func (m *readMarks) chunk(i int64, create bool) *markChunk {
	if c, ok := m.chunks.Load(i); ok {
		return c.(*markChunk)
	}
	if !create {
		return nil
	}
	if m.n.Add(1) > maxChunks {
		m.all.Store(true)
		return nil
	}
	c, loaded := m.chunks.LoadOrStore(i, new(markChunk))
	if loaded {
		m.n.Add(-1)
	}
	return c.(*markChunk)
}
