package vhdx

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unicode/utf16"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
)

// locatorBytes builds a VHDX parent locator of the given pairs.
func locatorBytes(kv [][2]string) []byte {
	b := make([]byte, 20+12*len(kv))
	copy(b, guidParentVHDX[:])
	binary.LittleEndian.PutUint16(b[18:], uint16(len(kv)))
	u16 := func(s string) []byte {
		var out []byte
		for _, c := range utf16.Encode([]rune(s)) {
			out = binary.LittleEndian.AppendUint16(out, c)
		}
		return out
	}
	for i, p := range kv {
		k, v := u16(p[0]), u16(p[1])
		e := b[20+12*i:]
		binary.LittleEndian.PutUint32(e[0:], uint32(len(b)))
		binary.LittleEndian.PutUint16(e[8:], uint16(len(k)))
		b = append(b, k...)
		e = b[20+12*i:]
		binary.LittleEndian.PutUint32(e[4:], uint32(len(b)))
		binary.LittleEndian.PutUint16(e[10:], uint16(len(v)))
		b = append(b, v...)
	}
	return b
}

var (
	vhdxParentGUID = [16]byte{0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0xff, 0x01}
	// chunkEntries: with 1 MiB blocks and 512-byte sectors a chunk is
	// 4096 blocks, so the sector bitmap entry of chunk 0 is entry 4096.
	chunkEntries = 4096
)

// diffParent is goodSpec with block 4 present too (0xE5 at 6 MiB).
func diffParent() spec {
	s := goodSpec()
	s.dataWriteGUID = vhdxParentGUID
	s.bat = append(s.bat, (dataBase+2*mib)|blockFullyPresent)
	s.blocks[dataBase+2*mib] = 0xE5
	return s
}

// diffChild: block 0 present (0xC3), block 1 partially present (0xD4 in
// its first 8 sectors and sector 52; the rest the parent's 0xB2), block 2
// not present (the parent's ZERO), block 3 ZERO, block 4 not present (the
// parent's 0xE5), the rest not present. Its sector bitmap lies at 6 MiB.
func diffChild(link string, kv ...[2]string) spec {
	s := goodSpec()
	s.fileFlags = 2
	s.bat = make([]uint64, chunkEntries+1)
	s.bat[0] = dataBase | blockFullyPresent
	s.bat[1] = (dataBase + mib) | blockPartiallyPresent
	s.bat[3] = blockZero
	s.bat[chunkEntries] = (dataBase + 2*mib) | blockFullyPresent
	s.blocks = map[uint64]byte{dataBase: 0xC3, dataBase + mib: 0xD4, dataBase + 2*mib: 0}
	bm := make([]byte, 1024) // chunk sectors 2048.. are block 1's
	bm[2048/8] = 0xFF
	bm[(2048+52)/8] |= 1 << ((2048 + 52) % 8)
	if kv == nil {
		kv = [][2]string{{"parent_linkage", link}, {"relative_path", `.\parent.vhdx`}}
	}
	loc := locatorBytes(kv)
	s.extraMeta = [][32]byte{metaEntry(guidParentLocator, 0x20000, uint32(len(loc)), 4)}
	s.raw = map[uint64][]byte{dataBase + 2*mib: bm, metaOff + 0x20000: loc}
	return s
}

