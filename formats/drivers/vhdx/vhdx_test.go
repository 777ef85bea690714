package vhdx

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
)

// spec describes a crafted image laid out as qemu-img lays one out: the
// header section, a 1 MiB log at 1 MiB, metadata at 2 MiB, the BAT at
// 3 MiB and payload blocks from 4 MiB.
type spec struct {
	virtualSize   uint64
	blockSize     uint32
	logicalSector uint32
	physSector    uint32
	fileFlags     uint32
	bat           []uint64 // raw BAT entries, written as given
	blocks        map[uint64]byte
	seq           [2]uint64
	logGUID       [16]byte
	batOffset     uint64
	batLength     uint32
	metaOffset    uint64
	extraRegions  [][32]byte
	extraMeta     [][32]byte
	skipMeta      [16]byte
	fileSize      int64 // 0: just past the last block written
	dataWriteGUID [16]byte
	raw           map[uint64][]byte // written last, at these offsets
}

const (
	logOff   = 1 * mib
	metaOff  = 2 * mib
	batOff   = 3 * mib
	dataBase = 4 * mib
)

// goodSpec: an 8 MiB disk of 1 MiB blocks; block 0 present at 4 MiB
// (filled with 0xA1), block 1 present at 5 MiB (0xB2), block 2 ZERO,
// block 3 UNMAPPED, the rest NOT_PRESENT.
func goodSpec() spec {
	return spec{virtualSize: 8 * mib, blockSize: mib, logicalSector: 512, physSector: 4096,
		bat:    []uint64{dataBase | blockFullyPresent, (dataBase + mib) | blockFullyPresent, blockZero, blockUnmapped},
		blocks: map[uint64]byte{dataBase: 0xA1, dataBase + mib: 0xB2},
		seq:    [2]uint64{1, 2}, batOffset: batOff, batLength: mib, metaOffset: metaOff}
}

func putCRC(b []byte) {
	binary.LittleEndian.PutUint32(b[4:], 0)
	binary.LittleEndian.PutUint32(b[4:], crc32.Checksum(b, castagnoli))
}

func (s spec) header(seq uint64) []byte {
	h := make([]byte, headerSize)
	copy(h, "head")
	binary.LittleEndian.PutUint64(h[8:], seq)
	copy(h[32:], s.dataWriteGUID[:])
	copy(h[48:], s.logGUID[:])
	binary.LittleEndian.PutUint16(h[66:], 1)
	binary.LittleEndian.PutUint32(h[68:], mib)
	binary.LittleEndian.PutUint64(h[72:], logOff)
	putCRC(h)
	return h
}

func regionEntry(guid [16]byte, off uint64, length, flags uint32) [32]byte {
	var e [32]byte
	copy(e[:], guid[:])
	binary.LittleEndian.PutUint64(e[16:], off)
	binary.LittleEndian.PutUint32(e[24:], length)
	binary.LittleEndian.PutUint32(e[28:], flags)
	return e
}

func metaEntry(guid [16]byte, off, length, flags uint32) [32]byte {
	var e [32]byte
	copy(e[:], guid[:])
	binary.LittleEndian.PutUint32(e[16:], off)
	binary.LittleEndian.PutUint32(e[20:], length)
	binary.LittleEndian.PutUint32(e[24:], flags)
	return e
}

