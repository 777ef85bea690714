package vhdx

import (
	"context"
	"testing"
)

// TestVhdxReadPathAllocationFree: a 4 KiB read of a cached image, by
// ReadAt and by the non-blocking TryReadAt, allocates nothing (the BAT
// is in memory; #26's per-request cost).
func TestVhdxReadPathAllocationFree(t *testing.T) {
	img, err := openBytes(t, goodSpec().bytes())
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	ctx := context.Background()
	for off := int64(0); off < img.Size(); off += img.Size() / 8 {
		img.ReadAt(ctx, buf, off)
		if n := testing.AllocsPerRun(100, func() { img.ReadAt(ctx, buf, off) }); n != 0 {
			t.Errorf("ReadAt at %d: %v allocations", off, n)
		}
		if n := testing.AllocsPerRun(100, func() { img.TryReadAt(buf, off) }); n != 0 {
			t.Errorf("TryReadAt at %d: %v allocations", off, n)
		}
	}
}
