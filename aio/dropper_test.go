package aio

import (
	"math"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// tracked is how many granules d tracks (read in part, or places reads
// stopped), and whether it tracks granule g as read in part.
func (d *dropper) tracked(g int64) (int, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	_, ok := d.read[g]
	return len(d.read) + len(d.ends), ok
}

// The dropper's arithmetic and bounds, its sweeps held off: reads at
// negative offsets, of no bytes or too many, and near 2^63 (where off+n
// overflows) track nothing; a read across granules marks each; a
// granule's blocks read whole leave the tracked ones, read in pieces
// that overlap; past dropMaxTracked the goroutine drops them all, and
// the maps start afresh; after close nothing is tracked, and a read is
// not (the descriptor may be another file's by then).
func TestDropperBounds(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "f"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	d := newDropper(int(f.Fd()), time.Hour)
	defer d.close()
	for _, c := range []struct {
		off int64
		n   int
	}{{-1, 4096}, {math.MinInt64, 1}, {0, 0}, {0, -5}, {math.MaxInt64, 1}, {math.MaxInt64 - 4095, 4096},
		{1<<62 + 1, 4096}, {0, math.MaxInt}, {0, 1<<31 + 1}} {
		d.done(c.off, c.n)
		if n, _ := d.tracked(0); n != 0 {
			t.Fatalf("a read of %d at %d tracked %d granules", c.n, c.off, n)
		}
	}
	d.done(dropGranule-1, 2)
	if _, ok := d.tracked(0); !ok {
		t.Fatal("granule 0 not tracked after a read across its end")
	}
	if _, ok := d.tracked(1); !ok {
		t.Fatal("granule 1 not tracked after a read across its start")
	}
	d.done(0, dropGranule/2+10)
	d.done(dropGranule/2, dropGranule/2-1) // overlaps; the last block was marked by the first read
	if _, ok := d.tracked(0); ok {
		t.Fatal("granule 0, read whole in overlapping pieces, still tracked as read in part")
	}
	// Exactly up to the bound: the read that reaches it is the last, so
	// none comes after the goroutine dropped them all (the sweep is an
	// hour away, so nothing else empties the maps before).
	n0, _ := d.tracked(0)
	for g := int64(2); int64(n0)+g-2 < dropMaxTracked; g++ {
		if n, _ := d.tracked(0); n != n0+int(g)-2 {
			t.Fatalf("%d granules tracked before the bound, want %d", n, n0+int(g)-2)
		}
		d.done(g*dropGranule, 1)
	}
	deadline := time.Now().Add(5 * time.Second)
	n, _ := d.tracked(0)
	for ; n != 0 && time.Now().Before(deadline); n, _ = d.tracked(0) {
		time.Sleep(10 * time.Millisecond)
	}
	if n != 0 {
		t.Fatalf("%d granules tracked 5 s after the bound of %d was passed", n, dropMaxTracked)
	}
	d.done(0, 1)
	d.close()
	d.done(0, 1)
	d.mu.Lock()
	left := len(d.read) + len(d.ends) + len(d.pending)
	d.mu.Unlock()
	if left != 0 {
		t.Fatalf("after close, %d granules tracked", left)
	}
	d.close()
	(*dropper)(nil).done(0, 1) // a file without drop-behind
	(*dropper)(nil).close()
}
