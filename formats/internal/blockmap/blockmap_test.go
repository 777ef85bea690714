package blockmap

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/raw"
)

const blk = 4096

// testMap is an image of 8 blocks over a host file of 4 blocks and a
// backing image of 5.5 blocks: block 0 and 1 are host blocks 2 and 3
// (contiguous), 2 a zero block, 3 a hole, 4 and 5 the backing image's
// (5 half past its end), 6 host block 0, 7 the format's own (0x77).
func testMap(t *testing.T) (*Map, []byte) {
	t.Helper()
	dir := t.TempDir()
	host := make([]byte, 4*blk)
	for i := range host {
		host[i] = byte(i/blk + 1)
	}
	back := bytes.Repeat([]byte{0xbb}, 5*blk+blk/2)
	hp, bp := filepath.Join(dir, "host"), filepath.Join(dir, "back")
	if err := os.WriteFile(hp, host, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bp, back, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := aio.Open(hp, aio.Options{Backend: aio.Threads})
	if err != nil {
		t.Fatal(err)
	}
	bf, err := aio.Open(bp, aio.Options{Backend: aio.Threads})
	if err != nil {
		t.Fatal(err)
	}
	b, err := raw.New(context.Background(), bf, raw.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close(); b.Close() })
	m := &Map{Format: "test", End: 8 * blk, Backing: b, File: f}
	m.Locate = func(_ context.Context, off, n int64, try bool) (Run, bool, error) {
		r := Run{N: min(n, blk-off%blk), File: f}
		switch i := off / blk; i {
		case 0, 1:
			r.Kind, r.Host = Data, (i+2)*blk+off%blk
		case 2:
			r.Kind = Zero
		case 3:
			r.Kind = Hole
		case 4, 5:
			r.Kind = Backing
		case 6:
			r.Kind, r.Host = Data, off%blk
		case 7:
			r.Kind = Own
			return r, !try, nil
		}
		return r, true, nil
	}
	m.ReadOwn = func(_ context.Context, r Run, p []byte, off int64) error {
		for i := range p {
			p[i] = 0x77
		}
		return nil
	}
	want := make([]byte, 8*blk)
	copy(want[0:], host[2*blk:4*blk])
	copy(want[4*blk:], back[4*blk:])
	copy(want[6*blk:], host[:blk])
	for i := 7 * blk; i < 8*blk; i++ {
		want[i] = 0x77
	}
	return m, want
}

// TestMapReadsEveryKindOfRun: ReadAt serves data, zeroes, holes, the
// backing image (zeroes past its end) and the format's own runs, across
// run boundaries; TryReadAt agrees where it can answer and says it would
// wait on an own run it cannot try; out of range is refused.
func TestMapReadsEveryKindOfRun(t *testing.T) {
	m, want := testMap(t)
	ctx := context.Background()
	for _, c := range []struct{ off, n int64 }{{0, 8 * blk}, {blk - 7, 3 * blk}, {4*blk + 100, 2*blk - 200}, {7 * blk, blk}} {
		p := make([]byte, c.n)
		for i := range p {
			p[i] = 0xee // stale bytes must not show through zeroes
		}
		if n, err := m.ReadAt(ctx, p, c.off); err != nil || n != len(p) || !bytes.Equal(p, want[c.off:c.off+c.n]) {
			t.Fatalf("ReadAt(%d, %d): %d, %v, bytes equal %v", c.off, c.n, n, err, bytes.Equal(p, want[c.off:c.off+c.n]))
		}
		q := make([]byte, c.n)
		// The test's file was just written, so its pages are cached: a try
		// serves every run but the own one, which it cannot.
		ok := m.TryReadAt(q, c.off)
		if ok != (c.off+c.n <= 7*blk) || ok && !bytes.Equal(q, want[c.off:c.off+c.n]) {
			t.Fatalf("TryReadAt(%d, %d): %v, bytes equal %v", c.off, c.n, ok, bytes.Equal(q, want[c.off:c.off+c.n]))
		}
	}
	if _, err := m.ReadAt(ctx, make([]byte, 2), 8*blk-1); !errors.Is(err, formats.ErrOutOfRange) {
		t.Fatalf("read past the end: %v", err)
	}
	if m.TryReadAt(make([]byte, 2), -1) {
		t.Fatal("a try at a negative offset succeeded")
	}
	if _, ok := m.TryLendAt(7*blk, blk, nil); ok {
		t.Fatal("an own run was lent")
	}
	if v, ok := m.TryLendAt(0, 4*blk, nil); !ok || !bytes.Equal(bytes.Join(v, nil), want[:4*blk]) {
		t.Fatalf("lend of the data, zero and hole runs: %v, bytes equal %v", ok, bytes.Equal(bytes.Join(v, nil), want[:4*blk]))
	}
}

// TestMapExtents: runs of one kind merge (data only where the host bytes
// follow on), each kind maps as qemu-img map shows it, and the backing
// image's runs come one layer deeper, zeroes from nowhere past its end.
func TestMapExtents(t *testing.T) {
	m, _ := testMap(t)
	ctx := context.Background()
	var got []formats.Extent
	for off := int64(0); off < m.End; {
		e, err := m.Extent(ctx, off, m.End-off)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, e)
		off += e.Length
	}
	want := []formats.Extent{
		{Start: 0, Length: 2 * blk, Data: true, Present: true, Offset: 2 * blk, HasOffset: true},
		{Start: 2 * blk, Length: blk, Zero: true, Present: true},
		{Start: 3 * blk, Length: blk, Zero: true},
		{Start: 4 * blk, Length: blk + blk/2, Data: true, Present: true, Depth: 1, Offset: 4 * blk, HasOffset: true},
		{Start: 5*blk + blk/2, Length: blk / 2, Zero: true, Depth: 1},
		{Start: 6 * blk, Length: blk, Data: true, Present: true, Offset: 0, HasOffset: true},
		{Start: 7 * blk, Length: blk, Data: true, Present: true},
	}
	if len(got) != len(want) {
		t.Fatalf("extents %+v, want %+v", got, want)
	}
	for i := range want {
		g := got[i]
		g.File = ""
		if g != want[i] {
			t.Errorf("extent %d: %+v, want %+v", i, g, want[i])
		}
	}
	if _, err := m.Extent(ctx, m.End, 1); !errors.Is(err, formats.ErrOutOfRange) {
		t.Fatalf("extent at the end: %v", err)
	}
}

// TestReadLooksUpEachRunOnce: a run looked up to see whether it merges
// with the data before it, and found not to, is read as it was found, not
// looked up again (for a vpc child that look-up reads a sector bitmap).
// Blocks 0 and 1 are data at hosts 2 and 3 (they merge), 2 zero, 3 hole,
// 4 and 5 backing, 6 data, 7 own: eight blocks, eight look-ups.
func TestReadLooksUpEachRunOnce(t *testing.T) {
	m, want := testMap(t)
	locate := m.Locate
	calls := 0
	m.Locate = func(ctx context.Context, off, n int64, try bool) (Run, bool, error) {
		calls++
		return locate(ctx, off, n, try)
	}
	p := make([]byte, 8*blk)
	if n, err := m.ReadAt(context.Background(), p, 0); err != nil || n != len(p) || !bytes.Equal(p, want) {
		t.Fatalf("ReadAt: %d, %v", n, err)
	}
	if calls != 8 {
		t.Fatalf("%d look-ups for 8 blocks", calls)
	}
}
