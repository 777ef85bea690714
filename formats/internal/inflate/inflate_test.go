package inflate

import (
	"bytes"
	"compress/flate"
	"compress/zlib"
	"errors"
	"io"
	"math/rand"
	"testing"

	kflate "github.com/klauspost/compress/flate"
)

// stdInflate is the oracle: compress/flate on the same raw stream, reading
// at most limit+1 bytes. ok is false when it reports an error before the
// stream's end.
func stdInflate(in []byte, limit int) (out []byte, ok bool) {
	r := flate.NewReader(bytes.NewReader(in))
	defer r.Close()
	out, err := io.ReadAll(io.LimitReader(r, int64(limit)+1))
	return out, err == nil && len(out) <= limit
}

// samples are inputs of the shapes images hold: random bytes (literal
// codes of 8-9 bits), zeroes and short periods (long overlapping copies),
// text-like bytes whose rare symbols get the longest codes (subtables),
// and a mix.
func samples() map[string][]byte {
	rng := rand.New(rand.NewSource(1))
	random := make([]byte, 200_000)
	rng.Read(random)
	skewed := make([]byte, 200_000)
	for i := range skewed {
		// Geometric: symbol k with weight 2^-k, so codes run to 15 bits.
		k := 0
		for k < 40 && rng.Intn(2) == 0 {
			k++
		}
		skewed[i] = byte('a' + k)
	}
	period := bytes.Repeat([]byte("abc"), 70_000)
	mix := append(append(append([]byte{}, random[:70_000]...), make([]byte, 70_000)...), skewed[:70_000]...)
	return map[string][]byte{"random": random, "zeroes": make([]byte, 200_000), "skewed": skewed, "period3": period, "mix": mix}
}

func compress(tb testing.TB, p []byte, level int, klauspost bool) []byte {
	var b bytes.Buffer
	var w io.WriteCloser
	var err error
	if klauspost {
		w, err = kflate.NewWriter(&b, level)
	} else {
		w, err = flate.NewWriter(&b, level)
	}
	if err != nil {
		tb.Fatal(err)
	}
	w.Write(p)
	w.Close()
	return b.Bytes()
}

func zlibOf(tb testing.TB, p []byte, level int) []byte {
	var b bytes.Buffer
	w, err := zlib.NewWriterLevel(&b, level)
	if err != nil {
		tb.Fatal(err)
	}
	w.Write(p)
	w.Close()
	return b.Bytes()
}

// Every sample at every level and size, from both encoders, inflates to
// its bytes; a buffer one byte short is ErrTooLong; Fill gives every
// prefix.
func TestRoundTrips(t *testing.T) {
	for name, data := range samples() {
		for _, n := range []int{0, 1, 2, 258, 4096, 65536, len(data)} {
			p := data[:n]
			for _, level := range []int{flate.HuffmanOnly, flate.NoCompression, flate.BestSpeed, 6, flate.BestCompression} {
				for _, k := range []bool{false, true} {
					raw := compress(t, p, level, k)
					d := new(decoder)
					out := make([]byte, n+10)
					got, used, err := d.inflate(out, raw, false)
					if err != nil || !bytes.Equal(out[:got], p) {
						t.Fatalf("%s[:%d] level %d (klauspost %v): %d bytes, %v", name, n, level, k, got, err)
					}
					if used != len(raw) {
						t.Fatalf("%s[:%d] level %d: took %d bytes of a %d-byte stream", name, n, level, used, len(raw))
					}
					if n > 0 {
						if _, _, err := d.inflate(make([]byte, n-1), raw, false); !errors.Is(err, ErrTooLong) {
							t.Fatalf("%s[:%d] level %d: one byte short: %v, want ErrTooLong", name, n, level, err)
						}
						for _, m := range []int{1, n / 3, n - 1, n} {
							if m == 0 {
								continue
							}
							q := make([]byte, m)
							if err := Fill(q, raw); err != nil || !bytes.Equal(q, p[:m]) {
								t.Fatalf("%s[:%d] level %d: Fill %d: %v", name, n, level, m, err)
							}
						}
						if err := Fill(make([]byte, n+1), raw); !errors.Is(err, ErrCorrupt) {
							t.Fatalf("%s[:%d] level %d: Fill past the end: %v, want ErrCorrupt", name, n, level, err)
						}
					}
				}
			}
			z := zlibOf(t, p, 6)
			out := make([]byte, n)
			if got, err := Zlib(out, append(z, "trailing bytes"...)); err != nil || got != n || !bytes.Equal(out, p) {
				t.Fatalf("zlib %s[:%d]: %d, %v", name, n, got, err)
			}
		}
	}
}

