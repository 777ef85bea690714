package vpc

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
)

// vhdSpec is a crafted dynamic (or fixed) VHD.
type vhdSpec struct {
	typ         uint32
	creator     string
	cyls        uint16
	heads, secs uint8
	currentSize uint64
	dataOffset  uint64 // dynamic header
	batOffset   uint64
	entries     uint32
	blockSize   uint32
	bat         []uint32
	badSum      bool
	fileSize    int64 // 0: as built
}

const testBS = 4096

// goodVHD: 16 KiB disk of 4 KiB blocks; block 0 and 2 allocated (data
// bytes 0xa0+i), blocks 1 and 3 not.
func goodVHD() vhdSpec {
	return vhdSpec{typ: typeDynamic, creator: "qem2", currentSize: 16384, cyls: 1, heads: 1, secs: 1,
		dataOffset: 512, batOffset: 1536, entries: 4, blockSize: testBS, bat: []uint32{4, unallocated, 13, unallocated}}
}

func footer(s vhdSpec) []byte {
	b := make([]byte, 512)
	be := binary.BigEndian
	copy(b, "conectix")
	be.PutUint64(b[16:], s.dataOffset)
	copy(b[28:32], s.creator)
	be.PutUint64(b[40:], s.currentSize)
	be.PutUint64(b[48:], s.currentSize)
	be.PutUint16(b[56:], s.cyls)
	b[58], b[59] = s.heads, s.secs
	be.PutUint32(b[60:], s.typ)
	var sum uint32
	for _, c := range b {
		sum += uint32(c)
	}
	if s.badSum {
		sum++
	}
	be.PutUint32(b[64:], ^sum)
	return b
}

func (s vhdSpec) build(t testing.TB) string {
	p := filepath.Join(t.TempDir(), "c.vhd")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ft := footer(s)
	be := binary.BigEndian
	end := int64(0)
	w := func(b []byte, off int64) {
		if off < 0 || off >= 1<<30 {
			return // a structure crafted to lie past the end stays there
		}
		if _, err := f.WriteAt(b, off); err != nil {
			t.Fatal(err)
		}
		end = max(end, off+int64(len(b)))
	}
	if s.typ == typeFixed {
		data := make([]byte, s.currentSize)
		for i := range data {
			data[i] = byte(i / 512)
		}
		w(data, 0)
		w(ft, int64(s.currentSize))
	} else {
		w(ft, 0)
		h := make([]byte, 1024)
		copy(h, "cxsparse")
		be.PutUint64(h[8:], 1<<64-1)
		be.PutUint64(h[16:], s.batOffset)
		be.PutUint32(h[28:], s.entries)
		be.PutUint32(h[32:], s.blockSize)
		w(h, int64(s.dataOffset))
		bat := make([]byte, 4*len(s.bat))
		for i, e := range s.bat {
			be.PutUint32(bat[4*i:], e)
			if e != unallocated && int64(e) < 1<<20 {
				w(bytes.Repeat([]byte{0xa0 + byte(i)}, testBS), int64(e)*512+512)
			}
		}
		w(bat, int64(s.batOffset))
		w(ft, end)
	}
	if s.fileSize != 0 {
		end = s.fileSize
	}
	if err := f.Truncate(end); err != nil {
		t.Fatal(err)
	}
	return p
}

func openVHD(t testing.TB, p string, o Options) (*Image, error) {
	f, err := aio.Open(p, aio.Options{Backend: aio.Threads})
	if err != nil {
		t.Fatal(err)
	}
	img, err := New(context.Background(), f, o)
	if err == nil {
		t.Cleanup(func() { img.Close() })
	}
	return img, err
}

func TestVpcReadsBlocksThroughTheBAT(t *testing.T) {
	img, err := openVHD(t, goodVHD().build(t), Options{})
	if err != nil {
		t.Fatal(err)
	}
	want := bytes.Join([][]byte{bytes.Repeat([]byte{0xa0}, testBS), make([]byte, testBS), bytes.Repeat([]byte{0xa2}, testBS), make([]byte, testBS)}, nil)
	got := make([]byte, 4*testBS)
	if _, err := img.ReadAt(context.Background(), got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("read differs from the BAT's blocks")
	}
	if e, err := img.Extent(context.Background(), 0, img.Size()); err != nil || !e.Data || e.Offset != 4*512+512 || e.Length != testBS {
		t.Fatalf("extent %+v %v", e, err)
	}
	if i := img.Info(); i.Format != "vpc" || i.ClusterSize != testBS || i.VirtualSize != 16384 {
		t.Fatalf("info %+v", i)
	}
}

