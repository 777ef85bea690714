package vmdk

import (
	"bytes"
	"compress/zlib"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
)

// A crafted monolithicSparse image: 4 MiB of 4 KiB grains, 512 entries a
// grain table (2 MiB each, two tables). Sector 0 header, 1..20
// descriptor, 21 GD, 22..25 and 26..29 GTs, 30 RGD, 31..34 and 35..38
// redundant GTs, grains from sector 40.
const (
	tCapacity  = 8192 // sectors
	tGrain     = 8    // sectors
	tGTEs      = 512
	tGD        = 21
	tGT0, tGT1 = 22, 26
	tRGD       = 30
	tGrainOff  = 40
)

type crafted struct {
	b    []byte
	want []byte // what the image reads as
}

func le32(b []byte, off int, v uint32) { binary.LittleEndian.PutUint32(b[off:], v) }
func le64(b []byte, off int, v uint64) { binary.LittleEndian.PutUint64(b[off:], v) }

// craft builds the image: grains 0..2 data, grain 5 zeroed (GTE 1),
// grain 600 (second table) data, the rest unallocated. compressed makes
// the grains deflate streams behind markers (streamOptimized's layout).
func craft(compressed bool) crafted {
	if compressed {
		return craftWith(func(_ int, data []byte) []byte {
			var z bytes.Buffer
			w := zlib.NewWriter(&z)
			w.Write(data)
			w.Close()
			return z.Bytes()
		})
	}
	return craftWith(nil)
}

// craftWith is craft with the grains compressed by enc (nil: not
// compressed); enc gets the grain's index and data.
func craftWith(enc func(gi int, data []byte) []byte) crafted {
	compressed := enc != nil
	rng := rand.New(rand.NewSource(1))
	want := make([]byte, tCapacity*512)
	b := make([]byte, tGrainOff*512)
	copy(b, "KDMV")
	le32(b, 4, 1)
	flags := uint32(1 | flagRGD | flagZeroGrain)
	if compressed {
		flags |= flagCompress | flagMarker
		le32(b, 4, 3)
		b[77] = compressDeflate
	}
	le32(b, 8, flags)
	le64(b, 12, tCapacity)
	le64(b, 20, tGrain)
	le64(b, 28, 1)
	le64(b, 36, 20)
	le32(b, 44, tGTEs)
	le64(b, 48, tRGD)
	le64(b, 56, tGD)
	le64(b, 64, tGrainOff)
	copy(b[512:], "# Disk DescriptorFile\nversion=1\nCID=12345678\nparentCID=ffffffff\ncreateType=\"monolithicSparse\"\nRW 8192 SPARSE \"x.vmdk\"\n")
	for _, gd := range []int{tGD, tRGD} {
		gt0, gt1 := tGT0, tGT1
		if gd == tRGD {
			gt0, gt1 = 31, 35
		}
		le32(b, gd*512, uint32(gt0))
		le32(b, gd*512+4, uint32(gt1))
	}
	put := func(gi int) {
		data := make([]byte, tGrain*512)
		rng.Read(data)
		sector := uint32(len(b) / 512)
		if compressed {
			z := enc(gi, data) // which may change data: want has the change
			m := make([]byte, 12)
			le64(m, 0, uint64(gi*tGrain))
			le32(m, 8, uint32(len(z)))
			rec := append(m, z...)
			rec = append(rec, make([]byte, (512-len(rec)%512)%512)...)
			b = append(b, rec...)
		} else {
			b = append(b, data...)
		}
		copy(want[gi*tGrain*512:], data)
		for _, gt := range [][2]int{{tGT0, tGT1}, {31, 35}} {
			t := gt[0]
			if gi >= tGTEs {
				t = gt[1]
			}
			le32(b, t*512+4*(gi%tGTEs), sector)
		}
	}
	for _, gi := range []int{0, 1, 2, 600} {
		put(gi)
	}
	le32(b, tGT0*512+4*5, gteZeroed)
	le32(b, 31*512+4*5, gteZeroed)
	return crafted{b: b, want: want}
}