func (s spec) bytes() []byte {
	end := max(int64(dataBase), s.fileSize)
	for off := range s.blocks {
		end = max(end, int64(off)+int64(s.blockSize))
	}
	img := make([]byte, end)
	copy(img, "vhdxfile")
	copy(img[header1Offset:], s.header(s.seq[0]))
	copy(img[header2Offset:], s.header(s.seq[1]))
	rt := make([]byte, regionSize)
	copy(rt, "regi")
	entries := append([][32]byte{regionEntry(guidBAT, s.batOffset, s.batLength, 1), regionEntry(guidMetadata, s.metaOffset, mib, 1)}, s.extraRegions...)
	binary.LittleEndian.PutUint32(rt[8:], uint32(len(entries)))
	for i, e := range entries {
		copy(rt[16+32*i:], e[:])
	}
	putCRC(rt)
	copy(img[region1Offset:], rt)
	copy(img[region2Offset:], rt)

	if s.metaOffset+mib <= uint64(len(img)) {
		m := img[s.metaOffset : s.metaOffset+mib]
		copy(m, "metadata")
		items := []struct {
			guid [16]byte
			val  []byte
		}{
			{guidFileParams, binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32(nil, s.blockSize), s.fileFlags)},
			{guidVirtualSize, binary.LittleEndian.AppendUint64(nil, s.virtualSize)},
			{guidPage83, bytes.Repeat([]byte{7}, 16)},
			{guidLogicalSector, binary.LittleEndian.AppendUint32(nil, s.logicalSector)},
			{guidPhysSector, binary.LittleEndian.AppendUint32(nil, s.physSector)},
		}
		var es [][32]byte
		at := uint32(metaTableSize)
		for _, it := range items {
			if it.guid == s.skipMeta {
				continue
			}
			es = append(es, metaEntry(it.guid, at, uint32(len(it.val)), 4))
			copy(m[at:], it.val)
			at += 4096
		}
		es = append(es, s.extraMeta...)
		binary.LittleEndian.PutUint16(m[10:], uint16(len(es)))
		for i, e := range es {
			copy(m[32+32*i:], e[:])
		}
	}
	if s.batOffset+8*uint64(len(s.bat)) <= uint64(len(img)) {
		for i, e := range s.bat {
			binary.LittleEndian.PutUint64(img[s.batOffset+8*uint64(i):], e)
		}
	}
	for off, v := range s.blocks {
		copy(img[off:off+uint64(s.blockSize)], bytes.Repeat([]byte{v}, int(s.blockSize)))
	}
	for off, v := range s.raw {
		copy(img[off:], v)
	}
	if s.fileSize > 0 {
		if s.fileSize < int64(len(img)) {
			img = img[:s.fileSize]
		} else {
			img = append(img, make([]byte, s.fileSize-int64(len(img)))...)
		}
	}
	return img
}

func openBytes(t testing.TB, b []byte) (*Image, error) {
	t.Helper()
	return openBytesWith(t, b, Options{})
}

// openBytesWith opens the image b with o.
func openBytesWith(t testing.TB, b []byte, o Options) (*Image, error) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "t.vhdx")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := aio.Open(path, aio.Options{Backend: aio.Threads})
	if err != nil {
		t.Fatal(err)
	}
	img, err := New(context.Background(), f, o)
	if err == nil {
		t.Cleanup(func() { img.Close() })
	}
	return img, err
}

func TestVhdxReadsEveryBlockState(t *testing.T) {
	img, err := openBytes(t, goodSpec().bytes())
	if err != nil {
		t.Fatal(err)
	}
	if img.Size() != 8*mib || img.blockSize != mib || img.logicalSector != 512 || img.physicalSector != 4096 {
		t.Fatalf("size %d block %d sectors %d/%d", img.Size(), img.blockSize, img.logicalSector, img.physicalSector)
	}
	buf := make([]byte, 8*mib)
	if _, err := img.ReadAt(context.Background(), buf, 0); err != nil {
		t.Fatal(err)
	}
	want := append(append(bytes.Repeat([]byte{0xA1}, mib), bytes.Repeat([]byte{0xB2}, mib)...), make([]byte, 6*mib)...)
	if !bytes.Equal(buf, want) {
		t.Fatal("read differs from the blocks")
	}
	// A read across the block boundary, through the fast path too.
	p := make([]byte, 8192)
	if !img.TryReadAt(p, mib-4096) && func() bool { _, err := img.ReadAt(context.Background(), p, mib-4096); return err != nil }() {
		t.Fatal("cross-block read failed")
	}
	if !bytes.Equal(p, want[mib-4096:mib+4096]) {
		t.Fatal("cross-block read differs")
	}
	var got []formats.Extent
	for off := int64(0); off < img.Size(); {
		e, err := img.Extent(context.Background(), off, img.Size()-off)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, e)
		off += e.Length
	}
	wantExt := []formats.Extent{
		{Start: 0, Length: 2 * mib, Data: true, Present: true, Offset: dataBase, HasOffset: true},
		{Start: 2 * mib, Length: mib, Zero: true, Present: true},
		{Start: 3 * mib, Length: 5 * mib, Zero: true},
	}
	if len(got) != len(wantExt) {
		t.Fatalf("extents %+v", got)
	}
	for i := range got {
		got[i].File = ""
		if got[i] != wantExt[i] {
			t.Fatalf("extent %d: %+v, want %+v", i, got[i], wantExt[i])
		}
	}
	if _, err := img.WriteAt(context.Background(), p, 0); !errors.Is(err, formats.ErrReadOnly) {
		t.Fatalf("write: %v", err)
	}
	if inf := img.Info(); inf.Format != "vhdx" || inf.ClusterSize != mib || inf.FormatSpecific != nil {
		t.Fatalf("info %+v", inf)
	}
}

