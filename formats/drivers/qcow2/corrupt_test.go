package qcow2

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// patch rewrites bytes of a file in place.
func patch(t *testing.T, path string, off int64, b []byte) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

func be64(v uint64) []byte { return binary.BigEndian.AppendUint64(nil, v) }
func be32(v uint32) []byte { return binary.BigEndian.AppendUint32(nil, v) }

// TestCorruptImagesGiveClearErrors: each corruption is refused at open or
// at the read that meets it, with an error saying what is wrong; never a
// panic, a hang or a huge allocation.
func TestCorruptImagesGiveClearErrors(t *testing.T) {
	base := func(t *testing.T) string {
		p := filepath.Join(t.TempDir(), "x.qcow2")
		tool(t, "qemu-img", "create", "-q", "-f", "qcow2", p, "4M")
		qio(t, p, "write -P 1 0 128k")
		return p
	}
	cases := []struct {
		name   string
		break_ func(t *testing.T, p string)
		atRead bool // the error shows at the first read, not at open
		want   string
	}{
		{"truncated header", func(t *testing.T, p string) { os.Truncate(p, 50) }, false, "too short"},
		{"bad magic", func(t *testing.T, p string) { patch(t, p, 0, []byte("QFIX")) }, false, "magic"},
		{"version 4", func(t *testing.T, p string) { patch(t, p, 4, be32(4)) }, false, "version 4"},
		{"cluster bits 30", func(t *testing.T, p string) { patch(t, p, 20, be32(30)) }, false, "cluster size"},
		{"absurd size", func(t *testing.T, p string) { patch(t, p, 24, be64(1<<62)) }, false, "absurd"},
		{"L1 too small for the size", func(t *testing.T, p string) { patch(t, p, 24, be64(1<<40)) }, false, "L1 table has"},
		{"L1 past EOF", func(t *testing.T, p string) { patch(t, p, 40, be64(1<<40)) }, false, "L1 table at"},
		{"huge L1", func(t *testing.T, p string) { patch(t, p, 36, be32(1<<30)) }, false, "too large"},
		{"encrypted", func(t *testing.T, p string) { patch(t, p, 32, be32(1)) }, false, "encryption"},
		{"unknown incompatible feature", func(t *testing.T, p string) { patch(t, p, 72, be64(1<<9)) }, false, "bit 9"},
		{"extended L2", func(t *testing.T, p string) { patch(t, p, 72, be64(1<<4)) }, false, "extended L2"},
		{"external data file", func(t *testing.T, p string) { patch(t, p, 72, be64(1<<2)) }, false, "external data file"},
		{"refcount table garbage", func(t *testing.T, p string) { patch(t, p, 48, be64(0xdeadbeef000)) }, false, "refcount table"},
		{"L2 table past EOF", func(t *testing.T, p string) {
			var hdr [48]byte
			f, _ := os.Open(p)
			f.ReadAt(hdr[:], 0)
			f.Close()
			l1 := binary.BigEndian.Uint64(hdr[40:])
			patch(t, p, int64(l1), be64(1<<40|1<<63))
		}, true, "L2 table at"},
		{"backing file missing", func(t *testing.T, p string) {
			tool(t, "qemu-img", "rebase", "-u", "-f", "qcow2", "-b", "nothere.qcow2", "-F", "qcow2", p)
		}, false, "nothere.qcow2"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := base(t)
			c.break_(t, p)
			q, err := openTest(p, testOpts{})
			if c.atRead && err == nil {
				defer q.Close()
				_, err = q.ReadAt(context.Background(), make([]byte, 4096), 0)
			}
			if err == nil {
				t.Fatal("no error")
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %q does not say %q", err, c.want)
			}
			if !c.atRead && q != nil {
				t.Fatal("Open returned an image with an error")
			}
		})
	}
}

// FuzzOpen feeds mutated real images to the parser and the read paths:
// errors are fine, panics, hangs and huge allocations are not. Seeds are
// small qemu-img images in testdata/seeds.
func FuzzOpen(f *testing.F) {
	seeds, _ := filepath.Glob("testdata/seeds/*.qcow2")
	for _, s := range seeds {
		b, err := os.ReadFile(s)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, b []byte) {
		// The fuzzer has no per-input timeout; a hang is a failure here.
		done := make(chan struct{})
		defer close(done)
		go func() {
			select {
			case <-done:
			case <-time.After(5 * time.Second):
				buf := make([]byte, 1<<20)
				n := runtime.Stack(buf, true)
				panic(fmt.Sprintf("input hangs for 5s:\n%s", buf[:n]))
			}
		}()
		p := filepath.Join(dir, "fuzz.qcow2")
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		q, err := openTest(p, testOpts{Backend: "threads"})
		if err != nil {
			return
		}
		defer q.Close()
		ctx := context.Background()
		buf := make([]byte, 64<<10)
		for off, i := int64(0), 0; off < q.Size() && i < 64; i++ {
			n := min(int64(len(buf)), q.Size()-off)
			_, err := q.ReadAt(ctx, buf[:n], off)
			// What is lent (a cluster at a time) is what a read of that
			// cluster reads, and nothing such a read refuses.
			for c := off; c < off+n; {
				k := min(off+n, (c/q.h.clusterSize+1)*q.h.clusterSize) - c
				if v, ok := q.TryLendAt(c, k, nil); ok {
					cb := make([]byte, k)
					if _, cerr := q.ReadAt(ctx, cb, c); cerr != nil || !bytes.Equal(bytes.Join(v, nil), cb) {
						t.Fatalf("lent [%d, +%d) where a read says %v, or other bytes", c, k, cerr)
					}
				}
				c += k
			}
			if err != nil {
				break
			}
			off += n
		}
		for off, i := int64(0), 0; off < q.Size() && i < 1000; i++ {
			e, err := q.Extent(ctx, off, q.Size()-off)
			if err != nil {
				break
			}
			if e.Length <= 0 || e.Start != off {
				t.Fatalf("extent at %d: %+v", off, e)
			}
			off += e.Length
		}
		// The write paths on the same input: allocation, copy-on-write,
		// zeroing, resize and write-back must fail cleanly too.
		w, err := openTest(p, testOpts{Backend: "threads", Writable: true})
		if err != nil {
			return
		}
		func() {
			size := w.Size()
			for i, off := range []int64{0, size / 3, size - 1, size / 2} {
				if off < 0 || off >= size {
					continue
				}
				n := min(int64(len(buf)>>i), size-off)
				if _, err := w.WriteAt(ctx, buf[:n], off); err != nil {
					return
				}
			}
			if w.WriteZeroes(ctx, 0, min(size, 1<<20), true) != nil || w.Discard(ctx, size/2, size-size/2) != nil {
				return
			}
			if w.Resize(ctx, size+1<<20) == nil {
				w.Flush(ctx)
			}
		}()
		// Whatever the writes met, they never land on metadata: the image
		// still opens (marked corrupt, at worst).
		if err := w.Close(); err != nil {
			return
		}
		r, err := openTest(p, testOpts{Backend: "threads"})
		if err != nil {
			t.Fatalf("the image opened before the writes, not after: %v", err)
		}
		r.Close()
	})
}
