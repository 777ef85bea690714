package inflate

import (
	"hash/adler32"
	"math/rand"
	"testing"
)

// Adler32Update is the standard library's Adler-32 at every length around
// its steps and blocks, at every alignment, and on bytes that make the
// sums largest.
func TestAdler32(t *testing.T) {
	rng := rand.New(rand.NewSource(4))
	b := make([]byte, 2*(64<<10)+100)
	for _, fill := range []string{"random", "0xff", "zero"} {
		for i := range b {
			switch fill {
			case "random":
				b[i] = byte(rng.Intn(256))
			case "0xff":
				b[i] = 0xff
			default:
				b[i] = 0
			}
		}
		for n := range len(b) {
			if n > 100 && n%997 != 0 && n%(64<<10) > 40 && n%(64<<10) < 64<<10-40 {
				continue
			}
			for _, at := range []int{0, 1, 7} {
				if at+n > len(b) {
					continue
				}
				p := b[at : at+n]
				if got, want := Adler32Update(1, p), adler32.Checksum(p); got != want {
					t.Fatalf("%s, %d bytes at %d: %#x, want %#x", fill, n, at, got, want)
				}
				if h := n / 3; Adler32Update(Adler32Update(1, p[:h]), p[h:]) != adler32.Checksum(p) {
					t.Fatalf("%s, %d bytes at %d in two parts: wrong checksum", fill, n, at)
				}
			}
		}
	}
}

func BenchmarkAdler32(b *testing.B) {
	p := make([]byte, 64<<10)
	rand.New(rand.NewSource(5)).Read(p)
	b.SetBytes(int64(len(p)))
	b.Run("ours", func(b *testing.B) {
		for b.Loop() {
			Adler32Update(1, p)
		}
	})
	b.Run("stdlib", func(b *testing.B) {
		for b.Loop() {
			adler32.Checksum(p)
		}
	})
}
