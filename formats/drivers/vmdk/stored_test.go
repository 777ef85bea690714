package vmdk

import (
	"bytes"
	"compress/flate"
	"compress/zlib"
	"context"
	"encoding/binary"
	"errors"
	"hash/adler32"
	"io"
	"math/rand"
	"sync"
	"testing"
	"time"
)

// storedZlib is data as a zlib stream of stored blocks of the given sizes
// (which add up to len(data); 0 is an empty block).
func storedZlib(data []byte, sizes ...int) []byte {
	z := []byte{0x78, 0x9c}
	for i, n := range sizes {
		h := byte(0)
		if i == len(sizes)-1 {
			h = 1
		}
		z = append(z, h, byte(n), byte(n>>8), ^byte(n), ^byte(n>>8))
		z = append(z, data[:n]...)
		data = data[n:]
	}
	return binary.BigEndian.AppendUint32(z, adler32.Checksum(dataOf(z)))
}

// dataOf is the payload of the stored blocks in z (a storedZlib stream
// without its checksum).
func dataOf(z []byte) []byte {
	var d []byte
	for pos := 2; pos < len(z); {
		n := int(binary.LittleEndian.Uint16(z[pos+1:]))
		d = append(d, z[pos+5:pos+5+n]...)
		pos += 5 + n
	}
	return d
}

// mixedZlib is data as a stored block (its first half, flushed) and a
// Huffman-coded block (the rest).
func mixedZlib(data []byte) []byte {
	var f bytes.Buffer
	w, _ := flate.NewWriter(&f, flate.BestSpeed)
	w.Write(data[:len(data)/2])
	w.Flush()
	w.Write(data[len(data)/2:])
	w.Close()
	z := append([]byte{0x78, 0x01}, f.Bytes()...)
	return binary.BigEndian.AppendUint32(z, adler32.Checksum(data))
}