func writeTemp(t testing.TB, dir, name string, b []byte) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func open(t testing.TB, p string, o Options) (*Image, error) {
	t.Helper()
	f, err := aio.Open(p, aio.Options{Backend: aio.Threads})
	if err != nil {
		t.Fatal(err)
	}
	o.Name = p
	return New(context.Background(), f, o)
}

func TestVmdkCraftedReads(t *testing.T) {
	for _, compressed := range []bool{false, true} {
		t.Run(fmt.Sprint("compressed=", compressed), func(t *testing.T) {
			c := craft(compressed)
			p := writeTemp(t, t.TempDir(), "x.vmdk", c.b)
			img, err := open(t, p, Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer img.Close()
			if img.Size() != int64(len(c.want)) {
				t.Fatalf("size %d, want %d", img.Size(), len(c.want))
			}
			got := make([]byte, len(c.want))
			if _, err := img.ReadAt(context.Background(), got, 0); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, c.want) {
				t.Fatal("image reads other data than crafted")
			}
			// Unaligned reads across grains, and the fast path once cached.
			for _, r := range [][2]int64{{100, 9000}, {4095, 2}, {600*4096 - 7, 20}} {
				b := make([]byte, r[1])
				if _, err := img.ReadAt(context.Background(), b, r[0]); err != nil || !bytes.Equal(b, c.want[r[0]:r[0]+r[1]]) {
					t.Fatalf("read %v: %v", r, err)
				}
				clear(b)
				if img.TryReadAt(b, r[0]) && !bytes.Equal(b, c.want[r[0]:r[0]+r[1]]) {
					t.Fatalf("try read %v: wrong data", r)
				}
				v, ok := img.TryLendAt(r[0], r[1], nil)
				if ok == compressed || ok && !bytes.Equal(bytes.Join(v, nil), c.want[r[0]:r[0]+r[1]]) {
					t.Fatalf("lend %v: lent %v (compressed %v), or wrong data", r, ok, compressed)
				}
			}
			ext, err := img.Extent(context.Background(), 5*4096, 1<<20)
			if err != nil || !ext.Zero || ext.Data || !ext.Present || ext.Length != 4096 {
				t.Fatalf("zeroed grain: %+v %v", ext, err)
			}
			ext, err = img.Extent(context.Background(), 6*4096, 1<<20)
			if err != nil || !ext.Zero || ext.Data || ext.Present {
				t.Fatalf("unallocated grain: %+v %v", ext, err)
			}
			in := img.Info()
			if in.FormatSpecific == nil || in.FormatSpecific.Type != "vmdk" || in.FormatSpecific.Data.(SpecificInfo).CID != 0x12345678 {
				t.Fatalf("info: %+v", in.FormatSpecific)
			}
			if _, err := img.WriteAt(context.Background(), []byte{1}, 0); !errors.Is(err, formats.ErrReadOnly) {
				t.Fatalf("write: %v", err)
			}
		})
	}
}

// mutation changes a crafted image; wantErr: the open (or, read: the
// read of the whole image) must fail with ErrCorrupt/ErrUnsupported.
type mutation struct {
	name string
	mut  func(b []byte) []byte
	// read: the open succeeds and reading the image fails.
	read bool
	// ok: the image opens and reads (a field at a legal extreme).
	ok bool
}