// TestVhdxHeaders: the header with the higher sequence number wins, a
// header with a bad checksum is ignored, both bad is refused, and equal
// numbers on different headers are refused (QEMU's vhdx_parse_header).
func TestVhdxHeaders(t *testing.T) {
	s := goodSpec()
	s.seq = [2]uint64{5, 4}
	s.logGUID = [16]byte{1}
	b := s.bytes()
	// Header 1 (seq 5) names a log GUID with a valid entry, header 2 not:
	// which one is chosen shows in whether the log is found dirty.
	writeLogEntry(b, s.logGUID)
	h2 := spec{seq: s.seq}.header(4)
	copy(b[header2Offset:], h2)
	if _, err := openBytes(t, b); !errors.Is(err, ErrDirtyLog) {
		t.Fatalf("seq 5 over 4: %v (want the dirty log of header 1)", err)
	}
	// Break header 1's checksum: header 2 (clean) is used.
	b[header1Offset+100] ^= 1
	if _, err := openBytes(t, b); err != nil {
		t.Fatalf("bad header 1: %v", err)
	}
	// Both bad: refused.
	b[header2Offset+100] ^= 1
	if _, err := openBytes(t, b); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("both bad: %v", err)
	}
	// Equal sequence numbers, different headers: refused; identical: fine.
	s = goodSpec()
	s.seq = [2]uint64{3, 3}
	b = s.bytes()
	if _, err := openBytes(t, b); err != nil {
		t.Fatalf("identical headers: %v", err)
	}
	s.logGUID = [16]byte{9}
	copy(b[header1Offset:], s.header(3))
	if _, err := openBytes(t, b); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("equal seq, different headers: %v", err)
	}
	// Version 0 and 2: not a header.
	for _, v := range []uint16{0, 2} {
		b = goodSpec().bytes()
		for _, off := range []int{header1Offset, header2Offset} {
			binary.LittleEndian.PutUint16(b[off+66:], v)
			putCRC(b[off : off+headerSize])
		}
		if _, err := openBytes(t, b); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("version %d: %v", v, err)
		}
	}
}

// writeLogEntry writes one valid 4 KiB log entry at the start of the log.
func writeLogEntry(b []byte, guid [16]byte) {
	e := b[logOff : logOff+logSector]
	copy(e, "loge")
	binary.LittleEndian.PutUint32(e[8:], logSector)
	binary.LittleEndian.PutUint64(e[16:], 1)
	copy(e[32:], guid[:])
	putCRC(e)
}

func TestVhdxDirtyLogRefused(t *testing.T) {
	s := goodSpec()
	s.logGUID = [16]byte{0xde, 0xad}
	b := s.bytes()
	// A log GUID with no valid entry: nothing to replay, the image opens.
	if _, err := openBytes(t, b); err != nil {
		t.Fatalf("log GUID without entries: %v", err)
	}
	writeLogEntry(b, s.logGUID)
	_, err := openBytes(t, b)
	if !errors.Is(err, ErrDirtyLog) || !strings.Contains(err.Error(), "qemu-img check -r all") || strings.Contains(err.Error(), "\n") {
		t.Fatalf("dirty log: %v", err)
	}
	// An entry of another GUID, or with a bad checksum, is not one.
	b[logOff+100] ^= 1
	if _, err := openBytes(t, b); err != nil {
		t.Fatalf("entry with a bad checksum: %v", err)
	}
	// An entry that wraps around the end of the circular log counts.
	b = s.bytes()
	e := b[logOff+mib-logSector : logOff+mib]
	copy(e, "loge")
	binary.LittleEndian.PutUint32(e[8:], 2*logSector)
	binary.LittleEndian.PutUint64(e[16:], 7)
	copy(e[32:], s.logGUID[:])
	c := crc32.Update(0, castagnoli, e[:4])
	c = crc32.Update(c, castagnoli, []byte{0, 0, 0, 0})
	c = crc32.Update(c, castagnoli, e[8:])
	c = crc32.Update(c, castagnoli, b[logOff:logOff+logSector])
	binary.LittleEndian.PutUint32(e[4:], c)
	if _, err := openBytes(t, b); !errors.Is(err, ErrDirtyLog) {
		t.Fatalf("wrapping entry: %v", err)
	}
	// A log outside the file with a GUID set: refused.
	b = s.bytes()
	for _, off := range []int{header1Offset, header2Offset} {
		binary.LittleEndian.PutUint64(b[off+72:], 1<<40)
		putCRC(b[off : off+headerSize])
	}
	if _, err := openBytes(t, b); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("log past the end: %v", err)
	}
}

