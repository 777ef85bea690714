package vdi

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats/internal/driver"
)

// vdiSpec describes a crafted image: header fields and the block map.
type vdiSpec struct {
	diskSize        uint64
	blocksInImage   uint32
	blocksAllocated uint32
	offBmap         uint32
	offData         uint32
	blockSize       uint32
	sectorSize      uint32
	version         uint32
	imageType       uint32
	bmap            []uint32
	fileSize        int64 // 0: just past the last allocated block
}

// goodSpec is a 3 MiB dynamic image: block 0 at data block 1, block 1
// unallocated, block 2 discarded... and data block 0 used by block 2's
// neighbour; see the test for the data.
func goodSpec() vdiSpec {
	return vdiSpec{diskSize: 4 << 20, blocksInImage: 4, blocksAllocated: 2, offBmap: 512, offData: 1024,
		blockSize: blockSize, sectorSize: 512, version: version11, imageType: 1,
		bmap: []uint32{1, unallocated, 0, discarded}}
}

// build writes the image to a file; data block k holds byte k+1 everywhere.
func (s vdiSpec) build(t testing.TB) string {
	h := make([]byte, 512)
	copy(h, "<<< crafted >>>\n")
	le := binary.LittleEndian
	le.PutUint32(h[64:], signature)
	le.PutUint32(h[68:], s.version)
	le.PutUint32(h[72:], 0x180)
	le.PutUint32(h[76:], s.imageType)
	le.PutUint32(h[offBmapField:], s.offBmap)
	le.PutUint32(h[offBmapField+4:], s.offData)
	le.PutUint32(h[offBmapField+20:], s.sectorSize)
	le.PutUint64(h[offBmapField+28:], s.diskSize)
	le.PutUint32(h[offBmapField+36:], s.blockSize)
	le.PutUint32(h[offBmapField+44:], s.blocksInImage)
	le.PutUint32(h[offBmapField+48:], s.blocksAllocated)
	p := filepath.Join(t.TempDir(), "c.vdi")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(h, 0); err != nil {
		t.Fatal(err)
	}
	m := make([]byte, 4*len(s.bmap))
	for i, e := range s.bmap {
		le.PutUint32(m[4*i:], e)
	}
	if _, err := f.WriteAt(m, int64(s.offBmap)); err != nil {
		t.Fatal(err)
	}
	end := int64(s.offBmap) + int64(len(m))
	for k := uint32(0); k < s.blocksAllocated && k < 64; k++ {
		off := int64(s.offData) + int64(k)*blockSize
		if _, err := f.WriteAt(bytes.Repeat([]byte{byte(k + 1)}, blockSize), off); err != nil {
			t.Fatal(err)
		}
		end = max(end, off+blockSize)
	}
	if s.fileSize != 0 {
		end = s.fileSize
	}
	if err := f.Truncate(end); err != nil {
		t.Fatal(err)
	}
	return p
}

func openPath(t testing.TB, p string) (*Image, error) {
	f, err := aio.Open(p, aio.Options{Backend: aio.Threads})
	if err != nil {
		t.Fatal(err)
	}
	img, err := New(context.Background(), f, Options{})
	if err == nil {
		t.Cleanup(func() { img.Close() })
	}
	return img, err
}

func TestVDIReadsBlocksThroughTheMap(t *testing.T) {
	img, err := openPath(t, goodSpec().build(t))
	if err != nil {
		t.Fatal(err)
	}
	want := [][]byte{bytes.Repeat([]byte{2}, blockSize), make([]byte, blockSize), bytes.Repeat([]byte{1}, blockSize), make([]byte, blockSize)}
	got := make([]byte, 4*blockSize)
	if _, err := img.ReadAt(context.Background(), got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, bytes.Join(want, nil)) {
		t.Fatal("read across the blocks differs from the map's data")
	}
	// An unaligned read across a block boundary, and the fast path.
	p := make([]byte, 1000)
	if _, err := img.ReadAt(context.Background(), p, 2*blockSize-500); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(p, got[2*blockSize-500:2*blockSize+500]) {
		t.Fatal("unaligned read across blocks differs")
	}
	q := make([]byte, 1000)
	if img.TryReadAt(q, 2*blockSize-500) && !bytes.Equal(q, p) {
		t.Fatal("TryReadAt differs from ReadAt")
	}
	e, err := img.Extent(context.Background(), 0, img.Size())
	if err != nil || !e.Data || e.Zero || e.Length != blockSize || e.Offset != 1024+blockSize {
		t.Fatalf("extent of block 0: %+v %v", e, err)
	}
	e, err = img.Extent(context.Background(), blockSize, img.Size())
	if err != nil || e.Data || !e.Zero || !e.Present || e.Length != blockSize {
		t.Fatalf("extent of block 1: %+v %v", e, err)
	}
	if _, err := img.WriteAt(context.Background(), p, 0); err == nil {
		t.Fatal("a write succeeded on a read-only format")
	}
	if i := img.Info(); i.Format != "vdi" || i.ClusterSize != blockSize || i.VirtualSize != 4<<20 || i.FormatSpecific != nil {
		t.Fatalf("info %+v", i)
	}
}

