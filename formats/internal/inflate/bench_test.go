package inflate

import (
	"bytes"
	czlib "compress/zlib"
	"io"
	"math/rand"
	"testing"

	kzlib "github.com/klauspost/compress/zlib"
)

// grains are 64 KiB grains as a streamOptimized vmdk of data that
// deflates a little holds them: zlib streams at the default level whose
// blocks are Huffman-coded (bytes below 200 at random: literal codes of
// 7-8 bits), the shape that random reads inflate once per read.
func grains(tb testing.TB) (gs [][]byte, want [][]byte) {
	rng := rand.New(rand.NewSource(2))
	for range 16 {
		p := make([]byte, 65536)
		for i := range p {
			p[i] = byte(rng.Intn(200))
		}
		gs = append(gs, zlibOf(tb, p, czlib.DefaultCompression))
		want = append(want, p)
	}
	return gs, want
}

// The three decoders on the same grains, for the ratio the package is
// for: go test -bench Grains ./formats/internal/inflate.
func BenchmarkGrainsOurs(b *testing.B) {
	gs, want := grains(b)
	out := make([]byte, 65536)
	b.SetBytes(65536)
	i := 0
	for b.Loop() {
		if n, err := Zlib(out, gs[i%len(gs)]); err != nil || n != len(want[i%len(gs)]) {
			b.Fatal(n, err)
		}
		i++
	}
}

func BenchmarkGrainsKlauspost(b *testing.B) {
	gs, _ := grains(b)
	benchReader(b, gs, func(r io.Reader) (io.ReadCloser, error) { return kzlib.NewReader(r) },
		func(zr io.ReadCloser, r io.Reader) error { return zr.(kzlib.Resetter).Reset(r, nil) })
}

func BenchmarkGrainsStdlib(b *testing.B) {
	gs, _ := grains(b)
	benchReader(b, gs, czlib.NewReader,
		func(zr io.ReadCloser, r io.Reader) error { return zr.(czlib.Resetter).Reset(r, nil) })
}

func benchReader(b *testing.B, gs [][]byte, open func(io.Reader) (io.ReadCloser, error), reset func(io.ReadCloser, io.Reader) error) {
	out := make([]byte, 65536)
	zr, err := open(bytes.NewReader(gs[0]))
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(65536)
	i := 0
	for b.Loop() {
		if err := reset(zr, bytes.NewReader(gs[i%len(gs)])); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(zr, out); err != nil {
			b.Fatal(err)
		}
		i++
	}
}