func headerMutations() []mutation {
	set32 := func(off int, v uint32) func([]byte) []byte {
		return func(b []byte) []byte { le32(b, off, v); return b }
	}
	set64 := func(off int, v uint64) func([]byte) []byte {
		return func(b []byte) []byte { le64(b, off, v); return b }
	}
	return []mutation{
		{name: "version 0", mut: set32(4, 0), ok: true},
		{name: "version 3", mut: set32(4, 3), ok: true},
		{name: "version 4", mut: set32(4, 4)},
		{name: "version max", mut: set32(4, ^uint32(0))},
		{name: "flags 0", mut: set32(8, 0), read: true}, // GTE 1 is then a grain in the header
		{name: "capacity 0 with descriptor (names itself)", mut: set64(12, 0)},
		{name: "capacity max", mut: set64(12, maxSectors)},
		{name: "capacity max+1", mut: set64(12, maxSectors+1)},
		{name: "capacity 2^64-1", mut: set64(12, ^uint64(0))},
		{name: "granularity 0", mut: set64(20, 0)},
		{name: "granularity max", mut: set64(20, maxGrainSectors), read: true},
		{name: "granularity max+1", mut: set64(20, maxGrainSectors+1)},
		{name: "granularity 2^63", mut: set64(20, 1<<63)},
		{name: "GTEs 0", mut: set32(44, 0)},
		{name: "GTEs max", mut: set32(44, maxGTEs), ok: true},
		{name: "GTEs max+1", mut: set32(44, maxGTEs+1)},
		{name: "GD inside the header", mut: func(b []byte) []byte { le64(b, 56, 0); le64(b, 48, 0); return b }},
		{name: "GD inside the header, RGD good", mut: set64(56, 0), ok: true},
		{name: "GD and RGD past EOF", mut: func(b []byte) []byte { le64(b, 56, 1<<40); le64(b, 48, 1<<40); return b }},
		{name: "GD near 2^64", mut: func(b []byte) []byte { le64(b, 56, 1<<63-1); le64(b, 48, ^uint64(0)>>1); return b }},
		{name: "GD past EOF, RGD good", mut: set64(56, 1<<40), ok: true},
		{name: "grain offset past EOF", mut: set64(64, 1<<40)},
		{name: "grain offset max", mut: set64(64, ^uint64(0))},
		{name: "GT past EOF", mut: func(b []byte) []byte {
			le32(b, tGD*512, 1<<30)
			le32(b, tRGD*512, 1<<30)
			return b
		}},
		{name: "GT on the GD", mut: func(b []byte) []byte { le32(b, tGD*512, tGD); le32(b, tRGD*512, tRGD); return b }},
		{name: "GTs duplicate", mut: func(b []byte) []byte {
			le32(b, tGD*512+4, tGT0)
			le32(b, tRGD*512+4, 31)
			return b
		}},
		{name: "GTs overlap", mut: func(b []byte) []byte {
			le32(b, tGD*512+4, tGT0+1)
			le32(b, tRGD*512+4, 32)
			return b
		}},
		{name: "grain past EOF", read: true, mut: func(b []byte) []byte {
			le32(b, tGT0*512, 1<<30)
			return b
		}},
		{name: "grain inside the header", read: true, mut: func(b []byte) []byte {
			le32(b, tGT0*512+4, 2) // sector 2 is descriptor, below grain_offset
			return b
		}},
		{name: "grain at 2^32-1", read: true, mut: func(b []byte) []byte {
			le32(b, tGT0*512, ^uint32(0))
			return b
		}},
		{name: "file cut after the GTs", mut: func(b []byte) []byte { return b[:39*512] }},
		{name: "file of 3 bytes", mut: func(b []byte) []byte { return b[:3] }},
		{name: "header only", mut: func(b []byte) []byte { return b[:512] }},
		{name: "no CID", mut: func(b []byte) []byte {
			copy(b[512:], strings.Repeat("#", 100))
			return b
		}},
	}
}

func TestVmdkHostileHeaders(t *testing.T) {
	dir := t.TempDir()
	for _, m := range headerMutations() {
		t.Run(m.name, func(t *testing.T) {
			c := craft(false)
			p := writeTemp(t, dir, "x.vmdk", m.mut(c.b))
			checkMutation(t, p, m)
		})
	}
}