// TestVDIHostileHeadersAndMaps: each field at 0, its maximum and one past
// it; block-map entries past the end, at the header, duplicated. Each is
// refused with one line or opens and reads only what it describes.
// Differential: each file is also read by qemu-img 7.2; what opens here
// must open there and read the same bytes, and what QEMU reads but is
// refused here is logged (the cases where QEMU serves wrong data).
func TestVDIHostileHeadersAndMaps(t *testing.T) {
	for _, c := range hostileCases() {
		t.Run(c.name, func(t *testing.T) {
			s := goodSpec()
			c.mod(&s)
			path := s.build(t)
			img, err := openPath(t, path)
			var qemu []byte
			qemuOK := false
			if c.name != "disk size at the max" { // QEMU reads a 2 GiB map for it (16 s), only to fail
				qemu, qemuOK = qemuReads(t, path)
			}
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
			readAll(t, img)
			got := make([]byte, img.Size())
			if _, err := img.ReadAt(context.Background(), got, 0); err != nil {
				t.Fatal(err)
			}
			if c.qemuRefuses {
				// Read as the spec says: data block k holds k+1.
				want := make([]byte, img.Size())
				for i, e := range s.bmap {
					for j := int64(i) * blockSize; j < min(int64(i+1)*blockSize, img.Size()) && e < discarded; j++ {
						want[j] = byte(e + 1)
					}
				}
				if qemuOK || !bytes.Equal(got, want) {
					t.Fatalf("qemu-img opens it: %v; reads as the map says: %v", qemuOK, bytes.Equal(got, want))
				}
				return
			}
			// Differential: what opens here reads as qemu-img reads it.
			if !qemuOK {
				t.Fatal("opens here, but qemu-img refuses it")
			}
			if !bytes.Equal(got, qemu) {
				t.Fatal("reads differ from qemu-img's")
			}
		})
	}
}

// hostileCase is a crafted image: what the good one becomes, and how an
// open ends.
type hostileCase struct {
	name string
	mod  func(*vdiSpec)
	want error // nil: opens
	// qemuRefuses: it opens here, QEMU 7.2 refuses it (data at an
	// unaligned offset, as xmount writes it).
	qemuRefuses bool
}

