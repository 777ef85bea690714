package partition

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/formats"
)

// memImage is a disk in memory.
type memImage struct {
	formats.NoFastPath
	b []byte
}

func (m *memImage) ReadAt(_ context.Context, p []byte, off int64) (int, error) {
	if off < 0 || off+int64(len(p)) > int64(len(m.b)) {
		return 0, formats.ErrOutOfRange
	}
	return copy(p, m.b[off:]), nil
}

func (m *memImage) WriteAt(_ context.Context, p []byte, off int64) (int, error) {
	if off < 0 || off+int64(len(p)) > int64(len(m.b)) {
		return 0, formats.ErrOutOfRange
	}
	return copy(m.b[off:], p), nil
}

func (m *memImage) WriteZeroes(_ context.Context, off, n int64, _ bool) error {
	if off < 0 || n < 0 || off+n > int64(len(m.b)) {
		return formats.ErrOutOfRange
	}
	clear(m.b[off : off+n])
	return nil
}
func (m *memImage) Discard(ctx context.Context, off, n int64) error {
	return m.WriteZeroes(ctx, off, n, true)
}
func (m *memImage) Flush(context.Context) error         { return nil }
func (m *memImage) Size() int64                         { return int64(len(m.b)) }
func (m *memImage) Resize(context.Context, int64) error { return formats.ErrNotSupported }
func (m *memImage) Extent(_ context.Context, off, n int64) (formats.Extent, error) {
	// Data in 4 KiB pieces, so that a range's extents are cut.
	l := min(n, 4096-off%4096)
	return formats.Extent{Start: off, Length: l, Data: true, Present: true}, nil
}
func (m *memImage) AllocatedSize(context.Context) (int64, error) { return int64(len(m.b)), nil }
func (m *memImage) Info() formats.Info {
	return formats.Info{Format: "raw", VirtualSize: int64(len(m.b))}
}
func (m *memImage) Close() error { return nil }

type ent struct {
	boot, typ   byte
	start, size uint32
}

func putEntries(sector []byte, es ...ent) {
	for i, e := range es {
		b := sector[446+16*i:]
		b[0], b[4] = e.boot, e.typ
		binary.LittleEndian.PutUint32(b[8:], e.start)
		binary.LittleEndian.PutUint32(b[12:], e.size)
	}
	sector[510], sector[511] = 0x55, 0xaa
}

const sectors = 8192 // a 4 MiB disk

// mbrDisk: p1 at 64+512, an extended p2 at 1024+4096 with three logical
// partitions, p4 at 6000+1000.
func mbrDisk() []byte {
	d := make([]byte, sectors*512)
	putEntries(d, ent{0x80, 0x83, 64, 512}, ent{0, 0x05, 1024, 4096}, ent{}, ent{0, 0x0c, 6000, 1000})
	// EBRs at 1024, 2048, 3072: data relative to the EBR, links to 1024.
	putEntries(d[1024*512:], ent{0, 0x83, 32, 800}, ent{0, 0x05, 1024, 1024})
	putEntries(d[2048*512:], ent{0, 0x82, 32, 500}, ent{0, 0x05, 2048, 2048})
	putEntries(d[3072*512:], ent{0, 0x0b, 100, 1000})
	return d
}

func parse(t *testing.T, d []byte) (*Table, error) {
	t.Helper()
	return Parse(context.Background(), &memImage{b: d})
}

func TestPartMBRNumbersAsTheKernel(t *testing.T) {
	tab, err := parse(t, mbrDisk())
	if err != nil {
		t.Fatal(err)
	}
	want := []Partition{
		{Number: 1, Start: 64 * 512, Size: 512 * 512, Type: "0x83"},
		{Number: 4, Start: 6000 * 512, Size: 1000 * 512, Type: "0x0c"},
		{Number: 5, Start: 1056 * 512, Size: 800 * 512, Type: "0x83", Logical: true},
		{Number: 6, Start: 2080 * 512, Size: 500 * 512, Type: "0x82", Logical: true},
		{Number: 7, Start: 3172 * 512, Size: 1000 * 512, Type: "0x0b", Logical: true},
	}
	if tab.Scheme != MBR || len(tab.Partitions) != len(want) {
		t.Fatalf("got %+v", tab)
	}
	for i, p := range tab.Partitions {
		if p != want[i] {
			t.Errorf("partition %d: got %+v, want %+v", i, p, want[i])
		}
	}
	if _, err := tab.Find(2); err == nil {
		t.Error("the extended container is served as a partition")
	}
}