// TestVhdxHostile: each crafted file is refused with one line.
func TestVhdxHostile(t *testing.T) {
	for name, mutate := range hostileCases() {
		t.Run(name, func(t *testing.T) {
			s := goodSpec()
			b := mutate(&s)
			if b == nil {
				b = s.bytes()
			}
			img, err := openBytes(t, b)
			if err == nil {
				t.Fatalf("opened (size %d)", img.Size())
			}
			if strings.Contains(err.Error(), "\n") || !(errors.Is(err, ErrCorrupt) || errors.Is(err, ErrUnsupported)) {
				t.Fatalf("not one line of ErrCorrupt/ErrUnsupported: %v", err)
			}
		})
	}
}

// hostileCases are crafted files the reader refuses: each mutates a
// goodSpec, or returns the image bytes itself.
func hostileCases() map[string]func(*spec) []byte {
	return map[string]func(*spec) []byte{
		"block size 0":                 func(s *spec) []byte { s.blockSize = 0; return nil },
		"block size 256 MiB + 1":       func(s *spec) []byte { s.blockSize = 256<<20 + 1; s.blocks = nil; return nil },
		"block size 512 MiB":           func(s *spec) []byte { s.blockSize = 512 << 20; s.blocks = nil; return nil },
		"block size max":               func(s *spec) []byte { s.blockSize = math.MaxUint32; s.blocks = nil; return nil },
		"logical sector 0":             func(s *spec) []byte { s.logicalSector = 0; return nil },
		"logical sector 4097":          func(s *spec) []byte { s.logicalSector = 4097; return nil },
		"virtual size 64 TiB + 1":      func(s *spec) []byte { s.virtualSize = 64<<40 + 1; return nil },
		"virtual size max":             func(s *spec) []byte { s.virtualSize = math.MaxUint64; return nil },
		"BAT too small for the size":   func(s *spec) []byte { s.virtualSize = 1 << 40; return nil },
		"BAT region past the end":      func(s *spec) []byte { s.batOffset = 64 * mib; return nil },
		"BAT region offset max":        func(s *spec) []byte { s.batOffset = math.MaxUint64 &^ (mib - 1); return nil },
		"BAT region length 0":          func(s *spec) []byte { s.batLength = 0; return nil },
		"BAT region inside the header": func(s *spec) []byte { s.batOffset = 0; return nil },
		"BAT region on the log":        func(s *spec) []byte { s.batOffset = logOff; return nil },
		"BAT region on metadata":       func(s *spec) []byte { s.batOffset = metaOff; return nil },
		"metadata past the end":        func(s *spec) []byte { s.metaOffset = 64 * mib; return nil },
		"block past the end":           func(s *spec) []byte { s.bat[0] = 64*mib | blockFullyPresent; return nil },
		"block offset max":             func(s *spec) []byte { s.bat[0] = batOffsetMask | blockFullyPresent; return nil },
		"block in the header":          func(s *spec) []byte { s.bat[0] = 0 | blockFullyPresent; return nil },
		"block on the log":             func(s *spec) []byte { s.bat[0] = logOff | blockFullyPresent; return nil },
		"block on the BAT":             func(s *spec) []byte { s.bat[0] = batOff | blockFullyPresent; return nil },
		"block on the metadata":        func(s *spec) []byte { s.bat[0] = metaOff | blockFullyPresent; return nil },
		"two blocks at one offset":     func(s *spec) []byte { s.bat[1] = dataBase | blockFullyPresent; return nil },
		"block state 4":                func(s *spec) []byte { s.bat[2] = 4; return nil },
		"block state 5":                func(s *spec) []byte { s.bat[2] = 5; return nil },
		"partially present, no parent": func(s *spec) []byte { s.bat[1] = (dataBase + mib) | blockPartiallyPresent; return nil },
		"has parent":                   func(s *spec) []byte { s.fileFlags = 2; return nil },
		"has parent with locator": func(s *spec) []byte {
			s.fileFlags = 2
			s.extraMeta = [][32]byte{metaEntry(guidParentLocator, 0x20000, 64, 4)}
			return nil
		},
		"unknown required region": func(s *spec) []byte {
			s.extraRegions = [][32]byte{regionEntry([16]byte{1, 2, 3}, 6*mib, mib, 1)}
			s.fileSize = 7 * mib
			return nil
		},
		"region overlapping the BAT": func(s *spec) []byte {
			s.extraRegions = [][32]byte{regionEntry([16]byte{1, 2, 3}, batOff, mib, 0)}
			return nil
		},
		"second BAT region": func(s *spec) []byte {
			s.extraRegions = [][32]byte{regionEntry(guidBAT, 6*mib, mib, 1)}
			s.fileSize = 7 * mib
			return nil
		},
		"unknown required metadata": func(s *spec) []byte {
			s.extraMeta = [][32]byte{metaEntry([16]byte{4, 5}, 0x20000, 8, 4)}
			return nil
		},
		"metadata item past its region": func(s *spec) []byte {
			s.extraMeta = [][32]byte{metaEntry(guidFileParams, mib-4, 8, 4)}
			return nil
		},
		"metadata item offset max": func(s *spec) []byte {
			s.skipMeta = guidVirtualSize
			s.extraMeta = [][32]byte{metaEntry(guidVirtualSize, math.MaxUint32, 8, 4)}
			return nil
		},
		"metadata item inside the table": func(s *spec) []byte {
			s.skipMeta = guidVirtualSize
			s.extraMeta = [][32]byte{metaEntry(guidVirtualSize, 0, 8, 4)}
			return nil
		},
		"metadata item missing": func(s *spec) []byte { s.skipMeta = guidPage83; return nil },
		"truncated file":        func(s *spec) []byte { s.fileSize = dataBase + mib/2; return nil },
		"region tables both bad": func(s *spec) []byte {
			b := s.bytes()
			b[region1Offset+100] ^= 1
			b[region2Offset+100] ^= 1
			return b
		},
		"region count 2048": func(s *spec) []byte {
			b := s.bytes()
			for _, off := range []int{region1Offset, region2Offset} {
				binary.LittleEndian.PutUint32(b[off+8:], 2048)
				putCRC(b[off : off+regionSize])
			}
			return b
		},
		"metadata count max": func(s *spec) []byte {
			b := s.bytes()
			binary.LittleEndian.PutUint16(b[metaOff+10:], math.MaxUint16)
			return b
		},
		"no file identifier": func(s *spec) []byte { b := s.bytes(); b[0] = 'x'; return b },
	}
}

