package convert

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sort"
	"sync"
	"testing"

	"github.com/blockexport/blockexport/formats"
)

// fakeImage is an image of any size whose data lies in a few runs; a
// data byte at x reads as pat(x). It records what was read and written.
type fakeImage struct {
	formats.NoFastPath
	size int64
	data []span // sorted, disjoint
	mu   sync.Mutex
	// reads and writes as [start, end) runs; zeroes separately.
	reads, writes, zeroes []span
	content               map[int64]byte // bytes written, for a target
}

func pat(x int64) byte { return byte(x*131 + x>>13 + 7) }

func (f *fakeImage) ReadAt(_ context.Context, p []byte, off int64) (int, error) {
	if off < 0 || off > f.size-int64(len(p)) {
		return 0, fmt.Errorf("read [%d, +%d) past %d: %w", off, len(p), f.size, formats.ErrOutOfRange)
	}
	f.mu.Lock()
	f.reads = append(f.reads, span{off, off + int64(len(p)), true})
	f.mu.Unlock()
	for i := range p {
		p[i] = f.at(off + int64(i))
	}
	return len(p), nil
}

func (f *fakeImage) at(x int64) byte {
	for _, s := range f.data {
		if x >= s.start && x < s.end {
			return pat(x)
		}
	}
	return 0
}

func (f *fakeImage) WriteAt(_ context.Context, p []byte, off int64) (int, error) {
	if off < 0 || off > f.size-int64(len(p)) {
		return 0, fmt.Errorf("write [%d, +%d) past %d: %w", off, len(p), f.size, formats.ErrOutOfRange)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.writes = append(f.writes, span{off, off + int64(len(p)), true})
	for i, b := range p {
		if f.content == nil {
			f.content = map[int64]byte{}
		}
		f.content[off+int64(i)] = b
	}
	return len(p), nil
}

func (f *fakeImage) WriteZeroes(_ context.Context, off, n int64, _ bool) error {
	if off < 0 || n < 0 || off > f.size-n {
		return fmt.Errorf("zero [%d, +%d) past %d: %w", off, n, f.size, formats.ErrOutOfRange)
	}
	f.mu.Lock()
	f.zeroes = append(f.zeroes, span{off, off + n, false})
	f.mu.Unlock()
	return nil
}

func (f *fakeImage) Discard(context.Context, int64, int64) error { return nil }
func (f *fakeImage) Flush(context.Context) error                 { return nil }
func (f *fakeImage) Size() int64                                 { return f.size }
func (f *fakeImage) Resize(context.Context, int64) error         { return formats.ErrNotSupported }
func (f *fakeImage) AllocatedSize(context.Context) (int64, error) {
	return -1, nil
}
func (f *fakeImage) Info() formats.Info { return formats.Info{Format: "fake"} }
func (f *fakeImage) Close() error       { return nil }

// Extent reports the data runs and the holes between them.
func (f *fakeImage) Extent(_ context.Context, off, n int64) (formats.Extent, error) {
	if off < 0 || off >= f.size || n <= 0 {
		return formats.Extent{}, fmt.Errorf("extent at %d: %w", off, formats.ErrOutOfRange)
	}
	n = min(n, f.size-off)
	next := f.size
	for _, s := range f.data {
		if off >= s.start && off < s.end {
			return formats.Extent{Start: off, Length: min(n, s.end-off), Data: true, Present: true}, nil
		}
		if s.start > off {
			next = min(next, s.start)
		}
	}
	return formats.Extent{Start: off, Length: min(n, next-off), Zero: true}, nil
}

// covered merges runs and reports whether any two overlap.
func covered(runs []span) (merged []span, overlap bool) {
	r := append([]span(nil), runs...)
	sort.Slice(r, func(i, j int) bool { return r[i].start < r[j].start })
	for _, s := range r {
		if k := len(merged) - 1; k >= 0 && s.start < merged[k].end {
			overlap = true
			merged[k].end = max(merged[k].end, s.end)
			continue
		} else if k >= 0 && s.start == merged[k].end {
			merged[k].end = s.end
			continue
		}
		merged = append(merged, s)
	}
	return merged, overlap
}

func sameRuns(a, b []span) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].start != b[i].start || a[i].end != b[i].end {
			return false
		}
	}
	return true
}