// hostileCases are the crafted images the reader and the writer are
// opened on.
func hostileCases() []hostileCase {
	type tc = hostileCase
	return []tc{
		{"good", func(*vdiSpec) {}, nil, false},
		{"disk size 0", func(s *vdiSpec) { s.diskSize = 0 }, nil, false},
		{"disk size odd rounds up", func(s *vdiSpec) { s.diskSize = 4<<20 - 700 }, nil, false},
		{"disk size at the max", func(s *vdiSpec) { s.diskSize = maxDiskSize; s.blocksInImage = maxBlocks }, ErrCorrupt, false}, // its map would be past the end
		{"disk size past the max", func(s *vdiSpec) { s.diskSize = maxDiskSize + 1; s.blocksInImage = maxBlocks }, ErrUnsupported, false},
		{"disk size 2^64-1", func(s *vdiSpec) { s.diskSize = 1<<64 - 1 }, ErrUnsupported, false},
		{"disk size over the map", func(s *vdiSpec) { s.diskSize = 4<<20 + 512 }, ErrUnsupported, false},
		{"blocks in image 0", func(s *vdiSpec) { s.blocksInImage = 0 }, ErrUnsupported, false},
		{"blocks in image 0, size 0", func(s *vdiSpec) { s.blocksInImage = 0; s.diskSize = 0 }, nil, false},
		{"blocks in image max", func(s *vdiSpec) { s.blocksInImage = maxBlocks }, nil, false},
		{"blocks in image max+1", func(s *vdiSpec) { s.blocksInImage = maxBlocks + 1 }, ErrUnsupported, false},
		{"blocks in image 2^32-1", func(s *vdiSpec) { s.blocksInImage = 1<<32 - 1 }, ErrUnsupported, false},
		{"block size 0", func(s *vdiSpec) { s.blockSize = 0 }, ErrUnsupported, false},
		{"block size 2 MiB", func(s *vdiSpec) { s.blockSize = 2 << 20 }, ErrUnsupported, false},
		{"block size 1 MiB+1", func(s *vdiSpec) { s.blockSize = blockSize + 1 }, ErrUnsupported, false},
		{"block size 2^32-1", func(s *vdiSpec) { s.blockSize = 1<<32 - 1 }, ErrUnsupported, false},
		{"sector size 0", func(s *vdiSpec) { s.sectorSize = 0 }, ErrUnsupported, false},
		{"sector size 4096", func(s *vdiSpec) { s.sectorSize = 4096 }, ErrUnsupported, false},
		{"version 0", func(s *vdiSpec) { s.version = 0 }, ErrUnsupported, false},
		{"version 1.2", func(s *vdiSpec) { s.version = version11 + 1 }, ErrUnsupported, false},
		{"version max", func(s *vdiSpec) { s.version = 1<<32 - 1 }, ErrUnsupported, false},
		{"image type 0", func(s *vdiSpec) { s.imageType = 0 }, nil, false},
		{"image type max", func(s *vdiSpec) { s.imageType = 1<<32 - 1 }, nil, false},
		{"bmap offset 0 (the header)", func(s *vdiSpec) { s.offBmap = 0; s.offData = 1024 }, ErrCorrupt, false},
		{"bmap offset unaligned", func(s *vdiSpec) { s.offBmap = 513 }, ErrUnsupported, false},
		{"bmap offset max", func(s *vdiSpec) { s.offBmap = 1<<32 - 512; s.fileSize = 3<<20 + 1024 }, ErrCorrupt, false},
		{"bmap past the end", func(s *vdiSpec) { s.fileSize = 514 }, ErrCorrupt, false},
		{"data offset 0 (over header and map)", func(s *vdiSpec) { s.offData = 0 }, ErrCorrupt, false},
		{"data offset unaligned", func(s *vdiSpec) { s.offData = 1025 }, nil, true},
		{"data right after the map", func(s *vdiSpec) { s.offData = 512 + 16 }, nil, true},
		{"data inside the map", func(s *vdiSpec) { s.offData = 512 + 12 }, ErrCorrupt, false},
		{"data offset max", func(s *vdiSpec) { s.offData = 1<<32 - 512 }, nil, false},
		{"entry past blocks allocated", func(s *vdiSpec) { s.bmap[1] = 2 }, ErrCorrupt, false},
		{"entry 2^32-3", func(s *vdiSpec) { s.bmap[1] = 1<<32 - 3; s.blocksAllocated = 1<<32 - 1 }, ErrCorrupt, false},
		{"entry past the end of the file", func(s *vdiSpec) { s.blocksAllocated = 3; s.bmap[1] = 2; s.fileSize = 1024 + 2*blockSize }, ErrCorrupt, false},
		{"last block cut short", func(s *vdiSpec) { s.fileSize = 1024 + 2*blockSize - 1 }, ErrCorrupt, false},
		{"duplicate entries", func(s *vdiSpec) { s.bmap[2] = 1 }, ErrCorrupt, false},
		{"blocks allocated 0 with entries", func(s *vdiSpec) { s.blocksAllocated = 0 }, ErrCorrupt, false},
		{"all discarded", func(s *vdiSpec) { s.bmap = []uint32{discarded, discarded, discarded, discarded} }, nil, false},
		{"short file", func(s *vdiSpec) { s.fileSize = 392 }, ErrCorrupt, false}, // every field, no UUIDs
	}
}

// readAll reads and maps the whole image in 1 MiB steps (it must not fail).
func readAll(t testing.TB, img *Image) {
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
		if _, err := img.Extent(ctx, off, n); err != nil {
			t.Fatalf("extent at %d: %v", off, err)
		}
	}
}

