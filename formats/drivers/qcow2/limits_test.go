package qcow2

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/aio"
)

// openWithin opens p and fails the test if that takes longer than d: the
// images here once hung an open or ran it for minutes.
func openWithin(t *testing.T, p string, d time.Duration) (*Image, error) {
	t.Helper()
	type result struct {
		q   *Image
		err error
	}
	done := make(chan result, 1)
	go func() {
		q, err := openTest(p, testOpts{Backend: aio.Threads})
		done <- result{q, err}
	}()
	select {
	case r := <-done:
		if r.q != nil {
			t.Cleanup(func() { r.q.Close() })
		}
		return r.q, r.err
	case <-time.After(d):
		t.Fatalf("opening %s did not finish in %v", filepath.Base(p), d)
		return nil, nil
	}
}

func fileHead(t *testing.T, p string) []byte {
	t.Helper()
	b := make([]byte, 4096)
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestMetadataLimits: crafted images are bounded as QEMU bounds them, and
// refused at open with the limit named.
func TestMetadataLimits(t *testing.T) {
	be := binary.BigEndian
	cases := []struct {
		name  string
		craft func(t *testing.T, p string)
		want  string
	}{
		{"refcount table over 8 MiB", func(t *testing.T, p string) {
			os.Truncate(p, 1<<30) // the table itself lies inside the file
			patch(t, p, 56, be32(129))
		}, "refcount table of 129 clusters is too large"},
		{"snapshot table over 64 MiB", func(t *testing.T, p string) {
			// 1100 entries with 64 KiB names, as sparse zeroes.
			const at, n, entry = 1 << 20, 1100, 65576
			os.Truncate(p, at+n*entry)
			f, _ := os.OpenFile(p, os.O_RDWR, 0)
			for i := range int64(n) {
				var h [40]byte
				be.PutUint16(h[14:], 65535)
				f.WriteAt(h[:], at+i*entry)
			}
			f.Close()
			patch(t, p, 60, be32(n))
			patch(t, p, 64, be64(at))
		}, "snapshot table is too big"},
		{"too many snapshots", func(t *testing.T, p string) {
			patch(t, p, 60, be32(70000))
		}, "70000 snapshots"},
		{"snapshot with too much extra data", func(t *testing.T, p string) {
			tool(t, "qemu-img", "snapshot", "-c", "s", p)
			st := int64(be.Uint64(fileHead(t, p)[64:]))
			patch(t, p, st+36, be32(4096))
		}, "extra data"},
		{"too many bitmaps", func(t *testing.T, p string) {
			tool(t, "qemu-img", "bitmap", "--add", p, "b0")
			patch(t, p, bitmapsExt(t, p), be32(70000))
		}, "70000 bitmaps"},
		{"bitmap directory too large", func(t *testing.T, p string) {
			tool(t, "qemu-img", "bitmap", "--add", p, "b0")
			patch(t, p, bitmapsExt(t, p)+8, be64(1<<40))
		}, "bitmap directory of"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "l.qcow2")
			tool(t, "qemu-img", "create", "-q", "-f", "qcow2", p, "4M")
			qio(t, p, "write -P 1 0 64k")
			c.craft(t, p)
			q, err := openWithin(t, p, 20*time.Second)
			if err == nil || q != nil {
				t.Fatalf("opened; want an error saying %q", c.want)
			}
			if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %q; want ErrCorrupt saying %q", err, c.want)
			}
			// QEMU refuses the same image.
			if out, err := execOut("qemu-img", "info", p); err == nil {
				t.Errorf("qemu-img info accepts it, so should we:\n%s", out)
			}
		})
	}
}

// bitmapsExt is the file offset of the bitmaps extension's data.
func bitmapsExt(t *testing.T, p string) int64 {
	t.Helper()
	b := fileHead(t, p)
	be := binary.BigEndian
	for off := int64(be.Uint32(b[100:])); off+8 <= int64(len(b)); {
		typ, n := be.Uint32(b[off:]), int64(be.Uint32(b[off+4:]))
		if typ == extBitmaps {
			return off + 8
		}
		if typ == 0 {
			break
		}
		off += 8 + (n+7)&^7
	}
	t.Fatal("no bitmaps extension")
	return 0
}

// TestVirtualSizeRoundsDownToSectors: as QEMU, a size that is not a multiple
// of 512 is rounded down.
func TestVirtualSizeRoundsDownToSectors(t *testing.T) {
	p := filepath.Join(t.TempDir(), "s.qcow2")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", p, "64M")
	patch(t, p, 24, be64(67108764))
	var info struct {
		VirtualSize int64 `json:"virtual-size"`
	}
	if err := json.Unmarshal([]byte(tool(t, "qemu-img", "info", "--output=json", p)), &info); err != nil {
		t.Fatal(err)
	}
	q, err := openTest(p, testOpts{Backend: aio.Threads})
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	if q.Size() != info.VirtualSize || q.Info().VirtualSize != info.VirtualSize {
		t.Fatalf("size %d (info %d); qemu-img says %d", q.Size(), q.Info().VirtualSize, info.VirtualSize)
	}
}

// TestPreallocationScanIsBounded: a small image in a huge sparse file opens
// at once; the metadata preallocation scan waits for block status and walks
// the refcount table, not the file (it took minutes).
func TestPreallocationScanIsBounded(t *testing.T) {
	p := filepath.Join(t.TempDir(), "p.qcow2")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=512", p, "64M")
	qio(t, p, "write -P 3 0 1M")
	if err := os.Truncate(p, 15<<40); err != nil {
		t.Skipf("the file system takes no 15 TiB sparse file: %v", err)
	}
	q, err := openWithin(t, p, 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		e, err := q.Extent(context.Background(), 0, q.Size())
		if err == nil && (!e.Data || e.Length <= 0) {
			err = errors.New("wrong extent")
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("block status did not finish in 20 s")
	}
}

// TestFIFOBackingFileIsRefused: a FIFO would block the open until a writer
// came; it is no image, and is refused at once.
func TestFIFOBackingFileIsRefused(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "base")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, fmt_ := range []string{"raw", "qcow2"} {
		p := filepath.Join(dir, "over"+fmt_+".qcow2")
		tool(t, "qemu-img", "create", "-q", "-f", "qcow2", p, "1M")
		tool(t, "qemu-img", "rebase", "-u", "-f", "qcow2", "-b", "base", "-F", fmt_, p)
		_, err := openWithin(t, p, 10*time.Second)
		if !errors.Is(err, aio.ErrNotImage) || !strings.Contains(err.Error(), "FIFO") {
			t.Fatalf("backing format %q: %v; want a FIFO refused", fmt_, err)
		}
	}
}

func execOut(name string, args ...string) (string, error) {
	out, err := exec.Command(name, args...).CombinedOutput()
	return string(out), err
}