// checkConvert converts src into a fresh fake target with -S 0 and checks
// that exactly the data runs were read, once, and written, once.
func checkConvert(t *testing.T, size int64, data []span, o Options) {
	t.Helper()
	src := &fakeImage{size: size, data: data}
	dst := &fakeImage{size: size}
	o.TargetZero = true
	st, err := Convert(context.Background(), src, dst, o)
	if err != nil {
		t.Fatalf("convert of %d bytes, data %v: %v", size, data, err)
	}
	want, _ := covered(data)
	reads, twice := covered(src.reads)
	if twice {
		t.Fatalf("a byte was read twice: %v", src.reads)
	}
	if !sameRuns(reads, want) {
		t.Fatalf("read %v, want exactly the data %v", reads, want)
	}
	writes, twice := covered(dst.writes)
	if twice || !sameRuns(writes, want) || len(dst.zeroes) > 0 {
		t.Fatalf("wrote %v (zeroes %v), want exactly the data %v once", dst.writes, dst.zeroes, want)
	}
	for x, b := range dst.content {
		if b != pat(x) {
			t.Fatalf("byte %d written as %#x, want %#x", x, b, pat(x))
		}
	}
	if st.Done != size {
		t.Fatalf("done %d, want %d", st.Done, size)
	}
}

// Holes are never read nor written, data once, anywhere in an image as
// large as an int64 allows: chunk and granule arithmetic near 2^63 must
// not overflow.
func TestConvertReadsDataOnce(t *testing.T) {
	const big = math.MaxInt64 &^ 511
	cases := []struct {
		name string
		size int64
		data []span
	}{
		{"small", 10 << 20, []span{{4096, 8192, true}, {3 << 20, 5<<20 + 17, true}}},
		{"unaligned end", 5<<20 + 3, []span{{5 << 20, 5<<20 + 3, true}}},
		{"near 2^63", big, []span{{big - 3<<20, big - 1<<20, true}, {big - 4096, big, true}}},
		{"max int64", math.MaxInt64, []span{{math.MaxInt64 - 5000, math.MaxInt64, true}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			checkConvert(t, c.size, c.data, Options{})
			checkConvert(t, c.size, c.data, Options{OutOfOrder: true, Parallel: 3})
		})
	}
}

// -S finds zeroes inside data: a zero granule is not written to a zero
// target, and is written as zeroes to a target that is not.
func TestConvertSparseDetection(t *testing.T) {
	src := &fakeImage{size: 1 << 20, data: []span{{0, 1 << 20, true}}}
	// pat is never zero across 4 KiB, so make a zero run by a data hole
	// reported as data: a source whose data run reads zeroes in the middle.
	zsrc := &zeroMiddle{fakeImage: src, zs: 64 << 10, ze: 128 << 10}
	dst := &fakeImage{size: 1 << 20}
	if _, err := Convert(context.Background(), zsrc, dst, Options{MinSparse: 4096, TargetZero: true}); err != nil {
		t.Fatal(err)
	}
	w, _ := covered(dst.writes)
	want := []span{{0, 64 << 10, true}, {128 << 10, 1 << 20, true}}
	if !sameRuns(w, want) || len(dst.zeroes) > 0 {
		t.Fatalf("wrote %v zeroes %v, want %v and no zeroes", w, dst.zeroes, want)
	}
	dst = &fakeImage{size: 1 << 20}
	if _, err := Convert(context.Background(), zsrc, dst, Options{MinSparse: 4096}); err != nil {
		t.Fatal(err)
	}
	z, _ := covered(dst.zeroes)
	if !sameRuns(z, []span{{64 << 10, 128 << 10, false}}) {
		t.Fatalf("zeroed %v, want the zero run", z)
	}
}