// TestPartMBRHostile: each field at 0, at its maximum and one past where
// it still fits; overlaps, loops, chains leaving their container.
func TestPartMBRHostile(t *testing.T) {
	cases := []struct {
		name  string
		edit  func(d []byte)
		want  error // nil: parses
		count int
	}{
		{"start 0", func(d []byte) { putEntries(d, ent{0, 0x83, 0, 10}) }, ErrCorrupt, 0},
		{"size 0 is unused", func(d []byte) { putEntries(d, ent{0, 0x83, 10, 0}) }, nil, 0},
		{"type 0 with a size is a partition (the kernel's rule)", func(d []byte) { putEntries(d, ent{0, 0, 10, 10}) }, nil, 1},
		{"ends at the last sector", func(d []byte) { putEntries(d, ent{0, 0x83, 1, sectors - 1}) }, nil, 1},
		{"one sector past the end", func(d []byte) { putEntries(d, ent{0, 0x83, 1, sectors}) }, ErrCorrupt, 0},
		{"size max", func(d []byte) { putEntries(d, ent{0, 0x83, 1, 0xffffffff}) }, ErrCorrupt, 0},
		{"start max", func(d []byte) { putEntries(d, ent{0, 0x83, 0xffffffff, 1}) }, ErrCorrupt, 0},
		{"both max", func(d []byte) { putEntries(d, ent{0, 0x83, 0xffffffff, 0xffffffff}) }, ErrCorrupt, 0},
		{"boot flag 0x7f", func(d []byte) { putEntries(d, ent{0x7f, 0x83, 1, 10}) }, ErrNoTable, 0},
		{"boot flag 0xff", func(d []byte) { putEntries(d, ent{0xff, 0x83, 1, 10}) }, ErrNoTable, 0},
		{"no signature", func(d []byte) { d[511] = 0 }, ErrNoTable, 0},
		{"primaries overlap", func(d []byte) { putEntries(d, ent{0, 0x83, 10, 100}, ent{0, 0x83, 109, 10}) }, ErrCorrupt, 0},
		{"primaries touch", func(d []byte) { putEntries(d, ent{0, 0x83, 10, 100}, ent{0, 0x83, 110, 10}) }, nil, 2},
		{"primary inside the extended", func(d []byte) { putEntries(d, ent{0, 0x83, 64, 512}, ent{0, 0x05, 1024, 4096}, ent{0, 0x83, 2000, 10}) }, ErrCorrupt, 0},
		{"EBR loops to itself", func(d []byte) { putEntries(d[3072*512:], ent{0, 0x0b, 100, 1000}, ent{0, 0x05, 2048, 10}) }, ErrCorrupt, 0},
		{"EBR loops to the first", func(d []byte) { putEntries(d[3072*512:], ent{0, 0x0b, 100, 1000}, ent{0, 0x0f, 0, 10}) }, ErrCorrupt, 0},
		{"EBR link outside the extended", func(d []byte) { putEntries(d[3072*512:], ent{0, 0x0b, 100, 1000}, ent{0, 0x85, 5000, 10}) }, ErrCorrupt, 0},
		{"EBR link max", func(d []byte) {
			putEntries(d[3072*512:], ent{0, 0x0b, 100, 1000}, ent{0, 0x05, 0xffffffff, 0xffffffff})
		}, ErrCorrupt, 0},
		{"EBR without signature", func(d []byte) { d[2048*512+511] = 0 }, ErrCorrupt, 0},
		{"logical past the extended", func(d []byte) { putEntries(d[3072*512:], ent{0, 0x0b, 100, 2000}) }, ErrCorrupt, 0},
		{"logical size max", func(d []byte) { putEntries(d[3072*512:], ent{0, 0x0b, 100, 0xffffffff}) }, ErrCorrupt, 0},
		{"logical on its EBR", func(d []byte) { putEntries(d[3072*512:], ent{0, 0x0b, 0, 10}) }, ErrCorrupt, 0},
		{"logicals overlap", func(d []byte) { putEntries(d[2048*512:], ent{0, 0x82, 32, 1500}, ent{0, 0x05, 2048, 2048}) }, ErrCorrupt, 0},
		{"extended past the end", func(d []byte) { putEntries(d, ent{0, 0x05, 1024, sectors}) }, ErrCorrupt, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := mbrDisk()
			if !strings.Contains(c.name, "EBR") && !strings.Contains(c.name, "logical") {
				d = make([]byte, sectors*512)
				putEntries(d)
			}
			c.edit(d)
			tab, err := parse(t, d)
			if c.want == nil {
				if err != nil || len(tab.Partitions) != c.count {
					t.Fatalf("got %+v, %v; want %d partitions", tab, err, c.count)
				}
				return
			}
			if !errors.Is(err, c.want) {
				t.Fatalf("got %+v, %v; want %v", tab, err, c.want)
			}
			if strings.Contains(err.Error(), "\n") {
				t.Errorf("not one line: %q", err)
			}
		})
	}
}

