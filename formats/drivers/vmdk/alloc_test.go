package vmdk

import (
	"context"
	"testing"
)

// TestVmdkReadPathAllocationFree: once its grain table (and, stream-
// optimized, its decompressed grain) is cached, a 4 KiB read by ReadAt
// and by the non-blocking TryReadAt allocates nothing, and TryReadAt
// serves it (#26's per-request cost).
func TestVmdkReadPathAllocationFree(t *testing.T) {
	for _, compressed := range []bool{false, true} {
		c := craft(compressed)
		img, err := open(t, writeTemp(t, t.TempDir(), "x.vmdk", c.b), Options{})
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 4096)
		ctx := context.Background()
		for _, off := range []int64{0, 4096, tGrain * 512, 5 * tGrain * 512, 600 * tGrain * 512} {
			img.ReadAt(ctx, buf, off) // cache the grain table and grain
			if n := testing.AllocsPerRun(100, func() { img.ReadAt(ctx, buf, off) }); n != 0 {
				t.Errorf("compressed %v: ReadAt at %d: %v allocations", compressed, off, n)
			}
			if n := testing.AllocsPerRun(100, func() { img.TryReadAt(buf, off) }); n != 0 {
				t.Errorf("compressed %v: TryReadAt at %d: %v allocations", compressed, off, n)
			}
			if !img.TryReadAt(buf, off) {
				t.Errorf("compressed %v: TryReadAt at %d would wait with everything cached", compressed, off)
			}
		}
		img.Close()
	}
}
