package qcow2

import (
	"math/rand/v2"
	"sync/atomic"
	"testing"
)

// TestDirtyBitmapExtentsFollowTheBits compares the word-at-a-time scan
// with the bits one by one, over random bitmaps with long and short runs,
// from every start and to many ends.
func TestDirtyBitmapExtentsFollowTheBits(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for round := range 50 {
		const g = 9 // 512-byte blocks
		size := int64(1+r.IntN(400)) << g
		if round%3 == 0 {
			size -= int64(r.IntN(511)) // a last block cut short
		}
		nbits := bitmapBits(size, g)
		l := &liveBitmap{granBits: g, nbits: nbits, words: make([]atomic.Uint64, (nbits+63)/64)}
		want := make([]bool, nbits)
		for b := uint64(0); b < nbits; {
			run := uint64(1 + r.IntN(150))
			dirty := r.IntN(2) == 0
			for ; run > 0 && b < nbits; run, b = run-1, b+1 {
				want[b] = dirty
				if dirty {
					l.words[b/64].Or(1 << (b % 64))
				}
			}
		}
		d := &DirtyBitmap{bits: l, size: size}
		for off := int64(0); off < size; off += 1 + int64(r.IntN(700)) {
			n := 1 + int64(r.IntN(int(size)))
			length, dirty := d.Extent(off, n)
			end := min(off+n, size)
			// The expected run: blocks like off's, from off to end.
			b := uint64(off) >> g
			stop := off
			for stop < end && want[uint64(stop)>>g] == want[b] {
				stop = min((int64(uint64(stop)>>g)+1)<<g, end)
			}
			if dirty != want[b] || length != stop-off {
				t.Fatalf("round %d, size %d: Extent(%d, %d) = %d, %v; want %d, %v", round, size, off, n, length, dirty, stop-off, want[b])
			}
		}
	}
}
