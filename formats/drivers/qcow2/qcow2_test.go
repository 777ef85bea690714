package qcow2

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/klauspost/compress/zstd"
	qcow2reader "github.com/lima-vm/go-qcow2reader"
	"github.com/lima-vm/go-qcow2reader/image"
	oracle "github.com/lima-vm/go-qcow2reader/image/qcow2"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
)

func tool(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// io runs qemu-io commands on an image.
func qio(t *testing.T, img string, cmds ...string) {
	t.Helper()
	args := []string{"-f", "qcow2"}
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	tool(t, "qemu-io", append(args, img)...)
}

type testImage struct {
	name string
	make func(t *testing.T, dir string) string // returns the top image
}

// writes puts a recognisable pattern at cluster boundaries and inside
// clusters, and zero clusters, on a 4 MiB image.
func writes(t *testing.T, img string, cs int) {
	qio(t, img,
		"write -P 0x11 0 4k",
		"write -P 0x22 "+strconv.Itoa(cs-512)+" 1k", // across the first cluster boundary
		"write -P 0x33 1M 300k",
		"write -P 0x44 3M 64k",
		"write -z 3M 4k",
		"write -P 0x55 4190208 4096", // the last 4 KiB
	)
}

func images() []testImage {
	var list []testImage
	for _, cs := range []int{512, 4096, 65536, 2 << 20} {
		list = append(list, testImage{"cluster" + strconv.Itoa(cs), func(t *testing.T, dir string) string {
			p := filepath.Join(dir, "c.qcow2")
			tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size="+strconv.Itoa(cs), p, "4M")
			writes(t, p, cs)
			return p
		}})
	}
	list = append(list,
		testImage{"compat0.10", func(t *testing.T, dir string) string {
			p := filepath.Join(dir, "v2.qcow2")
			tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "compat=0.10", p, "4M")
			qio(t, p, "write -P 0x66 12345 70000", "write -P 0x77 2M 1M")
			return p
		}},
		testImage{"preallocation=metadata", func(t *testing.T, dir string) string {
			p := filepath.Join(dir, "pre.qcow2")
			tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "preallocation=metadata", p, "4M")
			writes(t, p, 65536)
			return p
		}},
		testImage{"compressed zlib", func(t *testing.T, dir string) string { return compressedImage(t, dir, "zlib") }},
		testImage{"compressed zstd", func(t *testing.T, dir string) string { return compressedImage(t, dir, "zstd") }},
		testImage{"overlay on raw", func(t *testing.T, dir string) string {
			base := filepath.Join(dir, "base.raw")
			os.WriteFile(base, bytes.Repeat([]byte{0xbb}, 3<<20), 0o644) // shorter than the overlay
			p := filepath.Join(dir, "over.qcow2")
			tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw", p, "4M")
			writes(t, p, 65536)
			return p
		}},
		testImage{"3-deep chain", func(t *testing.T, dir string) string {
			a := filepath.Join(dir, "a.qcow2")
			tool(t, "qemu-img", "create", "-q", "-f", "qcow2", a, "4M")
			qio(t, a, "write -P 0xa1 0 2M")
			b := filepath.Join(dir, "b.qcow2")
			tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", "a.qcow2", "-F", "qcow2", b, "4M")
			qio(t, b, "write -P 0xb2 512k 1M", "write -z 1536k 64k")
			c := filepath.Join(dir, "c.qcow2")
			// No backing format: probed.
			tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", b, "-F", "qcow2", c, "4M")
			qio(t, c, "write -P 0xc3 1M 128k", "write -P 0xc4 3M 4k")
			return c
		}},
	)
	return list
}