type zeroMiddle struct {
	*fakeImage
	zs, ze int64
}

func (z *zeroMiddle) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	n, err := z.fakeImage.ReadAt(ctx, p, off)
	for i := range p {
		if x := off + int64(i); x >= z.zs && x < z.ze {
			p[i] = 0
		}
	}
	return n, err
}

// A target that fails stops the conversion with its error; nothing hangs
// waiting for its turn.
func TestConvertWriteErrorStops(t *testing.T) {
	src := &fakeImage{size: 64 << 20, data: []span{{0, 64 << 20, true}}}
	dst := &failing{fakeImage: &fakeImage{size: 64 << 20}, after: 3}
	_, err := Convert(context.Background(), src, dst, Options{Parallel: 4})
	if !errors.Is(err, errFull) {
		t.Fatalf("got %v, want the target's error", err)
	}
}

var errFull = errors.New("no space")

type failing struct {
	*fakeImage
	mu    sync.Mutex
	after int
}

func (f *failing) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	f.mu.Lock()
	f.after--
	n := f.after
	f.mu.Unlock()
	if n < 0 {
		return 0, errFull
	}
	return f.fakeImage.WriteAt(ctx, p[:0], off)
}

// FuzzConvertRanges converts sparse images of fuzzed sizes and data runs,
// up to 2^63-1 bytes, and checks the reads and writes.
func FuzzConvertRanges(f *testing.F) {
	f.Add(int64(math.MaxInt64), int64(math.MaxInt64-1<<21), uint16(4096), int64(1<<20), uint16(100))
	f.Add(int64(10<<20), int64(0), uint16(1), int64(1<<21), uint16(0))
	f.Add(int64(1<<62+5), int64(1<<62-1), uint16(65535), int64(3), uint16(7))
	f.Fuzz(func(t *testing.T, size, a int64, alen uint16, b int64, blen uint16) {
		if size <= 0 {
			return
		}
		var data []span
		for _, r := range [][2]int64{{a, int64(alen)}, {b, int64(blen)}} {
			if r[0] < 0 || r[0] >= size || r[1] == 0 {
				continue
			}
			e := r[0] + min(r[1], size-r[0])
			data = append(data, span{r[0], e, true})
		}
		if len(data) == 2 && data[1].start < data[0].end && data[0].start < data[1].end {
			return // overlapping runs: not one image
		}
		if len(data) == 2 && data[1].start < data[0].start {
			data[0], data[1] = data[1], data[0]
		}
		checkConvert(t, size, data, Options{Chunk: 1 << 16})
	})
}

// Buffers are reused: the gaps between a chunk's data runs that share a
// granule with data must read as zeroes, not as the chunk before.
func TestConvertGapsReadZero(t *testing.T) {
	for _, o := range []Options{{MinSparse: 4096, Parallel: 1}, {MinSparse: 512, Parallel: 1}, {MinSparse: 65536, Parallel: 1, OutOfOrder: true}} {
		src := &fakeImage{size: 6 << 20, data: []span{{0, 2 << 20, true}, {2<<20 + 100, 2<<20 + 5000, true},
			{2<<20 + 6000, 2<<20 + 9000, true}, {4<<20 - 700, 4<<20 + 300, true}}}
		dst := &fakeImage{size: src.size}
		o.TargetZero = true
		if _, err := Convert(context.Background(), src, dst, o); err != nil {
			t.Fatal(err)
		}
		for x, b := range dst.content {
			if b != src.at(x) {
				t.Fatalf("-S %d: byte %d written as %#x, want %#x", o.MinSparse, x, b, src.at(x))
			}
		}
		for _, d := range src.data {
			for x := d.start; x < d.end; x++ {
				if dst.content[x] != pat(x) {
					t.Fatalf("-S %d: data byte %d not written", o.MinSparse, x)
				}
			}
		}
	}
}
