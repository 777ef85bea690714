package vpc

import (
	"context"
	"testing"
)

// TestVpcReadPathAllocationFree: a 4 KiB read of a cached dynamic VHD,
// by ReadAt and by the non-blocking TryReadAt, allocates nothing (the
// BAT is in memory; #26's per-request cost).
func TestVpcReadPathAllocationFree(t *testing.T) {
	img, err := openVHD(t, goodVHD().build(t), Options{})
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	ctx := context.Background()
	for _, off := range []int64{0, testBS, 2 * testBS} {
		img.ReadAt(ctx, buf, off)
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