// qemuReads is the disk qemu-img 7.2 reads from the VHDX b (convert to
// raw), and whether it opens it at all. Without qemu-img the test skips.
func qemuReads(t *testing.T, b []byte) ([]byte, bool) {
	t.Helper()
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Fatal("qemu-img is needed: apt-get install -y qemu-utils")
	}
	dir := t.TempDir()
	in, out := filepath.Join(dir, "in.vhdx"), filepath.Join(dir, "out.raw")
	if err := os.WriteFile(in, b, 0o644); err != nil {
		t.Fatal(err)
	}
	if msg, err := exec.Command("qemu-img", "convert", "-f", "vhdx", "-O", "raw", in, out).CombinedOutput(); err != nil {
		t.Logf("qemu-img: %s", msg)
		return nil, false
	}
	got, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return got, true
}

// TestVhdxDifferentialWithQemu: every crafted file of small size that
// opens here opens in qemu-img 7.2 and reads the same bytes; of the
// hostile ones, those QEMU opens anyway are logged (it reads zeroes or
// other bytes for them where we refuse).
func TestVhdxDifferentialWithQemu(t *testing.T) {
	good := map[string]func(*spec){
		"good":                    func(*spec) {},
		"odd virtual size":        func(s *spec) { s.virtualSize = 8*mib + 1024 },
		"seq 2 over 9 (header 1)": func(s *spec) { s.seq = [2]uint64{9, 2} },
		"physical sector max":     func(s *spec) { s.physSector = math.MaxUint32 },
		// Not here, by design: 4096-byte logical sectors (QEMU 7.2 says
		// "not supported"; Hyper-V makes them, and they read here), and
		// a virtual size of 0 with a BAT of one MiB (QEMU computes the
		// BAT's entries in 32 bits, wants 2^32/chunk of them for size 0,
		// and so refuses; qemu-img create sizes the BAT to match).
	}
	for name, mutate := range good {
		t.Run(name, func(t *testing.T) {
			s := goodSpec()
			mutate(&s)
			b := s.bytes()
			img, err := openBytes(t, b)
			if err != nil {
				t.Fatal(err)
			}
			want, ok := qemuReads(t, b)
			if !ok {
				t.Fatal("opens here, but qemu-img refuses it")
			}
			got := make([]byte, img.Size())
			if _, err := img.ReadAt(context.Background(), got, 0); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("reads differ from qemu-img's (%d and %d bytes)", len(got), len(want))
			}
		})
	}
	var qemuOpens []string
	for name, mutate := range hostileCases() {
		s := goodSpec()
		b := mutate(&s)
		if b == nil {
			b = s.bytes()
		}
		if _, ok := qemuReads(t, b); ok {
			qemuOpens = append(qemuOpens, name)
		}
	}
	slices.Sort(qemuOpens)
	t.Logf("qemu-img 7.2 opens and reads these, which are refused here: %s", strings.Join(qemuOpens, "; "))
}