func TestPartEBRChainLongerThanTheKernelReads(t *testing.T) {
	d := make([]byte, sectors*512)
	putEntries(d, ent{0, 0x05, 8, sectors - 8})
	for i := uint32(0); i < maxEBRs+1; i++ {
		ebr := 8 + i*4
		putEntries(d[ebr*512:], ent{0, 0x83, 1, 2}, ent{0, 0x05, (i + 1) * 4, 4})
	}
	if _, err := parse(t, d); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("a chain of %d links: %v", maxEBRs+1, err)
	}
}

// gpt builds a GPT disk of n sectors of ss bytes with the given entries
// (first, last LBA) in a 128-entry array, primary and backup.
type gptSpec struct {
	ss, sectors  int64
	parts        [][2]uint64
	numEntries   uint32
	entrySize    uint32
	headerSize   uint32
	entriesLBA   uint64 // 0: 2
	first, lastU uint64 // usable; 0: the usual
}

func (g gptSpec) build() []byte {
	if g.numEntries == 0 {
		g.numEntries = 128
	}
	if g.entrySize == 0 {
		g.entrySize = 128
	}
	if g.headerSize == 0 {
		g.headerSize = 92
	}
	arrSectors := (int64(g.numEntries)*128 + g.ss - 1) / g.ss
	if g.first == 0 {
		g.first = uint64(2 + arrSectors)
	}
	if g.lastU == 0 {
		g.lastU = uint64(g.sectors - 2 - arrSectors)
	}
	d := make([]byte, g.ss*g.sectors)
	putEntries(d, ent{0, 0xee, 1, uint32(min(g.sectors-1, 0xffffffff))})
	arr := make([]byte, int64(g.numEntries)*128)
	le := binary.LittleEndian
	for i, p := range g.parts {
		if p == [2]uint64{} {
			continue // an unused entry
		}
		e := arr[i*128:]
		copy(e, []byte{0xaf, 0x3d, 0xc6, 0x0f, 0x83, 0x84, 0x72, 0x47, 0x8e, 0x79, 0x3d, 0x69, 0xd8, 0x47, 0x7d, 0xe4})
		e[16] = byte(i + 1)
		le.PutUint64(e[32:], p[0])
		le.PutUint64(e[40:], p[1])
		copy(e[56:], []byte{'p', 0, byte('0' + i), 0})
	}
	arrCRC := crc32.ChecksumIEEE(arr)
	last := uint64(g.sectors - 1)
	put := func(my, alt, entries uint64) {
		h := d[int64(my)*g.ss:]
		copy(h, "EFI PART")
		le.PutUint32(h[8:], 0x10000)
		le.PutUint32(h[12:], g.headerSize)
		le.PutUint64(h[24:], my)
		le.PutUint64(h[32:], alt)
		le.PutUint64(h[40:], g.first)
		le.PutUint64(h[48:], g.lastU)
		le.PutUint64(h[72:], entries)
		le.PutUint32(h[80:], g.numEntries)
		le.PutUint32(h[84:], g.entrySize)
		le.PutUint32(h[88:], arrCRC)
		if entries < uint64(g.sectors) && int64(entries)*g.ss+int64(len(arr)) <= int64(len(d)) {
			copy(d[int64(entries)*g.ss:], arr)
		}
		if int64(g.headerSize) <= g.ss {
			le.PutUint32(h[16:], crc32.ChecksumIEEE(h[:g.headerSize]))
		}
	}
	el := g.entriesLBA
	if el == 0 {
		el = 2
	}
	put(1, last, el)
	put(last, 1, uint64(g.sectors-1-arrSectors))
	return d
}