func compressedImage(t *testing.T, dir, typ string) string {
	src := filepath.Join(dir, "src.raw")
	r := rand.New(rand.NewPCG(1, 2))
	data := make([]byte, 4<<20)
	for i := 0; i < len(data); i += 4096 {
		// Compressible but not constant.
		v := byte(r.Uint32())
		for j := i; j < i+4096; j++ {
			data[j] = v + byte(j%7)
		}
	}
	clear(data[2<<20 : 3<<20]) // a hole: stays unallocated
	os.WriteFile(src, data, 0o644)
	p := filepath.Join(dir, "comp-"+typ+".qcow2")
	tool(t, "qemu-img", "convert", "-c", "-f", "raw", "-O", "qcow2", "-o", "compression_type="+typ, src, p)
	return p
}

func reference(t *testing.T, img string) []byte {
	out := filepath.Join(t.TempDir(), "ref.raw")
	tool(t, "qemu-img", "convert", "-O", "raw", img, out)
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestReadsMatchQemuAndTheOracle(t *testing.T) {
	oracle.SetDecompressor(oracle.CompressionTypeZstd, func(r io.Reader) (io.ReadCloser, error) {
		d, err := zstd.NewReader(r)
		if err != nil {
			return nil, err
		}
		return d.IOReadCloser(), nil
	})
	for _, ti := range images() {
		t.Run(ti.name, func(t *testing.T) {
			dir := t.TempDir()
			top := ti.make(t, dir)
			want := reference(t, top)
			for _, backend := range []string{"io_uring", "threads", "io_uring+direct"} {
				// +direct: O_DIRECT (--cache none), where every byte-granular
				// read goes through an aligned bounce buffer.
				engine, direct := strings.CutSuffix(backend, "+direct")
				q, err := openTest(top, testOpts{Backend: aio.Backend(engine), Direct: direct})
				if err != nil {
					t.Fatal(err)
				}
				defer q.Close()
				if q.Size() != int64(len(want)) {
					t.Fatalf("size %d, want %d", q.Size(), len(want))
				}
				ctx := context.Background()
				// The whole image in one read, then random reads from
				// many goroutines across cluster boundaries.
				got := make([]byte, len(want))
				if _, err := q.ReadAt(ctx, got, 0); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, want) {
					t.Fatalf("%s: whole-image read differs from qemu-img convert", backend)
				}
				errs := make(chan error, 8)
				for g := 0; g < 8; g++ {
					go func(g int) {
						r := rand.New(rand.NewPCG(uint64(g), 9))
						buf := make([]byte, 300<<10)
						for i := 0; i < 100; i++ {
							n := 1 + r.IntN(len(buf))
							off := r.Int64N(int64(len(want) - n + 1))
							if i == 0 {
								off = int64(len(want) - n) // ends at EOF
							}
							if _, err := q.ReadAt(ctx, buf[:n], off); err != nil {
								errs <- err
								return
							}
							if !bytes.Equal(buf[:n], want[off:off+int64(n)]) {
								errs <- errors.New("random read differs at " + strconv.Itoa(int(off)))
								return
							}
						}
						errs <- nil
					}(g)
				}
				for g := 0; g < 8; g++ {
					if err := <-errs; err != nil {
						t.Fatal(err)
					}
				}
				if _, err := q.ReadAt(ctx, make([]byte, 1), q.Size()); !errors.Is(err, formats.ErrOutOfRange) {
					t.Fatalf("read past EOF: %v", err)
				}
			}
			// The independent oracle agrees.
			f, err := os.Open(top)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			o, err := qcow2reader.OpenWithType(f, image.Type("qcow2"))
			if err != nil {
				t.Fatal(err)
			}
			defer o.Close()
			if err := o.Readable(); err != nil {
				t.Fatal(err)
			}
			ob := make([]byte, len(want))
			if n, err := o.ReadAt(ob, 0); n != len(ob) || (err != nil && err != io.EOF) {
				t.Fatalf("oracle read: %d, %v", n, err)
			}
			if !bytes.Equal(ob, want) {
				t.Fatal("go-qcow2reader disagrees with qemu-img (oracle broken?)")
			}
		})
	}
}