// TestVhdxLimits: the largest values that are valid open.
func TestVhdxLimits(t *testing.T) {
	for name, mutate := range map[string]func(*spec){
		"block size 256 MiB":  func(s *spec) { s.blockSize = 256 << 20; s.blocks = nil; s.bat = []uint64{blockZero} },
		"logical sector 4096": func(s *spec) { s.logicalSector = 4096 },
		"physical sector 0":   func(s *spec) { s.physSector = 0 },
		"physical sector max": func(s *spec) { s.physSector = math.MaxUint32 },
		"virtual size 64 TiB": func(s *spec) {
			s.virtualSize = 64 << 40
			s.blockSize = 256 << 20
			s.blocks = nil
			s.batLength = 3 * mib
			s.metaOffset = 6 * mib
			s.fileSize = 7 * mib
			s.bat = nil
		},
		"virtual size 0":          func(s *spec) { s.virtualSize = 0; s.bat = nil; s.blocks = nil },
		"odd virtual size":        func(s *spec) { s.virtualSize = 8*mib + 1000 },
		"region table 1 bad only": func(s *spec) {},
		// QEMU allows a last block that holds only the disk's bytes.
		"last block cut at the disk's end": func(s *spec) {
			s.virtualSize = mib + 4096
			s.bat = []uint64{blockZero, (dataBase + mib) | blockFullyPresent}
			s.fileSize = dataBase + mib + 4096
		},
	} {
		t.Run(name, func(t *testing.T) {
			s := goodSpec()
			mutate(&s)
			b := s.bytes()
			if name == "region table 1 bad only" {
				b[region1Offset+100] ^= 1
			}
			img, err := openBytes(t, b)
			if err != nil {
				t.Fatal(err)
			}
			if want := int64(s.virtualSize) &^ 511; img.Size() != want {
				t.Fatalf("size %d, want %d", img.Size(), want)
			}
			if s.fileSize == dataBase+mib+4096 { // the cut last block reads its bytes
				p := make([]byte, 4096)
				if _, err := img.ReadAt(context.Background(), p, mib); err != nil || !bytes.Equal(p, bytes.Repeat([]byte{0xB2}, 4096)) {
					t.Fatalf("read of the cut last block: %v", err)
				}
			}
		})
	}
}

// FuzzOpen: any image opens or is refused, without a panic or a hang;
// what opens reads and maps within its size. The fuzzer's bytes are
// spliced into a valid image where its metadata lies (the header section
// up to the second region table, the log's first sector, the metadata
// table and items, the BAT), so that mutations reach the parsers and the
// offset arithmetic rather than the payload; seeds put offsets near 2^63.
func FuzzOpen(f *testing.F) {
	base := goodSpec().bytes()
	const headLen = region2Offset + regionSize
	seed := func(b []byte) {
		f.Add(b[:headLen], b[logOff:logOff+logSector], b[metaOff:metaOff+0x20000+256], b[batOff:batOff+8*(chunkEntries+1)], int64(len(b)))
	}
	seed(base)
	s := goodSpec()
	s.bat[0] = 0x7FFFFFFFFFF00000 | blockFullyPresent
	s.bat[1] = blockPartiallyPresent
	seed(s.bytes())
	s = goodSpec()
	s.logGUID = [16]byte{1}
	b := s.bytes()
	writeLogEntry(b, s.logGUID)
	seed(b)
	s = goodSpec()
	s.batOffset = 1<<63 - mib
	s.virtualSize = 1<<63 - 1
	seed(s.bytes())
	s = diffChild(guidString(vhdxParentGUID))
	s.bat[chunkEntries] = (dataBase + 3*mib) | blockFullyPresent // inside base's file once grown
	seed(s.bytes())
	f.Fuzz(func(t *testing.T, head, log, meta, bat []byte, size int64) {
		img := append([]byte(nil), base...)
		if size < 0 || size > 8*mib {
			size = int64(len(img))
		}
		copy(img, head[:min(len(head), headLen)])
		copy(img[logOff:], log[:min(len(log), mib)])
		copy(img[metaOff:], meta[:min(len(meta), mib)])
		copy(img[batOff:], bat[:min(len(bat), mib)])
		if size < int64(len(img)) {
			img = img[:size]
		} else {
			img = append(img, make([]byte, size-int64(len(img)))...)
		}
		// A differencing image's parent is not opened (its sectors read
		// as zeroes), so that its locator, BAT and bitmaps are exercised.
		noParent := func(name string) (formats.Image, string, error) { return nil, name, nil }
		replayBytes(t, img)
		im, err := openBytesWith(t, img, Options{OpenParent: noParent})
		if err != nil {
			if strings.Contains(err.Error(), "\n") {
				t.Fatalf("refusal of more than one line: %v", err)
			}
			return
		}
		p := make([]byte, 4096)
		for off := int64(0); off < im.Size() && off < 16*mib; off += mib / 2 {
			n := min(int64(len(p)), im.Size()-off)
			if _, err := im.ReadAt(context.Background(), p[:n], off); err != nil {
				t.Fatalf("read at %d: %v", off, err)
			}
			if v, ok := im.TryLendAt(off, n, nil); ok && !bytes.Equal(bytes.Join(v, nil), p[:n]) {
				t.Fatalf("lent at %d: not what was read", off)
			}
			im.TryReadAt(p[:n], off)
			if _, err := im.Extent(context.Background(), off, im.Size()-off); err != nil {
				t.Fatal(err)
			}
		}
		writeBytesBack(t, img, Options{OpenParent: noParent})
	})
}

