package inflate

import (
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"testing"
)

// zlibRef is testdata/zlibref.json.gz: deflate and zlib streams (from
// compress/flate, then damaged: bits flipped, cut) with what the system
// zlib 1.2.13 (QEMU's) made of each, recorded once by python3's zlib
// module: a zlib case as uncompress into Out bytes (QEMU's vmdk grains),
// a raw case as one inflate(Z_FINISH) into Out bytes that must fill it
// (QEMU's qcow2 clusters; decompressobj(-15).decompress(data, Out)).
type zlibRef struct {
	Bases []string // hex
	Cases []struct {
		Base  int
		Flips []int // bit positions
		Cut   int   // -1: whole
		Zlib  bool  // Zlib, else Fill
		Out   int
		OK    bool
		Len   int
		SHA   string // of zlib's bytes, hex
	}
}

func loadZlibRef(t *testing.T) *zlibRef {
	f, err := os.Open("testdata/zlibref.json.gz")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	z, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	var r zlibRef
	if err := json.NewDecoder(z).Decode(&r); err != nil {
		t.Fatal(err)
	}
	if len(r.Cases) < 1000 {
		t.Fatalf("%d cases", len(r.Cases))
	}
	return &r
}

// TestAgainstZlib: on every recorded stream Zlib and Fill succeed exactly
// when zlib did, with the same bytes.
func TestAgainstZlib(t *testing.T) {
	r := loadZlibRef(t)
	bases := make([][]byte, len(r.Bases))
	for i, h := range r.Bases {
		bases[i], _ = hex.DecodeString(h)
	}
	bad := 0
	for i, c := range r.Cases {
		in := bytes.Clone(bases[c.Base])
		for _, b := range c.Flips {
			in[b/8] ^= 1 << (b % 8)
		}
		if c.Cut >= 0 {
			in = in[:c.Cut]
		}
		out := make([]byte, c.Out)
		var err error
		if c.Zlib {
			var n int
			n, err = Zlib(out, in)
			out = out[:n]
		} else {
			err = Fill(out, in)
		}
		sum := sha256.Sum256(out)
		if (err == nil) != c.OK || c.OK && (len(out) != c.Len || hex.EncodeToString(sum[:]) != c.SHA) {
			if bad++; bad <= 10 {
				kind := "Fill"
				if c.Zlib {
					kind = "Zlib"
				}
				t.Errorf("case %d: %s into %d bytes of %x: ours %v; zlib ok %v (%d bytes)", i, kind, c.Out, head(in), err, c.OK, c.Len)
			}
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d cases differ from zlib", bad, len(r.Cases))
	}
}

// TestFillStopsAsZlibDoes: Fill on streams whose output is full at the
// end of a block, then more stream: zlib's inflate(Z_FINISH) still reads
// on to the next literal or copy (QEMU's cluster read fails when that
// part is invalid), and needs no more than fits of a stored block.
// Verdicts from zlib 1.2.13 (python3: decompressobj(-15).decompress(s, 4)).
func TestFillStopsAsZlibDoes(t *testing.T) {
	// "abcd" in a fixed block that is not the last, then its end.
	var w bitWriter
	w.bits(0, 1)
	w.bits(1, 2)
	for _, c := range "abcd" {
		w.code(fixedLitCode(int(c)))
	}
	w.code(fixedLitCode(256))
	then := func(f func(w *bitWriter)) []byte {
		w2 := w
		w2.b = bytes.Clone(w.b)
		f(&w2)
		return w2.bytes()
	}
	fixed := func(w *bitWriter) { w.bits(1, 1); w.bits(1, 2) }
	for _, c := range []struct {
		name string
		in   []byte
		ok   bool
	}{
		{"then a block of type 3", then(func(w *bitWriter) { w.bits(1, 1); w.bits(3, 2) }), false},
		{"then a stored block, LEN != ^NLEN", then(func(w *bitWriter) { stored(w, 1, 5, 5) }), false},
		{"then a dynamic block with 287 lengths", then(func(w *bitWriter) { w.bits(1, 1); w.bits(2, 2); w.bits(30, 5); w.bits(0, 9) }), false},
		{"then fixed, length code 286", then(func(w *bitWriter) { fixed(w); w.code(fixedLitCode(286)) }), false},
		{"then fixed, distance code 30", then(func(w *bitWriter) { fixed(w); w.code(fixedLitCode(257)); w.code(30, 5) }), false},
		{"then fixed, a literal", then(func(w *bitWriter) { fixed(w); w.code(fixedLitCode('e')) }), true},
		{"then fixed, a copy from too far back", then(func(w *bitWriter) { fixed(w); w.code(fixedLitCode(257)); w.code(29, 5); w.bits(0, 13) }), true},
		{"then fixed, cut", then(func(w *bitWriter) { fixed(w) }), true},
		{"then nothing", then(func(w *bitWriter) {}), true},
		{"then a dynamic block whose code-length code is one code of one bit, cut", then(func(w *bitWriter) {
			dynamicHeader(w)
			w.bits(0, 3)
			w.bits(0, 3)
			w.bits(1, 3) // 18: one bit
			w.bits(0, 3)
		}), false},
		{"then a dynamic block with no code-length code, cut", then(func(w *bitWriter) {
			dynamicHeader(w)
			w.bits(0, 12) // no code-length code
			w.bits(0, 20) // 20 of the 258 one-bit lengths zlib reads
		}), true},
		{"then a dynamic block with no code-length code, whole", then(func(w *bitWriter) {
			dynamicHeader(w)
			w.bits(0, 12)
			w.bits(0, 60) // 300 zero bits: past the 258 lengths
			w.bits(0, 60)
			w.bits(0, 60)
			w.bits(0, 60)
			w.bits(0, 60)
		}), false},
		{"then fixed, a copy whose distance code is cut", then(func(w *bitWriter) { fixed(w); w.code(fixedLitCode(257)); w.bits(0, 2) }), true},
		{"then a stored block of 0, then type 3", then(func(w *bitWriter) { stored(w, 0, 0, 0xffff); w.bits(1, 1); w.bits(3, 2) }), false},
		{"then a final stored block of 0, then type 3", then(func(w *bitWriter) { stored(w, 1, 0, 0xffff); w.bits(1, 1); w.bits(3, 2) }), true},
		{"then a stored block of 5, 2 bytes of it there", then(func(w *bitWriter) { stored(w, 1, 5, 0xfffa); w.bits('x', 8); w.bits('y', 8) }), true},
	} {
		out := make([]byte, 4)
		err := Fill(out, c.in)
		if (err == nil) != c.ok || err == nil && string(out) != "abcd" {
			t.Errorf("%s (%x): %q, %v; zlib ok %v", c.name, c.in, out, err, c.ok)
		}
	}
	// A stored block longer than the input, whose first bytes fill out.
	out := make([]byte, 3)
	if err := Fill(out, []byte{0x00, 0x64, 0x00, 0x9b, 0xff, 'R', 'S', 'T', 'U'}); err != nil || string(out) != "RST" {
		t.Errorf("stored block of 100, 4 bytes there, 3 wanted: %q, %v; zlib gives RST", out, err)
	}
}

// stored writes a stored block's header: final, its type, the byte
// boundary, then its length and what stands for the length's complement.
func stored(w *bitWriter, final uint64, n, nlen uint64) {
	w.bits(final, 1)
	w.bits(0, 2)
	w.bits(0, (8-w.nbits%8)%8)
	w.bits(n, 16)
	w.bits(nlen, 16)
}

// dynamicHeader writes the start of a final dynamic block of 257
// literal/length codes, one distance code and four code-length code
// lengths (for 16, 17, 18 and 0), which the caller writes next.
func dynamicHeader(w *bitWriter) {
	w.bits(1, 1)
	w.bits(2, 2)
	w.bits(0, 5)
	w.bits(0, 5)
	w.bits(0, 4)
}

func head(b []byte) []byte {
	if len(b) > 32 {
		return b[:32]
	}
	return b
}