// TestVpcSizeByCreator: the CHS geometry or current_size, as QEMU picks.
func TestVpcSizeByCreator(t *testing.T) {
	for _, c := range []struct {
		creator string
		calc    SizeCalc
		cyls    uint16
		heads   uint8
		secs    uint8
		want    int64
	}{
		{"qem2", SizeAuto, 1, 1, 1, 16384},
		{"win ", SizeAuto, 1, 1, 1, 16384},
		{"d2v ", SizeAuto, 1, 1, 1, 16384},
		{"CTXS", SizeAuto, 1, 1, 1, 16384},
		{"tap\x00", SizeAuto, 1, 1, 1, 16384},
		{"vpc ", SizeAuto, 2, 2, 4, 16 * 512},
		{"qemu", SizeAuto, 2, 2, 4, 16 * 512},
		{"qemu", SizeCurrentSize, 2, 2, 4, 16384},
		{"win ", SizeCHS, 2, 2, 4, 16 * 512},
		{"qemu", SizeAuto, 65535, 16, 255, 16384}, // the largest geometry: current_size
		{"qemu", SizeAuto, 0, 0, 0, 0},
	} {
		t.Run(fmt.Sprintf("%q-%d-%d", c.creator, c.calc, c.cyls), func(t *testing.T) {
			s := goodVHD()
			s.creator, s.cyls, s.heads, s.secs = c.creator, c.cyls, c.heads, c.secs
			img, err := openVHD(t, s.build(t), Options{SizeCalc: c.calc})
			if err != nil {
				t.Fatal(err)
			}
			if img.Size() != c.want {
				t.Fatalf("size %d, want %d", img.Size(), c.want)
			}
		})
	}
}

// TestVpcHostileFootersAndBATs: fields at 0, max and max+1; BAT entries
// past the end, at the footer, the header or the BAT, and at each other.
// Differential: each file is also read by qemu-img 7.2; what opens here
// must open there and read the same bytes, and what QEMU reads but is
// refused here is logged (the cases where QEMU serves wrong data).
func TestVpcHostileFootersAndBATs(t *testing.T) {
	cases := hostileVHDs()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := goodVHD()
			c.mod(&s)
			path := s.build(t)
			img, err := openVHD(t, path, Options{})
			qemu, qemuOK := qemuReads(t, path)
			switch {
			case c.want == nil && err != nil:
				t.Fatalf("refused: %v", err)
			case c.want != nil && !errors.Is(err, c.want):
				t.Fatalf("got %v, want %v", err, c.want)
			case err != nil:
				if bytes.ContainsRune([]byte(err.Error()), '\n') {
					t.Fatalf("refusal is not one line: %q", err)
				}
				if qemuOK {
					t.Logf("QEMU 7.2 opens and reads it; refused here: %v", err)
				}
				return
			}
			readAllVHD(t, img)
			// Differential: what opens here reads as qemu-img reads it.
			if !qemuOK {
				t.Fatal("opens here, but qemu-img refuses it")
			}
			got := make([]byte, img.Size())
			if _, err := img.ReadAt(context.Background(), got, 0); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, qemu) {
				t.Fatal("reads differ from qemu-img's")
			}
		})
	}
}

// hostileCase is a crafted VHD: goodVHD changed by mod, and the error
// its open gives (nil: it opens).
type hostileCase struct {
	name string
	mod  func(*vhdSpec)
	want error
}