// writeBytesBack opens a copy of the image b (which opens read-only) for
// writing, writes a pattern into every half MiB of its first 16 MiB and
// closes it: the image then opens again, its log clean, and reads the
// pattern back (no metadata over data, no data over metadata). A
// refusal is one line and leaves the file untouched.
func writeBytesBack(t *testing.T, b []byte, o Options) {
	t.Helper()
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "w.vhdx")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := aio.Open(path, aio.Options{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	w, err := OpenWriter(ctx, f, o)
	if err != nil {
		if strings.Contains(err.Error(), "\n") {
			t.Fatalf("writable open: refusal of more than one line: %v", err)
		}
		if after, _ := os.ReadFile(path); !bytes.Equal(after, b) {
			t.Fatalf("writable open refused (%v), but the file changed", err)
		}
		return
	}
	pattern := bytes.Repeat([]byte{0x5a}, 700)
	var offs []int64
	for off := int64(300); off+int64(len(pattern)) <= w.Size() && off < 16*mib; off += mib / 2 {
		if _, err := w.WriteAt(ctx, pattern, off); err != nil {
			t.Fatalf("write at %d: %v", off, err)
		}
		offs = append(offs, off)
	}
	if err := w.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	after, _ := os.ReadFile(path)
	im, err := openBytesWith(t, after, o)
	if err != nil {
		t.Fatalf("open after the writes: %v", err)
	}
	p := make([]byte, len(pattern))
	for _, off := range offs {
		if _, err := im.ReadAt(ctx, p, off); err != nil || !bytes.Equal(p, pattern) {
			t.Fatalf("read back at %d: %v, not what was written", off, err)
		}
	}
}

// replayBytes replays the log of a copy of b: a refusal or nothing to
// replay leaves the file as it was; after a replay the log is clean (an
// open is never refused for its log).
func replayBytes(t *testing.T, b []byte) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "r.vhdx")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := aio.Open(path, aio.Options{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	replayed, err := Replay(context.Background(), f)
	f.Close()
	after, rerr := os.ReadFile(path)
	if rerr != nil {
		t.Fatal(rerr)
	}
	if !replayed {
		if !bytes.Equal(after, b) {
			t.Fatalf("no replay (%v), but the file changed", err)
		}
		if err != nil && strings.Contains(err.Error(), "\n") {
			t.Fatalf("refusal of more than one line: %v", err)
		}
		return
	}
	if _, err := openBytesWith(t, after, Options{OpenParent: func(n string) (formats.Image, string, error) { return nil, n, nil }}); errors.Is(err, ErrDirtyLog) {
		t.Fatalf("replayed, but the log is still dirty: %v", err)
	}
}

// dirtyImage is a small image whose log holds one entry: a data
// descriptor for the sector at target and a zero descriptor for the one
// after it (which holds 0xee bytes); ds is the entry's data sector.
func dirtyImage() ([]byte, uint64, []byte, []byte) {
	s := goodSpec()
	s.logGUID = [16]byte{0xde, 0xad}
	b := s.bytes()
	target := uint64(len(b)) - 2*logSector
	e := b[logOff : logOff+3*logSector]
	copy(e, "loge")
	le := binary.LittleEndian
	le.PutUint32(e[8:], 2*logSector)
	le.PutUint64(e[16:], 1)
	le.PutUint32(e[24:], 2)
	copy(e[32:], s.logGUID[:])
	d := e[64:]
	copy(d, "desc")
	copy(d[4:8], "TAIL")
	copy(d[8:16], "LEADING!")
	le.PutUint64(d[16:], target)
	le.PutUint64(d[24:], 1)
	z := e[96:]
	copy(z, "zero")
	le.PutUint64(z[8:], logSector)
	le.PutUint64(z[16:], target+logSector)
	le.PutUint64(z[24:], 1)
	ds := e[logSector:]
	copy(ds, "data")
	le.PutUint32(ds[4092:], 1)
	for i := 8; i < 4092; i++ {
		ds[i] = byte(i)
	}
	putCRC(e[:2*logSector])
	for i := target + logSector; i < target+2*logSector; i++ {
		b[i] = 0xee
	}
	return b, target, ds, e
}

// TestVhdxReplay: a crafted log of a data and a zero descriptor is
// replayed into the file, both headers get a zero log GUID and higher
// sequence numbers, and the image opens; a replay of a clean log or of
// an entry whose data sector is not its own changes nothing.
func TestVhdxReplay(t *testing.T) {
	b, target, ds, e := dirtyImage()
	le := binary.LittleEndian
	path := filepath.Join(t.TempDir(), "r.vhdx")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := aio.Open(path, aio.Options{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	replayed, err := Replay(context.Background(), f)
	if err != nil || !replayed {
		t.Fatalf("replay: %v %v", replayed, err)
	}
	got, _ := os.ReadFile(path)
	want := append(append([]byte("LEADING!"), ds[8:4092]...), "TAIL"...)
	if !bytes.Equal(got[target:target+logSector], want) || !bytes.Equal(got[target+logSector:target+2*logSector], make([]byte, logSector)) {
		t.Fatal("the data and zero descriptors were not written as logged")
	}
	for i, off := range []int{header1Offset, header2Offset} {
		h := got[off : off+headerSize]
		if !checksumOK(h) || !bytes.Equal(h[48:64], make([]byte, 16)) || le.Uint64(h[8:]) <= 1 {
			t.Fatalf("header %d after the replay: checksum %v, log GUID %x, sequence %d", i+1, checksumOK(h), h[48:64], le.Uint64(h[8:]))
		}
	}
	if _, err := openBytes(t, got); err != nil {
		t.Fatalf("open after the replay: %v", err)
	}
	// Nothing left to replay.
	if replayed, err := Replay(context.Background(), f); err != nil || replayed {
		t.Fatalf("second replay: %v %v", replayed, err)
	}
	// A data sector of another entry: refused, untouched.
	le.PutUint32(ds[4092:], 2)
	putCRC(e[:2*logSector])
	replayBytes(t, b)
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	if replayed, err := Replay(context.Background(), f); replayed || !errors.Is(err, ErrBadLog) {
		t.Fatalf("a data sector of sequence 2 in entry 1: %v %v, want ErrBadLog", replayed, err)
	}
}

// failingFile fails every write after the first left ones, as a crash
// would cut the replay there.
type failingFile struct {
	aio.File
	left int
}

func (f *failingFile) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	if f.left == 0 {
		return 0, errors.New("crash")
	}
	f.left--
	return f.File.WriteAt(ctx, p, off)
}

// TestVhdxReplayInterrupted: a replay cut after each of its writes (the
// data, the zeroes, the first header, the second), then replayed again,
// ends with the bytes an uncut replay leaves past the headers, and a
// clean log: the log stays dirty until a header without it is durable,
// and replaying it again writes the same bytes.
func TestVhdxReplayInterrupted(t *testing.T) {
	b, _, _, _ := dirtyImage()
	replay := func(path string, left int) (bool, error) {
		f, err := aio.Open(path, aio.Options{Backend: aio.Threads, Writable: true})
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		var file aio.File = f
		if left >= 0 {
			file = &failingFile{File: f, left: left}
		}
		return Replay(context.Background(), file)
	}
	dir := t.TempDir()
	ref := filepath.Join(dir, "ref.vhdx")
	os.WriteFile(ref, b, 0o644)
	if ok, err := replay(ref, -1); !ok || err != nil {
		t.Fatalf("uncut replay: %v %v", ok, err)
	}
	want, _ := os.ReadFile(ref)
	for left := 0; left < 4; left++ {
		p := filepath.Join(dir, "cut"+strconv.Itoa(left)+".vhdx")
		os.WriteFile(p, b, 0o644)
		if _, err := replay(p, left); err == nil {
			t.Fatalf("cut after %d writes: no error", left)
		}
		if _, err := replay(p, -1); err != nil {
			t.Fatalf("replay after a cut after %d writes: %v", left, err)
		}
		got, _ := os.ReadFile(p)
		if !bytes.Equal(got[headerSection:], want[headerSection:]) {
			t.Fatalf("cut after %d writes, then replayed: differs from an uncut replay", left)
		}
		if _, err := openBytes(t, got); err != nil {
			t.Fatalf("cut after %d writes, then replayed: %v", left, err)
		}
	}
}