func stdGPT() gptSpec {
	return gptSpec{ss: 512, sectors: sectors, parts: [][2]uint64{{2048, 4095}, {4096, 8191 - 40}}}
}

func TestPartGPT(t *testing.T) {
	tab, err := parse(t, stdGPT().build())
	if err != nil {
		t.Fatal(err)
	}
	if tab.Scheme != GPT || tab.BackupUsed || len(tab.Partitions) != 2 ||
		tab.Partitions[0] != (Partition{Number: 1, Start: 2048 * 512, Size: 2048 * 512, Type: "0FC63DAF-8483-4772-8E79-3D69D8477DE4", Name: "p0"}) ||
		tab.Partitions[1].Number != 2 || tab.Partitions[1].Size != (8191-40-4096+1)*512 {
		t.Fatalf("got %+v", tab)
	}
	// 4 KiB sectors: found where a 512-byte look finds nothing.
	g := gptSpec{ss: 4096, sectors: 1024, parts: [][2]uint64{{0, 0}, {256, 511}}}
	tab, err = parse(t, g.build())
	if err != nil || tab.SectorSize != 4096 || len(tab.Partitions) != 1 || tab.Partitions[0].Number != 2 || tab.Partitions[0].Start != 256*4096 {
		t.Fatalf("4 KiB sectors: got %+v, %v", tab, err)
	}
}

