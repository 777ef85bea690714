package convert

import (
	"context"
	"math"
	"testing"
)

// flipped is a fake image whose byte at x differs from its twin's.
type flipped struct {
	*fakeImage
	x int64
}

func (f *flipped) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	n, err := f.fakeImage.ReadAt(ctx, p, off)
	if f.x >= off && f.x < off+int64(len(p)) {
		p[f.x-off] ^= 0xff
	}
	return n, err
}

// compare reads only what is data on either side, once, and finds the
// first difference anywhere in images of up to 2^63-1 bytes.
func TestCompareReadsDataOnce(t *testing.T) {
	const big = math.MaxInt64 &^ 511
	for _, c := range []struct {
		name string
		size int64
		data []span
		diff int64 // -1: none
	}{
		{"same", 20 << 20, []span{{4096, 9000, true}, {5 << 20, 7 << 20, true}}, -1},
		{"one byte", 20 << 20, []span{{4096, 9000, true}, {5 << 20, 7 << 20, true}}, 6<<20 + 777},
		{"near 2^63", big, []span{{big - 3<<20, big - 1<<20, true}, {big - 4096, big, true}}, big - 100},
		{"max int64", math.MaxInt64, []span{{math.MaxInt64 - 5000, math.MaxInt64, true}}, math.MaxInt64 - 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			a := &fakeImage{size: c.size, data: c.data}
			fb := &fakeImage{size: c.size, data: c.data}
			img := &flipped{fakeImage: fb, x: -1}
			if c.diff >= 0 {
				img.x = c.diff
			}
			r, err := Compare(context.Background(), a, img, CompareOptions{Parallel: 3, Chunk: 1 << 20})
			if err != nil {
				t.Fatal(err)
			}
			want, _ := covered(c.data)
			for _, reads := range [][]span{a.reads, fb.reads} {
				got, twice := covered(reads)
				if twice || (c.diff < 0 && !sameRuns(got, want)) {
					t.Fatalf("read %v, want the data %v once", reads, want)
				}
				for _, s := range got {
					inData := false
					for _, d := range want {
						inData = inData || s.start >= d.start && s.end <= d.end
					}
					if !inData {
						t.Fatalf("read %v outside the data %v", s, want)
					}
				}
			}
			if c.diff < 0 {
				if !r.Identical {
					t.Fatalf("got %+v, want identical", r)
				}
				return
			}
			// The sector of the difference, counted as qemu-img counts
			// it: from where the piece compared starts (a data run's
			// start need not be sector-aligned).
			if r.Identical || r.Offset > c.diff || c.diff-r.Offset >= 512 || r.Mismatch != MismatchContent {
				t.Fatalf("got %+v, want a content mismatch in the sector of %d", r, c.diff)
			}
		})
	}
}