// hostileVHDs are the crafted files every open is tried on: fields at 0,
// max and max+1; BAT entries past the end, at the footer, the header or
// the BAT, and at each other.
func hostileVHDs() []hostileCase {
	return []hostileCase{
		{"good", func(*vhdSpec) {}, nil},
		{"fixed", func(s *vhdSpec) { s.typ = typeFixed }, nil},
		{"fixed larger than the file", func(s *vhdSpec) { s.typ = typeFixed; s.creator = "qemu"; s.cyls, s.heads, s.secs = 1000, 16, 63 }, ErrCorrupt},
		{"bad checksum", func(s *vhdSpec) { s.badSum = true }, ErrCorrupt},
		{"differencing", func(s *vhdSpec) { s.typ = typeDiff }, ErrUnsupported},
		{"size at the max", func(s *vhdSpec) {
			s.currentSize = maxSectors * 512
			s.entries = maxSectors * 512 / (2 << 20)
			s.blockSize = 2 << 20
		}, ErrCorrupt},
		{"size past the max", func(s *vhdSpec) { s.currentSize = (maxSectors + 1) * 512 }, ErrUnsupported},
		{"size 2^64-1", func(s *vhdSpec) { s.currentSize = 1<<64 - 1 }, ErrUnsupported},
		{"size 0", func(s *vhdSpec) { s.currentSize = 0 }, nil},
		{"header offset 0", func(s *vhdSpec) { s.dataOffset = 0; s.batOffset = 1536 }, ErrCorrupt},
		{"header offset max", func(s *vhdSpec) { s.dataOffset = 1<<64 - 1 }, ErrCorrupt},
		{"block size 0", func(s *vhdSpec) { s.blockSize = 0 }, ErrCorrupt},
		{"block size 511", func(s *vhdSpec) { s.blockSize = 511 }, ErrCorrupt},
		{"block size not a power of 2", func(s *vhdSpec) { s.blockSize = 4096 + 512 }, ErrCorrupt},
		{"block size 2^31", func(s *vhdSpec) { s.blockSize = 1 << 31 }, ErrCorrupt}, // its blocks end past the file
		{"entries 0", func(s *vhdSpec) { s.entries = 0 }, ErrCorrupt},
		{"entries max", func(s *vhdSpec) { s.entries = maxTableEntries }, ErrCorrupt}, // BAT past the end
		{"entries max+1", func(s *vhdSpec) { s.entries = maxTableEntries + 1 }, ErrCorrupt},
		{"BAT past the end", func(s *vhdSpec) { s.batOffset = 1 << 40 }, ErrCorrupt},
		{"BAT over the header", func(s *vhdSpec) { s.batOffset = 1024 }, ErrCorrupt},
		{"entry past the end", func(s *vhdSpec) { s.bat[1] = 1 << 24 }, ErrCorrupt},
		{"entry max", func(s *vhdSpec) { s.bat[1] = unallocated - 1 }, ErrCorrupt},
		{"entry at the footer copy", func(s *vhdSpec) { s.bat[1] = 0 }, ErrCorrupt},
		{"entry at the header", func(s *vhdSpec) { s.bat[1] = 1 }, ErrCorrupt},
		{"entry at the BAT", func(s *vhdSpec) { s.bat[1] = 3 }, ErrCorrupt},
		{"duplicate entries", func(s *vhdSpec) { s.bat[1] = 4 }, ErrCorrupt},
		{"overlapping entries", func(s *vhdSpec) { s.bat[1] = 5 }, ErrCorrupt},
		{"truncated", func(s *vhdSpec) { s.fileSize = 13*512 + 512 + 100 }, ErrCorrupt},
		{"short file", func(s *vhdSpec) { s.fileSize = 100 }, ErrCorrupt},
	}
}

func readAllVHD(t testing.TB, img *Image) {
	ctx := context.Background()
	p := make([]byte, 1<<20)
	for off := int64(0); off < img.Size(); off += int64(len(p)) {
		n := min(int64(len(p)), img.Size()-off)
		if _, err := img.ReadAt(ctx, p[:n], off); err != nil {
			t.Fatalf("read at %d: %v", off, err)
		}
		if v, ok := img.TryLendAt(off, n, nil); ok && !bytes.Equal(bytes.Join(v, nil), p[:n]) {
			t.Fatalf("lent at %d: not what was read", off)
		}
		img.TryReadAt(p[:n], off)
		for o := off; o < off+n; {
			e, err := img.Extent(ctx, o, off+n-o)
			if err != nil || e.Length <= 0 {
				t.Fatalf("extent at %d: %+v %v", o, e, err)
			}
			o += e.Length
		}
	}
}