func TestPartGPTBackupAndHostile(t *testing.T) {
	last := int64(sectors - 1)
	cases := []struct {
		name   string
		spec   func(g *gptSpec)
		edit   func(d []byte)
		backup bool  // parses from the backup
		want   error // nil: parses
	}{
		{name: "primary header CRC", edit: func(d []byte) { d[512+16] ^= 1 }, backup: true},
		{name: "primary header field", edit: func(d []byte) { d[512+40] ^= 1 }, backup: true},
		{name: "primary signature", edit: func(d []byte) { d[512] = 'X' }, backup: true},
		{name: "primary entries CRC", edit: func(d []byte) { d[1024+40] ^= 1 }, backup: true},
		{name: "both headers", edit: func(d []byte) { d[512+16] ^= 1; d[last*512+16] ^= 1 }, want: ErrCorrupt},
		{name: "both entry arrays", edit: func(d []byte) { d[1024+40] ^= 1; d[(last-32)*512+40] ^= 1 }, want: ErrCorrupt},
		{name: "primary gone, backup CRC", edit: func(d []byte) { clear(d[512:1024]); d[last*512+20] ^= 1 }, want: ErrCorrupt},
		{name: "header size 91", spec: func(g *gptSpec) { g.headerSize = 91 }, want: ErrCorrupt},
		{name: "header size 512", spec: func(g *gptSpec) { g.headerSize = 512 }},
		{name: "header size 513", spec: func(g *gptSpec) { g.headerSize = 513 }, want: ErrCorrupt},
		{name: "header size max", spec: func(g *gptSpec) { g.headerSize = 0xffffffff }, want: ErrCorrupt},
		{name: "entry size 0", spec: func(g *gptSpec) { g.entrySize = 0 }},
		{name: "entry size 127", spec: func(g *gptSpec) { g.entrySize = 127 }, want: ErrCorrupt},
		{name: "entry size 129", spec: func(g *gptSpec) { g.entrySize = 129 }, want: ErrCorrupt},
		{name: "entry size max", spec: func(g *gptSpec) { g.entrySize = 0xffffffff }, want: ErrCorrupt},
		{name: "one entry", spec: func(g *gptSpec) { g.numEntries = 2 }},
		{name: "entries max", spec: func(g *gptSpec) {
			g.sectors = 70000
			g.numEntries = maxEntryArray / 128
			g.parts = [][2]uint64{{9000, 9999}}
		}},
		{name: "entries max+1", spec: func(g *gptSpec) { g.sectors = 70000; g.numEntries = maxEntryArray/128 + 1 }, want: ErrCorrupt},
		{name: "entries past the end", spec: func(g *gptSpec) { g.entriesLBA = sectors - 10 }, backup: true},
		{name: "entries past the end, no backup", spec: func(g *gptSpec) { g.entriesLBA = sectors - 10 }, edit: func(d []byte) { clear(d[last*512:]) }, want: ErrCorrupt},
		{name: "entries at LBA max", spec: func(g *gptSpec) { g.entriesLBA = 1<<64 - 1 }, backup: true},
		{name: "entries at LBA max, no backup", spec: func(g *gptSpec) { g.entriesLBA = 1<<64 - 1 }, edit: func(d []byte) { clear(d[last*512:]) }, want: ErrCorrupt},
		{name: "entries near 2^63", spec: func(g *gptSpec) { g.entriesLBA = 1<<63/512 - 1 }, backup: true},
		{name: "entries near 2^63, no backup", spec: func(g *gptSpec) { g.entriesLBA = 1<<63/512 - 1 }, edit: func(d []byte) { clear(d[last*512:]) }, want: ErrCorrupt},
		{name: "usable past the end", spec: func(g *gptSpec) { g.lastU = sectors }, want: ErrCorrupt},
		{name: "usable reversed", spec: func(g *gptSpec) { g.first = 5000; g.lastU = 4000 }, want: ErrCorrupt},
		{name: "partition outside usable", spec: func(g *gptSpec) { g.parts = [][2]uint64{{1, 100}} }, want: ErrCorrupt},
		{name: "partition reversed", spec: func(g *gptSpec) { g.parts = [][2]uint64{{3000, 2999}} }, want: ErrCorrupt},
		{name: "partition last LBA max", spec: func(g *gptSpec) { g.parts = [][2]uint64{{3000, 1<<64 - 1}} }, want: ErrCorrupt},
		{name: "partition near 2^63", spec: func(g *gptSpec) { g.parts = [][2]uint64{{1 << 54, 1<<54 + 1}} }, want: ErrCorrupt},
		{name: "partitions overlap", spec: func(g *gptSpec) { g.parts = [][2]uint64{{2048, 4096}, {4096, 5000}} }, want: ErrCorrupt},
		{name: "partitions touch", spec: func(g *gptSpec) { g.parts = [][2]uint64{{2048, 4095}, {4096, 5000}} }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			g := stdGPT()
			if c.spec != nil {
				c.spec(&g)
			}
			d := g.build()
			if c.edit != nil {
				c.edit(d)
			}
			tab, err := parse(t, d)
			if c.want != nil {
				if !errors.Is(err, c.want) {
					t.Fatalf("got %+v, %v; want %v", tab, err, c.want)
				}
				if strings.Contains(err.Error(), "\n") {
					t.Errorf("not one line: %q", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if tab.BackupUsed != c.backup || len(tab.Partitions) == 0 {
				t.Fatalf("got %+v; want backup %v", tab, c.backup)
			}
		})
	}
}

// TestPartRangeStaysInside: no request through a range reaches a byte
// of the disk outside it, whatever its offset and length.
func TestPartRangeStaysInside(t *testing.T) {
	ctx := context.Background()
	disk := &memImage{b: bytes.Repeat([]byte{0xa5}, 1<<16)}
	const start, size = 4096, 8192
	r, err := NewRange(disk, start, size, "disk-p1")
	if err != nil {
		t.Fatal(err)
	}
	for _, bad := range [][2]int64{{0, 1<<16 + 1}, {1, 1 << 16}, {-1, 10}, {1 << 60, 1}, {10, -1}} {
		if _, err := NewRange(disk, bad[0], bad[1], "x"); err == nil {
			t.Errorf("range %v of a 64 KiB disk accepted", bad)
		}
	}
	big := make([]byte, size+1)
	for _, off := range []int64{-1, 1, size - 1, size, size + 1, 1<<63 - 1, -1 << 63} {
		n := int64(2)
		if off == 1 {
			n = size
		}
		if _, err := r.WriteAt(ctx, big[:n], off); !errors.Is(err, formats.ErrOutOfRange) {
			t.Errorf("write of %d at %d: %v", n, off, err)
		}
		if done, err := r.TryWriteAt(big[:n], off); !done || !errors.Is(err, formats.ErrOutOfRange) {
			t.Errorf("try-write of %d at %d: %v %v", n, off, done, err)
		}
		if err := r.WriteZeroes(ctx, off, n, true); !errors.Is(err, formats.ErrOutOfRange) {
			t.Errorf("write-zeroes of %d at %d: %v", n, off, err)
		}
		if err := r.Discard(ctx, off, 1<<62); !errors.Is(err, formats.ErrOutOfRange) {
			t.Errorf("discard at %d: %v", off, err)
		}
		if _, err := r.ReadAt(ctx, big[:n], off); !errors.Is(err, formats.ErrOutOfRange) {
			t.Errorf("read of %d at %d: %v", n, off, err)
		}
		if r.TryReadAt(big[:n], off) {
			t.Errorf("try-read of %d at %d done", n, off)
		}
	}
	if err := r.Resize(ctx, size+1); !errors.Is(err, formats.ErrNotSupported) {
		t.Errorf("resize: %v", err)
	}
	// Every byte of the range written: the disk changes exactly there.
	if _, err := r.WriteAt(ctx, bytes.Repeat([]byte{1}, size), 0); err != nil {
		t.Fatal(err)
	}
	if err := r.WriteZeroes(ctx, size-100, 100, false); err != nil {
		t.Fatal(err)
	}
	for i, c := range disk.b {
		in := i >= start && i < start+size
		switch {
		case !in && c != 0xa5:
			t.Fatalf("byte %d outside the range changed to %#x", i, c)
		case in && i < start+size-100 && c != 1, in && i >= start+size-100 && c != 0:
			t.Fatalf("byte %d inside the range is %#x", i, c)
		}
	}
	e, err := r.Extent(ctx, size-10, 100)
	if err != nil || e.Start != size-10 || e.Length != 10 {
		t.Errorf("extent at the end: %+v %v", e, err)
	}
	e, err = r.Extent(ctx, 100, size)
	if err != nil || e.Start != 100 || e.Length != 4096-100 {
		t.Errorf("extent: %+v %v", e, err)
	}
	if _, err := r.Extent(ctx, size, 1); !errors.Is(err, formats.ErrOutOfRange) {
		t.Errorf("extent past the end: %v", err)
	}
	if r.Size() != size || r.Info().VirtualSize != size {
		t.Errorf("size %d info %+v", r.Size(), r.Info())
	}
}

// FuzzParse: any disk parses or is refused, without a panic, and what
// parses holds together: partitions inside the disk, none overlapping.
func FuzzParse(f *testing.F) {
	f.Add(mbrDisk()[:4<<20])
	f.Add(stdGPT().build())
	g := stdGPT()
	g.parts = [][2]uint64{{1 << 54, 1<<63 - 1}}
	f.Add(g.build())
	small := gptSpec{ss: 512, sectors: 64, numEntries: 4, parts: [][2]uint64{{8, 20}, {21, 50}}}
	f.Add(small.build())
	f.Add(gptSpec{ss: 4096, sectors: 12, numEntries: 4, parts: [][2]uint64{{4, 6}}}.build())
	ebr := make([]byte, 64*512)
	putEntries(ebr, ent{0, 0x05, 8, 50})
	putEntries(ebr[8*512:], ent{0, 0x83, 1, 2}, ent{0, 0x05, 4, 4})
	putEntries(ebr[12*512:], ent{0, 0x83, 1, 2}, ent{0, 0x05, 0, 4})
	f.Add(ebr)
	f.Fuzz(func(t *testing.T, d []byte) {
		if len(d) > 8<<20 {
			return
		}
		tab, err := Parse(context.Background(), &memImage{b: d})
		if err != nil {
			if strings.Contains(err.Error(), "\n") {
				t.Fatalf("not one line: %q", err)
			}
			return
		}
		for _, p := range tab.Partitions {
			if p.Start < 0 || p.Size < 0 || p.Start+p.Size > int64(len(d)) || p.Number < 1 || p.Number > maxPartitions {
				t.Fatalf("partition %+v of a %d-byte disk", p, len(d))
			}
			if _, err := NewRange(&memImage{b: d}, p.Start, p.Size, "p"); err != nil {
				t.Fatal(err)
			}
		}
	})
}
