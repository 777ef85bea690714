package fuse

import (
	"sync"
	"testing"
)

func TestReadMarks(t *testing.T) {
	var m readMarks
	if _, _, marked := m.marked(0, 4096); marked {
		t.Fatal("a write with no READ before it was marked")
	}
	m.mark(100<<10, 8192) // granule 1
	if _, _, marked := m.marked(0, 64<<10); marked {
		t.Fatal("granule 0 marked by a READ of granule 1")
	}
	from, length, marked := m.marked(130<<10, 4096) // granule 2: not it either
	if marked {
		t.Fatal("granule 2 marked by a READ of granule 1")
	}
	if from != 128<<10 || length != 64<<10 {
		t.Fatalf("range [%d, +%d) for a write in granule 2", from, length)
	}
	from, length, marked = m.marked(60<<10, 8192) // granules 0 and 1
	if !marked || from != 0 || length != 128<<10 {
		t.Fatalf("write over granules 0-1 after a READ of 1: marked %v, [%d, +%d)", marked, from, length)
	}
	if _, _, marked := m.marked(64<<10, 1); !marked {
		t.Fatal("looking cleared the mark")
	}
	m.clear(64<<10+1, 64<<10) // covers granule 1 only in part
	if _, _, marked := m.marked(64<<10, 1); !marked {
		t.Fatal("a drop of part of a granule cleared its mark")
	}
	m.clear(0, 128<<10)
	if _, _, marked := m.marked(64<<10, 1); marked {
		t.Fatal("the mark outlived a drop of its whole granule")
	}
	// Across a chunk boundary, and near 2^63.
	m.mark(1<<chunkShift-4096, 8192)
	if _, _, marked := m.marked(1<<chunkShift, 1); !marked {
		t.Fatal("the second chunk's granule not marked")
	}
	if _, _, marked := m.marked(1<<chunkShift-1, 1); !marked {
		t.Fatal("the first chunk's granule not marked")
	}
	top := int64(1<<63 - 1)
	m.mark(top-10, 10)
	if _, _, marked := m.marked(top-1, 1); !marked {
		t.Fatal("the last granule not marked")
	}
	m.clear(top-(64<<10), 64<<10) // the last granule but one byte: not whole
	if _, _, marked := m.marked(top-1, 1); !marked {
		t.Fatal("the last granule cleared by a drop that does not cover it")
	}
	m.mark(top, 10) // past 2^63: nothing
	m.mark(-1, 10)
	if _, _, ok := granules(top-5, 10); ok {
		t.Fatal("a range past 2^63 accepted")
	}
}

// TestReadMarksBounded: a READ in more chunks than maxChunks makes every
// granule count as marked, and memory stops growing.
func TestReadMarksBounded(t *testing.T) {
	var m readMarks
	for i := int64(0); i <= maxChunks; i++ {
		m.mark(i<<chunkShift, 1)
	}
	if !m.all.Load() || m.n.Load() > maxChunks+1 {
		t.Fatalf("after %d chunks: all %v, chunks %d", maxChunks+1, m.all.Load(), m.n.Load())
	}
	for _, off := range []int64{5 << 40, 0} {
		m.clear(0, 1<<62)
		if _, _, marked := m.marked(off, 1); !marked {
			t.Fatalf("granule at %d not counted as marked once the marks are full", off)
		}
	}
}

// TestReadMarksConcurrent: a mark made before a look (in the order the
// image sees them: the READ before the write) is always seen by it, with
// other goroutines marking and clearing elsewhere in the same words.
func TestReadMarksConcurrent(t *testing.T) {
	var m readMarks
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 20000 {
				g := int64((i*4 + w) % 8192)
				m.mark(g<<granuleShift, 4096)
				if _, _, marked := m.marked(g<<granuleShift+100, 10); !marked {
					t.Errorf("worker %d: granule %d marked then looked at: not seen", w, g)
					return
				}
				m.clear(g<<granuleShift, 1<<granuleShift)
			}
		}()
	}
	wg.Wait()
}