func checkMutation(t *testing.T, p string, m mutation) {
	t.Helper()
	img, err := open(t, p, Options{})
	if err != nil {
		if m.ok || m.read {
			t.Fatalf("open refused: %v", err)
		}
		if !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrUnsupported) {
			t.Fatalf("open: %v, want ErrCorrupt or ErrUnsupported", err)
		}
		if strings.Contains(err.Error(), "\n") {
			t.Fatalf("refusal is more than one line: %q", err)
		}
		return
	}
	defer img.Close()
	if !m.ok && !m.read {
		t.Fatalf("hostile image opened (size %d)", img.Size())
	}
	var rerr error
	buf := make([]byte, 1<<20)
	for off := int64(0); off < img.Size() && off < 64<<20; off += int64(len(buf)) {
		n := min(int64(len(buf)), img.Size()-off)
		_, err := img.ReadAt(context.Background(), buf[:n], off)
		// What the fast path lends (the file's pages in the cache now)
		// is what a read reads, and nothing a read refuses.
		if v, ok := img.TryLendAt(off, n, nil); ok && (err != nil || !bytes.Equal(bytes.Join(v, nil), buf[:n])) {
			t.Fatalf("lent [%d, +%d) where a read says %v, or other bytes", off, n, err)
		}
		if err != nil {
			rerr = err
			break
		}
	}
	if m.read && !errors.Is(rerr, ErrCorrupt) {
		t.Fatalf("read: %v, want ErrCorrupt", rerr)
	}
	if m.ok && rerr != nil {
		t.Fatalf("read: %v", rerr)
	}
}

func TestVmdkCompressedGrainLies(t *testing.T) {
	dir := t.TempDir()
	grain0 := func(b []byte) int { return int(binary.LittleEndian.Uint32(b[tGT0*512:])) * 512 }
	for _, m := range []mutation{
		{name: "length 0", read: true, mut: func(b []byte) []byte { le32(b, grain0(b)+8, 0); return b }},
		{name: "length past EOF", read: true, mut: func(b []byte) []byte { le32(b, grain0(b)+8, 1<<31); return b }},
		{name: "length 2^32-1", read: true, mut: func(b []byte) []byte { le32(b, grain0(b)+8, ^uint32(0)); return b }},
		{name: "length short", read: true, mut: func(b []byte) []byte { le32(b, grain0(b)+8, 20); return b }},
		{name: "wrong lba", read: true, mut: func(b []byte) []byte { le64(b, grain0(b), 99); return b }},
		{name: "not deflate", read: true, mut: func(b []byte) []byte { copy(b[grain0(b)+12:], "garbage!"); return b }},
		{name: "inflates past a grain", read: true, mut: func(b []byte) []byte {
			var z bytes.Buffer
			w := zlib.NewWriter(&z)
			w.Write(make([]byte, 3*tGrain*512))
			w.Close()
			g := grain0(b)
			le32(b, g+8, uint32(z.Len()))
			copy(b[g+12:], z.Bytes())
			return b
		}},
		{name: "grain of 16 MiB", read: true, mut: func(b []byte) []byte {
			le64(b, 20, maxCompressedGrain/512)
			le32(b, 44, 1) // opens; its grains hold 4 KiB, which the read finds
			return b
		}},
		{name: "grain of 16 MiB + 512", mut: func(b []byte) []byte {
			le64(b, 20, maxCompressedGrain/512+1)
			return b
		}},
		{name: "grain of 1 GiB", mut: func(b []byte) []byte {
			le64(b, 20, maxGrainSectors)
			return b
		}},
	} {
		t.Run(m.name, func(t *testing.T) {
			c := craft(true)
			p := writeTemp(t, dir, "x.vmdk", m.mut(c.b))
			checkMutation(t, p, m)
		})
	}
}