// FuzzOpen: any file opens or is refused without a panic or a hang, and
// what opens reads and maps to its end.
func FuzzOpen(f *testing.F) {
	big := goodVHD()
	big.batOffset, big.entries, big.bat = 1<<62, 1<<31-1, []uint32{1 << 31}
	for _, s := range []vhdSpec{goodVHD(), big, {typ: typeFixed, creator: "win ", currentSize: 4096}} {
		b, err := os.ReadFile(s.build(f))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	// A differencing disk with a W2ru locator in its last sector.
	d := goodVHD()
	d.typ = typeDiff
	b, err := os.ReadFile(d.build(f))
	if err != nil {
		f.Fatal(err)
	}
	loc := len(b)
	b = append(b, make([]byte, 512)...)
	copy(b[loc:], []byte{'p', 0, '.', 0, 'v', 0})
	le := b[512+576:]
	binary.BigEndian.PutUint32(le, platW2ru)
	binary.BigEndian.PutUint32(le[8:], 6)
	binary.BigEndian.PutUint64(le[16:], uint64(loc))
	f.Add(b)
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, b []byte) {
		done := make(chan struct{})
		defer close(done)
		go func() {
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				panic(fmt.Sprintf("vpc open hangs on %d bytes", len(b)))
			}
		}()
		p := filepath.Join(dir, "f.vhd")
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		// A differencing disk's parent: not opened (as info without the
		// chain), so its locators and bitmaps are parsed and read.
		img, err := openVHD(t, p, Options{OpenParent: func(string) (formats.Image, string, error) { return nil, "", nil }})
		if err != nil || img.Size() > 64<<20 {
			return
		}
		readAllVHD(t, img)
		img.Close()
		writeAllVHD(t, p)
	})
}

// writeAllVHD opens the image at path writable, as a file that opened
// for reading: it is refused (a differencing disk; a fixed one whose
// footer is at its start) or takes a write over the whole disk, after
// which it opens again and reads it back: no metadata went into data,
// nor data into metadata.
func writeAllVHD(t *testing.T, path string) {
	f, err := aio.Open(path, aio.Options{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	img, err := New(context.Background(), f, Options{Writable: true})
	if err != nil {
		if !errors.Is(err, formats.ErrReadOnly) && !errors.Is(err, ErrUnsupported) {
			t.Fatalf("opens for reading, refused for writing: %v", err)
		}
		return
	}
	img.SetNoFlush(true) // a killed process keeps what it wrote; syncs only slow the fuzzer
	ctx := context.Background()
	data := bytes.Repeat([]byte{0x3c}, int(img.Size()))
	_, werr := img.WriteAt(ctx, data, 0)
	img.Close()
	if werr != nil {
		// The file's end is past what a 32-bit BAT entry names: the
		// write is refused, nothing referenced changed.
		if !errors.Is(werr, unix.EFBIG) {
			t.Fatalf("write over the disk: %v", werr)
		}
		return
	}
	back, err := openVHD(t, path, Options{})
	if err != nil {
		t.Fatalf("after a write over the disk it no longer opens: %v", err)
	}
	got := make([]byte, back.Size())
	if _, err := back.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("the disk written reads other bytes back (%v)", err)
	}
}

// qemuReads is the disk qemu-img 7.2 reads from the image at path (-f
// vpc), and whether it opens it at all. Without qemu-img the test skips.
func qemuReads(t *testing.T, path string) ([]byte, bool) {
	t.Helper()
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Fatal("qemu-img is needed: apt-get install -y qemu-utils")
	}
	out := filepath.Join(t.TempDir(), "qemu.raw")
	if msg, err := exec.Command("qemu-img", "convert", "-f", "vpc", "-O", "raw", path, out).CombinedOutput(); err != nil {
		t.Logf("qemu-img: %s", bytes.TrimSpace(msg))
		return nil, false
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return b, true
}