// openChain writes parent and child into one directory and opens the
// child with a parent opener of that directory.
func openChain(t *testing.T, parent, child []byte) (*Image, error) {
	t.Helper()
	dir := t.TempDir()
	for name, b := range map[string][]byte{"parent.vhdx": parent, "child.vhdx": child} {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	openFile := func(path string, o Options) (*Image, error) {
		f, err := aio.Open(path, aio.Options{Backend: aio.Threads})
		if err != nil {
			return nil, err
		}
		return New(context.Background(), f, o)
	}
	img, err := openFile(filepath.Join(dir, "child.vhdx"), Options{OpenParent: func(name string) (formats.Image, string, error) {
		p := filepath.Join(dir, name)
		img, err := openFile(p, Options{})
		if err != nil {
			return nil, p, err
		}
		return img, p, nil
	}})
	if err == nil {
		t.Cleanup(func() { img.Close() })
	}
	return img, err
}

func TestVhdxDifferencingReadsThroughTheParent(t *testing.T) {
	img, err := openChain(t, diffParent().bytes(), diffChild(guidString(vhdxParentGUID)).bytes())
	if err != nil {
		t.Fatal(err)
	}
	want := make([]byte, 8*mib)
	copy(want, bytes.Repeat([]byte{0xC3}, mib))
	copy(want[mib:], bytes.Repeat([]byte{0xB2}, mib))
	copy(want[mib:], bytes.Repeat([]byte{0xD4}, 8*512))
	copy(want[mib+52*512:], bytes.Repeat([]byte{0xD4}, 512))
	copy(want[4*mib:], bytes.Repeat([]byte{0xE5}, mib))
	got := make([]byte, 8*mib)
	if _, err := img.ReadAt(context.Background(), got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("first difference at %d: %#x, want %#x", i, got[i], want[i])
			}
		}
	}
	// Unaligned reads across bitmap runs and block ends.
	for _, r := range [][2]int64{{mib + 4000, 300}, {mib + 52*512 - 7, 530}, {mib - 100, 5000}, {4*mib - 10, 20}} {
		p := make([]byte, r[1])
		if _, err := img.ReadAt(context.Background(), p, r[0]); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(p, want[r[0]:r[0]+r[1]]) {
			t.Fatalf("read [%d, +%d) differs", r[0], r[1])
		}
		if img.TryReadAt(p, r[0]) && !bytes.Equal(p, want[r[0]:r[0]+r[1]]) {
			t.Fatalf("try read [%d, +%d) differs", r[0], r[1])
		}
	}
	e, err := img.Extent(context.Background(), 4*mib, 4*mib)
	if err != nil {
		t.Fatal(err)
	}
	if !e.Data || e.Depth != 1 || e.Length != mib || e.Offset != dataBase+2*mib {
		t.Fatalf("extent of block 4 (the parent's): %+v", e)
	}
	if e, _ := img.Extent(context.Background(), mib, 7*mib); !e.Data || e.Depth != 0 || e.Length != mib {
		t.Fatalf("extent of the partial block: %+v", e)
	}
	if inf := img.Info(); !strings.HasSuffix(inf.BackingFilename, "parent.vhdx") || inf.BackingFilenameFormat != "vhdx" {
		t.Fatalf("info: %+v", inf)
	}
}

func TestVhdxDifferencingHostile(t *testing.T) {
	parent := diffParent().bytes()
	link := guidString(vhdxParentGUID)
	for name, child := range map[string]func() spec{
		"parent changed (linkage)": func() spec { return diffChild("{00000000-0000-0000-0000-000000000000}") },
		"no parent_linkage":        func() spec { return diffChild("", [2]string{"relative_path", "parent.vhdx"}) },
		"no path":                  func() spec { return diffChild("", [2]string{"parent_linkage", link}) },
		"parent missing": func() spec {
			return diffChild("", [2]string{"parent_linkage", link}, [2]string{"relative_path", "gone.vhdx"})
		},
		"key twice": func() spec {
			return diffChild("", [2]string{"parent_linkage", link}, [2]string{"parent_linkage", link})
		},
		"partial without a bitmap": func() spec { s := diffChild(link); s.bat[chunkEntries] = 0; return s },
		"bitmap past the end":      func() spec { s := diffChild(link); s.bat[chunkEntries] = 64*mib | 6; return s },
		"bitmap on a block":        func() spec { s := diffChild(link); s.bat[chunkEntries] = dataBase | 6; return s },
		"bitmap on the BAT":        func() spec { s := diffChild(link); s.bat[chunkEntries] = batOff | 6; return s },
		"bitmap state 2":           func() spec { s := diffChild(link); s.bat[chunkEntries] = 2; return s },
		"locator string past it": func() spec {
			s := diffChild(link)
			loc := s.raw[metaOff+0x20000]
			binary.LittleEndian.PutUint32(loc[20+4:], 1<<31)
			return s
		},
		"locator count max": func() spec {
			s := diffChild(link)
			binary.LittleEndian.PutUint16(s.raw[metaOff+0x20000][18:], 0xFFFF)
			return s
		},
		"locator of another type": func() spec {
			s := diffChild(link)
			s.raw[metaOff+0x20000][0] ^= 1
			return s
		},
	} {
		t.Run(name, func(t *testing.T) {
			img, err := openChain(t, parent, child().bytes())
			if err == nil {
				t.Fatalf("opened (size %d)", img.Size())
			}
			if strings.Contains(err.Error(), "\n") {
				t.Fatalf("more than one line: %v", err)
			}
			t.Log(err)
		})
	}
	// The linkage may also be the parent's parent_linkage2, in any case.
	s := diffChild("", [2]string{"parent_linkage", "{x}"}, [2]string{"parent_linkage2", strings.ToUpper(link)}, [2]string{"relative_path", "parent.vhdx"})
	if _, err := openChain(t, parent, s.bytes()); err != nil {
		t.Fatalf("parent_linkage2: %v", err)
	}
	if !errors.Is(func() error { _, err := openBytes(t, diffChild(link).bytes()); return err }(), ErrUnsupported) {
		t.Fatal("a differencing image without a parent opener is not refused as unsupported")
	}
}