// Grains of stored blocks are read in place: every byte range, within a
// block and across blocks (an empty one among them), through ReadAt and
// TryReadAt, as the grain's data; grains that are not only stored blocks
// (a Huffman block after a stored one, more blocks than are kept) are
// inflated.
func TestVmdkStoredGrainsReadInPlace(t *testing.T) {
	const g = tGrain * 512
	c := craftWith(func(gi int, data []byte) []byte {
		switch gi {
		case 0:
			return storedZlib(data, 1000, 0, 2000, g-3000)
		case 1:
			for i := range data[g/2:] {
				data[g/2+i] = byte(i / 64) // compressible: a Huffman block
			}
			return mixedZlib(data)
		case 2:
			return storedZlib(data, 400, 400, 400, 400, 400, 400, 400, 400, 400, g-3600) // more than storedRunsMax
		}
		return storedZlib(data, g)
	})
	// craftWith hands enc the data it keeps, so grain 1's edit is in want.
	img, err := open(t, writeTemp(t, t.TempDir(), "x.vmdk", c.b), Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	ctx := context.Background()
	rng := rand.New(rand.NewSource(3))
	for i := range 3000 {
		off := rng.Int63n(3 * g)
		if i < 200 {
			off = []int64{0, 999, 1000, 2999, 3000, g - 1, g + g/2 - 1, 2*g + 399, 2*g + 3599}[i%9] - int64(i/9%5)
			off = max(off, 0)
		}
		n := 1 + rng.Int63n(min(3*g-off, 5000))
		b := make([]byte, n)
		if _, err := img.ReadAt(ctx, b, off); err != nil || !bytes.Equal(b, c.want[off:off+n]) {
			t.Fatalf("read %d bytes at %d: %v, data equal %v", n, off, err, bytes.Equal(b, c.want[off:off+n]))
		}
		clear(b)
		if img.TryReadAt(b, off) && !bytes.Equal(b, c.want[off:off+n]) {
			t.Fatalf("try read %d bytes at %d: wrong data", n, off)
		}
	}
	e := img.extents[0]
	if e.storedCache.Len() != 1 || e.grainCache.Len() != 2 {
		t.Fatalf("%d stored grains and %d inflated ones cached, want 1 and 2", e.storedCache.Len(), e.grainCache.Len())
	}
	if b := make([]byte, 4096); !img.TryReadAt(b, 0) || !bytes.Equal(b, c.want[:4096]) {
		t.Fatal("a cached stored grain is not read on the fast path")
	}
	// A read across blocks allocates nothing either (its scratch buffer
	// is pooled).
	b := make([]byte, 3000)
	if n := testing.AllocsPerRun(100, func() { img.ReadAt(ctx, b, 500) }); n != 0 {
		t.Errorf("ReadAt across stored blocks: %v allocations", n)
	}
	if n := testing.AllocsPerRun(100, func() { img.TryReadAt(b, 500) }); n != 0 {
		t.Errorf("TryReadAt across stored blocks: %v allocations", n)
	}
}

// A reader waiting for a grain another reader loads, whose request is
// given up, loads it itself rather than fail with the other's error.
func TestVmdkLoadGivenUpByItsReader(t *testing.T) {
	c := craft(true)
	img, err := open(t, writeTemp(t, t.TempDir(), "x.vmdk", c.b), Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	e := img.extents[0]
	gt, _ := e.gt(context.Background(), e.gd[0], false)
	key := e.key(gt[0])
	// A load in flight, as another reader's would be.
	call := &flightCall{done: make(chan struct{})}
	e.flight.calls = map[int64]*flightCall{key: call}
	got := make(chan error, 1)
	b := make([]byte, 512)
	go func() {
		_, err := img.ReadAt(context.Background(), b, 100)
		got <- err
	}()
	time.Sleep(20 * time.Millisecond) // the reader waits on the call (or, slower, finds none: the same outcome)
	e.flight.mu.Lock()
	delete(e.flight.calls, key)
	e.flight.mu.Unlock()
	call.err = context.Canceled
	close(call.done)
	if err := <-got; err != nil || !bytes.Equal(b, c.want[100:612]) {
		t.Fatalf("read after another reader's load was given up: %v", err)
	}
}

// Stored blocks that lie are read as inflate reads them: refused.
func TestVmdkStoredGrainLies(t *testing.T) {
	const g = tGrain * 512
	for _, tc := range []struct {
		name string
		mut  func(z []byte) []byte
	}{
		{"checksum", func(z []byte) []byte { z[len(z)-1] ^= 1; return z }},
		{"data under the checksum", func(z []byte) []byte { z[100] ^= 1; return z }},
		{"NLEN", func(z []byte) []byte { z[5] ^= 1; return z }},
		{"LEN past the stream", func(z []byte) []byte {
			binary.LittleEndian.PutUint16(z[3:], 9000)
			binary.LittleEndian.PutUint16(z[5:], ^uint16(9000))
			return z
		}},
		{"no final block", func(z []byte) []byte { z[2+5+2000] = 0; return z }},
		{"no checksum", func(z []byte) []byte { return z[:len(z)-4] }},
		{"past a grain", func(z []byte) []byte {
			return storedZlib(append(dataOf(z[:len(z)-4]), make([]byte, 100)...), 2000, g-2000+100)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := craftWith(func(gi int, data []byte) []byte {
				z := storedZlib(data, 2000, g-2000)
				if gi == 0 {
					z = tc.mut(z)
				}
				return z
			})
			img, err := open(t, writeTemp(t, t.TempDir(), "x.vmdk", c.b), Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer img.Close()
			b := make([]byte, 512)
			if _, err := img.ReadAt(context.Background(), b, 3000); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("read: %v, want ErrCorrupt", err)
			}
			if img.TryReadAt(b, 3000) {
				t.Fatal("fast path read a grain that lies")
			}
			if _, err := img.ReadAt(context.Background(), b, g+100); err != nil || !bytes.Equal(b, c.want[g+100:g+100+512]) {
				t.Fatalf("the next grain: %v", err)
			}
		})
	}
}

// A short stored grain (fewer bytes than a grain) reads what it holds,
// and reads past it are refused, as an inflated short grain's are.
func TestVmdkStoredGrainShort(t *testing.T) {
	c := craftWith(func(gi int, data []byte) []byte {
		if gi == 0 {
			return storedZlib(data[:3000], 1000, 2000)
		}
		return storedZlib(data, len(data))
	})
	img, err := open(t, writeTemp(t, t.TempDir(), "x.vmdk", c.b), Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	b := make([]byte, 1000)
	if _, err := img.ReadAt(context.Background(), b, 1500); err != nil || !bytes.Equal(b, c.want[1500:2500]) {
		t.Fatalf("read inside: %v", err)
	}
	if _, err := img.ReadAt(context.Background(), b, 2500); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("read past: %v, want ErrCorrupt", err)
	}
}

// Readers of one grain at a time load it once and all read its data
// (run with -race).
func TestVmdkConcurrentGrainReaders(t *testing.T) {
	for _, stored := range []bool{true, false} {
		c := craftWith(func(gi int, data []byte) []byte {
			if stored {
				return storedZlib(data, 1000, len(data)-1000)
			}
			return mixedZlib(data)
		})
		img, err := open(t, writeTemp(t, t.TempDir(), "x.vmdk", c.b), Options{})
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		errs := make(chan error, 16)
		for i := range 16 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				b := make([]byte, 256)
				off := int64(i * 256)
				if _, err := img.ReadAt(context.Background(), b, off); err != nil || !bytes.Equal(b, c.want[off:off+256]) {
					errs <- errors.Join(err, errors.New("wrong data"))
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		if len(img.extents[0].flight.calls) != 0 {
			t.Fatal("loads left in flight")
		}
		img.Close()
	}
}

// Whatever the bytes, parseStored either declines or describes exactly
// what inflate makes of them, checksum checked: random stored streams,
// with bytes of their headers, lengths and checksum changed at random.
func TestVmdkParseStoredAgreesWithInflate(t *testing.T) {
	rng := rand.New(rand.NewSource(6))
	const grain = 8192
	accepted := 0
	for i := range 20000 {
		data := make([]byte, 1+rng.Intn(grain))
		rng.Read(data)
		var sizes []int
		for left := len(data); left > 0; {
			n := min(left, rng.Intn(3000))
			sizes = append(sizes, n)
			left -= n
		}
		z := storedZlib(data, sizes...)
		for range rng.Intn(3) {
			switch rng.Intn(3) {
			case 0: // a header byte, the first block's header or the checksum
				if at := []int{0, 1, 2, 3, 4, 5, 6, len(z) - 1, len(z) - 4}[rng.Intn(9)]; at >= 0 && at < len(z) {
					z[at] ^= byte(1 << rng.Intn(8))
				}
			case 1:
				z = z[:rng.Intn(len(z)+1)]
			case 2:
				z = append(z, byte(rng.Intn(256)))
			}
		}
		g := parseStored(z, 1000, grain, 8)
		zr, err := zlib.NewReader(bytes.NewReader(z))
		var want []byte
		if err == nil {
			want, err = io.ReadAll(zr)
		}
		if g == nil {
			continue
		}
		accepted++
		if err != nil {
			t.Fatalf("case %d: parsed a stream inflate refuses (%v)", i, err)
		}
		got := make([]byte, g.n)
		if g.n > 0 {
			raw := append(make([]byte, 1000), z...)
			g.gather(got, raw, 0, 0)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("case %d: parsed bytes differ from inflate's", i)
		}
	}
	t.Logf("%d of 20000 parsed", accepted)
	if accepted < 5000 {
		t.Fatalf("only %d of 20000 streams parsed", accepted)
	}
}

// Options.DecodedCacheSize (--decompressed-cache-size) sizes the cache of
// inflated grains: a cache of two grains holds the last two of the four
// read, one of four holds them all, and a grain held inflated is read on
// the fast path without the file.
func TestVmdkDecodedCacheSize(t *testing.T) {
	const g = tGrain * 512
	c := craftWith(func(_ int, data []byte) []byte {
		for i := range data[g/2:] {
			data[g/2+i] = byte(i / 64) // a Huffman block: inflated, not read in place
		}
		return mixedZlib(data)
	})
	p := writeTemp(t, t.TempDir(), "x.vmdk", c.b)
	grains := []int64{0, 1, 2, 600}
	for _, tc := range []struct {
		size int64
		held []bool // after reading the grains in order, which TryReadAt serves
	}{
		{2 * g, []bool{false, false, true, true}},
		{4 * g, []bool{true, true, true, true}},
		{0, []bool{true, true, true, true}}, // the default: 32 MiB
	} {
		img, err := open(t, p, Options{DecodedCacheSize: tc.size})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { img.Close() })
		want := tc.size / g
		if tc.size == 0 {
			want = decodedCacheBytes / g
		}
		if got := int64(img.extents[0].grainCache.Cap()); got != want {
			t.Errorf("DecodedCacheSize %d: a cache of %d grains, want %d", tc.size, got, want)
		}
		b := make([]byte, 4096)
		for _, gi := range grains {
			off := gi*g + g - 4096
			if _, err := img.ReadAt(context.Background(), b, off); err != nil || !bytes.Equal(b, c.want[off:off+4096]) {
				t.Fatalf("grain %d: %v", gi, err)
			}
		}
		for i, gi := range grains {
			off := gi*g + g/2
			clear(b)
			ok := img.TryReadAt(b, off)
			if ok != tc.held[i] || ok && !bytes.Equal(b, c.want[off:off+4096]) {
				t.Errorf("DecodedCacheSize %d: grain %d served from the cache %v, want %v", tc.size, gi, ok, tc.held[i])
			}
		}
	}
}