// A cut stream, a flipped bit anywhere, a bad header or checksum: Zlib
// fails, or (a flipped bit that still decodes) returns what compress/flate
// returns, never other bytes.
func TestDamagedStreams(t *testing.T) {
	p := samples()["mix"][60_000:80_000]
	z := zlibOf(t, p, 6)
	out := make([]byte, len(p)+100)
	for cut := 0; cut < len(z); cut += max(1, len(z)/500) {
		if _, err := Zlib(out, z[:cut]); err == nil {
			t.Fatalf("a stream cut at %d of %d decoded", cut, len(z))
		}
	}
	rng := rand.New(rand.NewSource(2))
	for range 2000 {
		b := bytes.Clone(z)
		bit := rng.Intn(len(b) * 8)
		b[bit/8] ^= 1 << (bit % 8)
		n, err := Zlib(out, b)
		r, zerr := zlib.NewReader(bytes.NewReader(b))
		var want []byte
		if zerr == nil {
			want, zerr = io.ReadAll(io.LimitReader(r, int64(len(out))+1))
			if len(want) > len(out) {
				zerr = errors.New("too long")
			}
		}
		if (err == nil) != (zerr == nil) || err == nil && !bytes.Equal(out[:n], want) {
			t.Fatalf("bit %d flipped: ours %d bytes, %v; compress/zlib %d bytes, %v", bit, n, err, len(want), zerr)
		}
	}
	for name, b := range map[string][]byte{
		"window 64 KiB": append([]byte{0x88, 0x1c}, z[2:]...),
		"check bits":    append([]byte{0x78, 0x9d}, z[2:]...),
		"dictionary":    append([]byte{0x78, 0xbb}, z[2:]...),
		"method 7":      append([]byte{0x77, 0x85}, z[2:]...),
		"checksum":      append(bytes.Clone(z[:len(z)-1]), z[len(z)-1]^1),
		"no checksum":   z[:len(z)-4],
		"empty":         nil,
	} {
		if _, err := Zlib(out, b); err == nil {
			t.Errorf("%s: decoded", name)
		} else if name == "checksum" && !errors.Is(err, ErrChecksum) {
			t.Errorf("checksum: %v, want ErrChecksum", err)
		}
	}
}

// Streams written bit by bit at the rules' edges: each is what
// compress/flate makes of it.
func TestCraftedBlocks(t *testing.T) {
	for name, raw := range map[string][]byte{
		"block type 3":                {0x07},
		"stored LEN != ^NLEN":         {0x01, 0x05, 0x00, 0xfa, 0xfe, 1, 2, 3, 4, 5},
		"stored, cut":                 {0x01, 0x05, 0x00, 0xfa, 0xff, 1, 2},
		"stored, empty, final":        {0x01, 0x00, 0x00, 0xff, 0xff},
		"stored, then nothing":        {0x00, 0x00, 0x00, 0xff, 0xff},
		"fixed, end only":             {0x03, 0x00},
		"fixed, distance too far":     fixedBits(t, []sym{{lit: 'a'}, {length: 3, dist: 2}}),
		"fixed, distance 1 run":       fixedBits(t, []sym{{lit: 'a'}, {length: 258, dist: 1}, {length: 258, dist: 1}}),
		"fixed, distance 32768":       fixedBits(t, append(bytesSyms(32768), sym{length: 258, dist: 32768})),
		"fixed, length code 286":      fixedBits(t, []sym{{lit: 'a'}, {raw: 286}}),
		"fixed, distance code 30":     fixedBits(t, []sym{{lit: 'a'}, {length: 3, rawDist: 30}}),
		"dynamic, nlit 287":           {0x05 | 30<<3, 0, 0, 0, 0},
		"dynamic, all zero":           {0x05, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00},
		"dynamic, only lit, no dists": dynamicLitsOnly(),
	} {
		for _, limit := range []int{0, 1, 300, 40000} {
			want, ok := stdInflate(raw, limit)
			out := make([]byte, limit)
			n, _, err := new(decoder).inflate(out, raw, false)
			if (err == nil) != ok || ok && !bytes.Equal(out[:n], want) {
				t.Errorf("%s, %d bytes of room: ours %d bytes, %v; compress/flate %d bytes, ok %v", name, limit, n, err, len(want), ok)
			}
		}
	}
}

// sym is one symbol of a fixed-code block: a literal, a copy, or a raw
// literal/length or distance code a stream may not use.
type sym struct {
	lit          byte
	length, dist int
	raw, rawDist int
}

func bytesSyms(n int) []sym {
	s := make([]sym, n)
	for i := range s {
		s[i].lit = byte(i * 7)
	}
	return s
}

// bitWriter writes a deflate stream, least significant bit first.
type bitWriter struct {
	b     []byte
	acc   uint64
	nbits uint
}

func (w *bitWriter) bits(v uint64, n uint) {
	w.acc |= v << w.nbits
	w.nbits += n
	for w.nbits >= 8 {
		w.b = append(w.b, byte(w.acc))
		w.acc >>= 8
		w.nbits -= 8
	}
}

// code writes a Huffman code, most significant bit first.
func (w *bitWriter) code(c uint32, n uint) { w.bits(uint64(reverse(c, n)), n) }