// FuzzOpen: any file opens or is refused without a panic or a hang, and
// what opens reads and maps to its end.
func FuzzOpen(f *testing.F) {
	for _, s := range []vdiSpec{goodSpec(), {diskSize: 1 << 62, blocksInImage: maxBlocks, blocksAllocated: 1<<32 - 1,
		offBmap: 512, offData: 1<<32 - 512, blockSize: blockSize, sectorSize: 512, version: version11, bmap: []uint32{1<<31 + 5, 0}},
		// Opens: one 512-byte block of data, and a map of holes.
		{diskSize: 512, blocksInImage: 1, blocksAllocated: 1, offBmap: 512, offData: 1024, blockSize: blockSize,
			sectorSize: 512, version: version11, bmap: []uint32{0}, fileSize: 1536},
		{diskSize: 3 << 20, blocksInImage: 3, offBmap: 512, offData: 1024, blockSize: blockSize,
			sectorSize: 512, version: version11, imageType: typeStatic, bmap: []uint32{discarded, unallocated, discarded}},
	} {
		// Keep seeds small: the header and map, and a little data.
		fd, err := os.Open(s.build(f))
		if err != nil {
			f.Fatal(err)
		}
		b := make([]byte, 4096)
		n, _ := fd.ReadAt(b, 0)
		fd.Close()
		f.Add(b[:n])
	}
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, b []byte) {
		done := make(chan struct{})
		defer close(done)
		go func() {
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				panic(fmt.Sprintf("vdi open hangs on %d bytes", len(b)))
			}
		}()
		p := filepath.Join(dir, "f.vdi")
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		cf, err := aio.Open(p, aio.Options{Backend: aio.Threads})
		if err != nil {
			t.Fatal(err)
		}
		// The check reads the same bytes as QEMU does, unchecked by the
		// reader: no panic, no hang (a header's 2^29 blocks included).
		if res, err := Check(context.Background(), cf, driver.Options{}, driver.RepairNone); err == nil && res.Corruptions < 0 {
			t.Fatalf("check: %d corruptions", res.Corruptions)
		}
		img, err := openPath(t, p)
		if err != nil {
			return
		}
		if img.Size() > 64<<20 {
			return // a sparse disk this big takes long to read; its map was checked
		}
		readAll(t, img)
		fuzzWrite(t, p, img)
	})
}

// fuzzWrite opens what opened read-only for writing too: it is refused
// in one line or takes a write in each block that reads back, with the
// reader's view of the other bytes unchanged.
func fuzzWrite(t *testing.T, p string, ro *Image) {
	ctx := context.Background()
	want := make([]byte, ro.Size())
	if _, err := ro.ReadAt(ctx, want, 0); err != nil {
		t.Fatal(err)
	}
	f, err := aio.Open(p, aio.Options{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	img, err := New(ctx, f, Options{Writable: true})
	if err != nil {
		if strings.Contains(err.Error(), "\n") {
			t.Fatalf("refusal is not one line: %q", err)
		}
		return
	}
	defer img.Close()
	img.SetNoFlush(true) // syncs are what make it slow, not what is fuzzed
	for off := int64(0); off < img.Size() && off < 8*blockSize; off += blockSize {
		n := min(512, img.Size()-off)
		b := bytes.Repeat([]byte{0xf5}, int(n))
		if _, err := img.WriteAt(ctx, b, off); err != nil {
			if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EFBIG) {
				return // leaked blocks filling the map; a file past the host's limit
			}
			t.Fatalf("write at %d: %v", off, err)
		}
		copy(want[off:], b)
	}
	got := make([]byte, img.Size())
	if _, err := img.ReadAt(ctx, got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("after the writes the image reads differently from what was written over what was read")
	}
}

// qemuReads is the disk qemu-img 7.2 reads from the image at path (-f
// vdi), and whether it opens it at all. Without qemu-img the test skips.
func qemuReads(t *testing.T, path string) ([]byte, bool) {
	t.Helper()
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Fatal("qemu-img is needed: apt-get install -y qemu-utils")
	}
	out := filepath.Join(t.TempDir(), "qemu.raw")
	if msg, err := exec.Command("qemu-img", "convert", "-f", "vdi", "-O", "raw", path, out).CombinedOutput(); err != nil {
		t.Logf("qemu-img: %s", bytes.TrimSpace(msg))
		return nil, false
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return b, true
}