func TestVmdkDescriptorExtents(t *testing.T) {
	dir := t.TempDir()
	flat := make([]byte, 8192)
	rand.New(rand.NewSource(2)).Read(flat)
	writeTemp(t, dir, "a-flat.vmdk", flat)
	desc := "# Disk DescriptorFile\nversion=1\nCID=fffffffe\nparentCID=ffffffff\ncreateType=\"twoGbMaxExtentFlat\"\n" +
		"RW 8 FLAT \"a-flat.vmdk\" 4\nRDONLY 8 FLAT \"skipped\" 0\nRW 4 ZERO \"\"\nRW 8 FLAT \"a-flat.vmdk\" 0\n"
	p := writeTemp(t, dir, "a.vmdk", []byte(desc))
	var asked []string
	o := Options{OpenExtent: func(name string) (aio.File, string, error) {
		asked = append(asked, name)
		f, err := aio.Open(filepath.Join(dir, name), aio.Options{Backend: aio.Threads})
		return f, name, err
	}}
	img, err := open(t, p, o)
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	want := append(append(append([]byte{}, flat[2048:6144]...), make([]byte, 2048)...), flat[:4096]...)
	got := make([]byte, len(want))
	if img.Size() != int64(len(want)) {
		t.Fatalf("size %d, want %d", img.Size(), len(want))
	}
	if _, err := img.ReadAt(context.Background(), got, 0); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read: %v, equal %v", err, bytes.Equal(got, want))
	}
	if len(asked) != 2 {
		t.Fatalf("opened %v", asked)
	}
	in := img.Info().FormatSpecific.Data.(SpecificInfo)
	if in.CID != 0xfffffffe || in.CreateType != "twoGbMaxExtentFlat" || len(in.Extents) != 3 || in.Extents[0].Format != "FLAT" {
		t.Fatalf("info %+v", in)
	}

	for _, bad := range []string{
		"createType=\"monolithicSparse\"\nCID=1 parentCID=1\n",                 // not a descriptor file's type
		"createType=\"custom\"\nCID=1 parentCID=1\n",                           // unknown
		"createType=\"monolithicFlat\"\nCID=1\nparentCID=1\nRW 8 FLAT \"x\"\n", // FLAT without offset
		"createType=\"monolithicFlat\"\nCID=1\nparentCID=1\nRW 8 SPARSE \"x\" 5\n",
		"createType=\"monolithicFlat\"\nCID=1\nparentCID=1\nRW 4398046511105 FLAT \"a-flat.vmdk\" 0\n", // max+1 sectors
		"createType=\"vmfsSparse\"\nCID=1\nparentCID=1\n",
		"createType=\"monolithicFlat\"\n", // no CID
		"createType",
	} {
		p := writeTemp(t, dir, "bad.vmdk", []byte(bad))
		if img, err := open(t, p, o); err == nil {
			img.Close()
			t.Errorf("descriptor %q opened", bad)
		} else if strings.Contains(err.Error(), "\n") {
			t.Errorf("refusal is more than one line: %q", err)
		}
	}
	// Without an opener, extents in other files are refused.
	if img, err := open(t, filepath.Join(dir, "a.vmdk"), Options{}); err == nil {
		img.Close()
		t.Fatal("extent opened without an opener")
	}
}

// FuzzOpen: any file opens or is refused, and an opened one reads (or
// fails to) without a panic or a hang.
func FuzzOpen(f *testing.F) {
	for _, c := range []bool{false, true} {
		f.Add(craft(c).b)
	}
	for _, m := range headerMutations() {
		f.Add(m.mut(craft(false).b))
	}
	// Offsets near 2^63 in every 64-bit field.
	for _, off := range []int{12, 20, 28, 48, 56, 64} {
		b := craft(true).b
		le64(b, off, 1<<63-512)
		f.Add(b)
	}
	// Descriptor files: every extent resolves to one sparse or flat file.
	for _, d := range []string{
		"# Disk DescriptorFile\nversion=1\nCID=1\nparentCID=ffffffff\ncreateType=\"twoGbMaxExtentSparse\"\nRW 8192 SPARSE \"s\"\nRW 8 FLAT \"f\" 0\nRW 4 ZERO \"\"\n",
		"# Disk DescriptorFile\nCID=fffffffe\nparentCID=ffffffff\ncreateType=\"vmfs\"\nRW 4611686018427387903 VMFS \"f\"\n",
		"# Disk DescriptorFile\nCID=1\nparentCID=1\ncreateType=\"monolithicFlat\"\nRW 8 FLAT \"f\" 9223372036854775807\n",
	} {
		f.Add([]byte(d))
	}
	dir := f.TempDir()
	sparse := writeTemp(f, dir, "s", craft(false).b)
	flat := writeTemp(f, dir, "f", make([]byte, 8192))
	opener := func(name string) (aio.File, string, error) {
		p := flat
		if name == "s" {
			p = sparse
		}
		file, err := aio.Open(p, aio.Options{Backend: aio.Threads})
		return file, name, err
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		done := make(chan struct{})
		defer close(done)
		go func() {
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				panic("vmdk open/read hangs for 10s")
			}
		}()
		p := writeTemp(t, dir, "fuzz.vmdk", b)
		img, err := open(t, p, Options{OpenExtent: opener})
		if err != nil {
			return
		}
		buf := make([]byte, 256<<10)
		for off := int64(0); off < img.Size() && off < 8<<20; off += int64(len(buf)) {
			n := min(int64(len(buf)), img.Size()-off)
			if _, err := img.ReadAt(context.Background(), buf[:n], off); err != nil {
				img.Close()
				return
			}
			img.TryReadAt(buf[:n], off)
			img.Extent(context.Background(), off, n)
		}
		img.Info()
		img.Close()
		fuzzWritable(t, p, opener)
	})
}