// qemuMapEntry is one line of qemu-img map --output=json.
type qemuMapEntry struct {
	Start   int64  `json:"start"`
	Length  int64  `json:"length"`
	Depth   int    `json:"depth"`
	Present bool   `json:"present"`
	Zero    bool   `json:"zero"`
	Data    bool   `json:"data"`
	Offset  *int64 `json:"offset"`
}

func TestExtentsMatchQemuImgMap(t *testing.T) {
	for _, ti := range images() {
		t.Run(ti.name, func(t *testing.T) {
			dir := t.TempDir()
			top := ti.make(t, dir)
			var want []qemuMapEntry
			if err := json.Unmarshal([]byte(tool(t, "qemu-img", "map", "--output=json", top)), &want); err != nil {
				t.Fatal(err)
			}
			q, err := openTest(top, testOpts{})
			if err != nil {
				t.Fatal(err)
			}
			defer q.Close()
			var got []qemuMapEntry
			for off := int64(0); off < q.Size(); {
				e, err := q.Extent(context.Background(), off, q.Size()-off)
				if err != nil {
					t.Fatal(err)
				}
				m := qemuMapEntry{Start: e.Start, Length: e.Length, Depth: e.Depth, Present: e.Present, Zero: e.Zero, Data: e.Data}
				if e.HasOffset {
					o := e.Offset
					m.Offset = &o
				}
				got = mergeMap(got, m)
				off += e.Length
			}
			gj, _ := json.Marshal(got)
			wj, _ := json.Marshal(want)
			if string(gj) != string(wj) {
				t.Fatalf("map differs\n ours: %s\nqemu: %s", gj, wj)
			}
		})
	}
}

// mergeMap appends e, merging it into the last entry when qemu-img would.
func mergeMap(list []qemuMapEntry, e qemuMapEntry) []qemuMapEntry {
	if n := len(list); n > 0 {
		l := &list[n-1]
		if l.Depth == e.Depth && l.Present == e.Present && l.Zero == e.Zero && l.Data == e.Data &&
			(l.Offset == nil) == (e.Offset == nil) && (l.Offset == nil || *l.Offset+l.Length == *e.Offset) {
			l.Length += e.Length
			return list
		}
	}
	return append(list, e)
}

// TestHeaderExtensionsPastTheFirst64KiBOfALargeCluster: readHead reads
// 64 KiB first; a 2 MiB-cluster image whose backing file name lies past
// those 64 KiB (still in its first cluster, as QEMU allows) opens with
// that name, which a read of only the 64 KiB would have missed.
func TestHeaderExtensionsPastTheFirst64KiBOfALargeCluster(t *testing.T) {
	dir := t.TempDir()
	base, img := filepath.Join(dir, "base.qcow2"), filepath.Join(dir, "top.qcow2")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", base, "4M")
	qio(t, base, "write -P 0x5a 0 64k")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=2M", "-b", base, "-F", "qcow2", img)
	// Move the backing file name to 1 MiB into the first cluster.
	head := make([]byte, 2<<20)
	f, err := os.OpenFile(img, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.ReadAt(head, 0); err != nil {
		t.Fatal(err)
	}
	off := binary.BigEndian.Uint64(head[hdrBackingOffset:])
	n := binary.BigEndian.Uint32(head[hdrBackingSize:])
	copy(head[1<<20:], head[off:off+uint64(n)])
	binary.BigEndian.PutUint64(head[hdrBackingOffset:], 1<<20)
	if _, err := f.WriteAt(head, 0); err != nil {
		t.Fatal(err)
	}
	tool(t, "qemu-img", "check", img) // QEMU reads it so too
	q, err := openTest(img, testOpts{Backend: aio.Threads})
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	buf := make([]byte, 4096)
	if _, err := q.ReadAt(context.Background(), buf, 0); err != nil {
		t.Fatal(err)
	}
	if buf[0] != 0x5a || buf[4095] != 0x5a {
		t.Errorf("read %#x...%#x through the backing file, want 0x5a", buf[0], buf[4095])
	}
}