func (w *bitWriter) bytes() []byte {
	if w.nbits > 0 {
		w.b = append(w.b, byte(w.acc))
	}
	return w.b
}

// fixedLitCode is the fixed code of literal/length symbol s.
func fixedLitCode(s int) (uint32, uint) {
	switch {
	case s < 144:
		return uint32(0x30 + s), 8
	case s < 256:
		return uint32(0x190 + s - 144), 9
	case s < 280:
		return uint32(s - 256), 7
	}
	return uint32(0xc0 + s - 280), 8
}

func fixedBits(t *testing.T, syms []sym) []byte {
	var w bitWriter
	w.bits(1, 1) // final
	w.bits(1, 2) // fixed
	for _, s := range syms {
		switch {
		case s.raw != 0:
			w.code(fixedLitCode(s.raw))
			continue
		case s.length == 0:
			w.code(fixedLitCode(int(s.lit)))
			continue
		}
		i := 28
		for int(lengthBase[i]) > s.length {
			i--
		}
		w.code(fixedLitCode(257 + i))
		w.bits(uint64(s.length-int(lengthBase[i])), uint(lengthExtra[i]))
		if s.rawDist != 0 {
			w.code(uint32(s.rawDist), 5)
			continue
		}
		j := 29
		for int(distBase[j]) > s.dist {
			j--
		}
		w.code(uint32(j), 5)
		w.bits(uint64(s.dist-int(distBase[j])), uint(distExtra[j]))
	}
	w.code(fixedLitCode(256))
	return w.bytes()
}

// dynamicLitsOnly is a dynamic block with a code for 'a' and end of
// block (a bit each) and no distance code: "aaa", then the end.
func dynamicLitsOnly() []byte {
	var w bitWriter
	w.bits(1, 1)
	w.bits(2, 2)
	w.bits(0, 5) // 257 literal/length codes
	w.bits(0, 5) // 1 distance code
	w.bits(14, 4)
	// Code-length code: 0 and 1 get a bit each (order 16 17 18 0 8 7 9
	// 6 10 5 11 4 12 3 13 2 14 1).
	for _, s := range preOrder[:18] {
		switch s {
		case 0, 1:
			w.bits(1, 3)
		default:
			w.bits(0, 3)
		}
	}
	// Lengths: 'a' (97) and 256 one bit, the rest and the one distance 0.
	for i := 0; i < 258; i++ {
		if i == 'a' || i == 256 {
			w.code(1, 1)
		} else {
			w.code(0, 1)
		}
	}
	w.code(0, 1)
	w.code(0, 1)
	w.code(0, 1)
	w.code(1, 1)
	return w.bytes()
}

// FuzzInflate: whatever the bytes, our decoder and compress/flate agree on
// whether they are a stream and on its bytes, in a buffer of any size;
// and Fill returns a prefix of them or an error.
func FuzzInflate(f *testing.F) {
	for name, data := range samples() {
		for _, level := range []int{flate.HuffmanOnly, flate.NoCompression, 1, 9} {
			f.Add(compress(f, data[:3000], level, name == "mix"), uint16(4000))
		}
	}
	f.Add(fixedBits(nil, []sym{{lit: 'a'}, {length: 258, dist: 1}}), uint16(259))
	f.Add(dynamicLitsOnly(), uint16(3))
	f.Fuzz(func(t *testing.T, raw []byte, limit uint16) {
		want, ok := stdInflate(raw, int(limit))
		out := make([]byte, limit)
		n, used, err := new(decoder).inflate(out, raw, false)
		if (err == nil) != ok || ok && !bytes.Equal(out[:n], want) {
			t.Fatalf("ours %d bytes, %v; compress/flate %d bytes, ok %v", n, err, len(want), ok)
		}
		if ok && used > len(raw) {
			t.Fatalf("took %d bytes of %d", used, len(raw))
		}
		if limit > 0 {
			q := make([]byte, limit/2+1)
			if err := Fill(q, raw); err == nil {
				full, _ := stdInflate(raw, 1<<16)
				if len(full) < len(q) && ok || !bytes.HasPrefix(full, q) && len(full) >= len(q) {
					t.Fatalf("Fill gave %d bytes that are not the stream's", len(q))
				}
			}
		}
	})
}

func BenchmarkRandomGrain(b *testing.B) {
	data := samples()["random"][:65536]
	raw := compress(b, data, flate.HuffmanOnly, false)
	out := make([]byte, 65536)
	b.SetBytes(65536)
	for b.Loop() {
		if err := Fill(out, raw); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkRandomGrainKlauspost(b *testing.B) {
	data := samples()["random"][:65536]
	raw := compress(b, data, flate.HuffmanOnly, false)
	out := make([]byte, 65536)
	b.SetBytes(65536)
	r := kflate.NewReader(bytes.NewReader(raw))
	for b.Loop() {
		r.(kflate.Resetter).Reset(bytes.NewReader(raw), nil)
		if _, err := io.ReadFull(r, out); err != nil {
			b.Fatal(err)
		}
	}
}