// fuzzWritable opens the image at p (one that opened for reading)
// writable: refused in one line, or written in its first and last grain
// without damage to its metadata (it opens again and reads what was
// written, or the write was refused).
func fuzzWritable(t *testing.T, p string, opener func(string) (aio.File, string, error)) {
	file, err := aio.Open(p, aio.Options{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	img, err := New(context.Background(), file, Options{Name: p, OpenExtent: opener, Writable: true})
	if err != nil {
		if strings.Contains(err.Error(), "\n") {
			t.Fatalf("writable open refused in more than one line: %q", err)
		}
		return
	}
	ctx := context.Background()
	written := map[int64]bool{}
	for _, off := range []int64{0, img.Size() - 5} {
		if off < 0 || img.Size() < 5 || off > 8<<20 {
			continue
		}
		if _, err := img.WriteAt(ctx, []byte("fuzz!"), off); err == nil {
			written[off] = true
		}
	}
	img.Close()
	img, err = open(t, p, Options{OpenExtent: opener})
	if err != nil {
		t.Fatalf("the image no longer opens after writes: %v", err)
	}
	defer img.Close()
	for off := range written {
		got := make([]byte, 5)
		if _, err := img.ReadAt(ctx, got, off); err != nil || string(got) != "fuzz!" {
			t.Fatalf("at %d: read %q (%v) after writing it", off, got, err)
		}
	}
}

// TestVmdkCachesBoundedPerImage: a descriptor of many sparse extents gets
// one grain-table cache and one grain cache for the image, not one each
// (4096 extents of 8 MiB caches would be 32 GiB), and reads right through
// them.
func TestVmdkCachesBoundedPerImage(t *testing.T) {
	dir := t.TempDir()
	c := craft(true)
	sparse := writeTemp(t, dir, "s", c.b)
	desc := "# Disk DescriptorFile\nCID=1\nparentCID=ffffffff\ncreateType=\"twoGbMaxExtentSparse\"\n" + strings.Repeat("RW 8192 SPARSE \"s\"\n", 50)
	p := writeTemp(t, dir, "d.vmdk", []byte(desc))
	img, err := open(t, p, Options{OpenExtent: func(name string) (aio.File, string, error) {
		f, err := aio.Open(sparse, aio.Options{Backend: aio.Threads})
		return f, name, err
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	first := img.extents[0]
	for _, e := range img.extents {
		if e.gtCache != first.gtCache || e.grainCache != first.grainCache {
			t.Fatal("extents have caches of their own")
		}
	}
	if want := DefaultGTCacheSize / (tGTEs*4 + 64); first.gtCache.Cap() != want {
		t.Fatalf("grain-table cache of %d tables, want %d", first.gtCache.Cap(), want)
	}
	if want := decodedCacheBytes / (tGrain * 512); first.grainCache.Cap() != want {
		t.Fatalf("grain cache of %d grains, want %d", first.grainCache.Cap(), want)
	}
	got := make([]byte, len(c.want))
	for i := range 50 {
		if _, err := img.ReadAt(context.Background(), got, int64(i)*int64(len(c.want))); err != nil || !bytes.Equal(got, c.want) {
			t.Fatalf("extent %d: %v", i, err)
		}
	}
}
