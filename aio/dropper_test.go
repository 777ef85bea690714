package aio

import (
	"math"
	"os"
	"path/filepath"
	"testing"
)

// The dropper's arithmetic at the edges: reads at negative offsets, of
// no bytes, and near 2^63 (where off+n overflows) track nothing; a read
// across granules marks each; a granule's blocks read whole drop it,
// read twice or in pieces that overlap; past dropMaxTracked granules all
// are dropped at once; after close, nothing is tracked or dropped (the
// descriptor may be another file's by then).
func TestDropperBounds(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "f"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	d := newDropper(int(f.Fd()))
	for _, c := range []struct {
		off int64
		n   int
	}{{-1, 4096}, {math.MinInt64, 1}, {0, 0}, {0, -5}, {math.MaxInt64, 1}, {math.MaxInt64 - 4095, 4096}, {1<<62 + 1, 4096}, {0, math.MaxInt}, {0, 1<<31 + 1}} {
		d.done(c.off, c.n)
		if len(d.read) != 0 {
			t.Fatalf("a read of %d at %d tracked %d granules", c.n, c.off, len(d.read))
		}
	}
	d.done(dropGranule-1, 2)
	if len(d.read) != 2 {
		t.Fatalf("a read across a granule boundary tracked %d granules, want 2", len(d.read))
	}
	d.done(0, dropGranule/2+10)
	d.done(dropGranule/2, dropGranule/2-1) // overlaps; leaves the last byte's block marked by the first read
	if _, ok := d.read[0]; ok {
		t.Fatal("granule 0 read whole in overlapping pieces still tracked")
	}
	if _, ok := d.read[1]; !ok {
		t.Fatal("granule 1, read in part, no longer tracked")
	}
	for g := int64(2); len(d.read) > 0 && g < dropMaxTracked+10; g++ {
		d.done(g*dropGranule, 1)
		if len(d.read) >= dropMaxTracked {
			t.Fatalf("%d granules tracked, the bound is %d", len(d.read), dropMaxTracked)
		}
	}
	if len(d.read) != 0 {
		t.Fatalf("%d granules tracked after the bound was reached", len(d.read))
	}
	d.done(0, 1)
	d.close()
	if len(d.read) != 0 || d.sweep.Stop() {
		t.Fatalf("after close: %d granules tracked, or the sweep still armed", len(d.read))
	}
	d.done(0, 1)
	if len(d.read) != 0 {
		t.Fatal("a read after close was tracked")
	}
	d.close()
	(*dropper)(nil).done(0, 1) // a file without drop-behind
	(*dropper)(nil).close()
}
