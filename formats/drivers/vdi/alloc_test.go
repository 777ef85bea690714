package vdi

import (
	"context"
	"testing"
)

// TestVdiReadPathAllocationFree: a 4 KiB read of a cached image, by
// ReadAt and by the non-blocking TryReadAt, allocates nothing (the
// block map is in memory; #26's per-request cost).
func TestVdiReadPathAllocationFree(t *testing.T) {
	img, err := openPath(t, goodSpec().build(t))
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	ctx := context.Background()
	for _, off := range []int64{0, 1 << 20, 2<<20 + 4096} {
		img.ReadAt(ctx, buf, off) // warm the page cache
		if n := testing.AllocsPerRun(100, func() { img.ReadAt(ctx, buf, off) }); n != 0 {
			t.Errorf("ReadAt at %d: %v allocations", off, n)
		}
		if n := testing.AllocsPerRun(100, func() { img.TryReadAt(buf, off) }); n != 0 {
			t.Errorf("TryReadAt at %d: %v allocations", off, n)
		}
		if !img.TryReadAt(buf, off) {
			t.Errorf("TryReadAt at %d of a cached image would wait", off)
		}
	}
}
