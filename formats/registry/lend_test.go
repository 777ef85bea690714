package registry

import (
	"bytes"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/blockexport/blockexport/formats"
)

// Differential: for each format that lends its pages (formats.PageLender),
// what TryLendAt lends of an image whose file is in the page cache is
// what ReadAt reads, byte for byte, over random ranges that cross blocks,
// grains, holes and zero runs, and most such ranges are lent at all. The
// images are qemu-img's, converted from one raw file with data, holes and
// zeroes; a backing chain's unallocated range lends the backing file's.
func TestTryLendAtMatchesReadAt(t *testing.T) {
	dir := t.TempDir()
	const size = 48 << 20
	data := make([]byte, size)
	r := rand.New(rand.NewPCG(3, 4))
	for off := 0; off < size; off += 1 << 20 {
		switch r.IntN(3) {
		case 0: // a hole
		case 1: // data
			for i := off; i < off+1<<20; i++ {
				data[i] = byte(r.Uint32() | 1)
			}
		case 2: // data in part
			for i := off + 300<<10; i < off+700<<10; i++ {
				data[i] = byte(r.Uint32())
			}
		}
	}
	raw := filepath.Join(dir, "src.raw")
	if err := os.WriteFile(raw, data, 0o644); err != nil {
		t.Fatal(err)
	}
	qemu := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("qemu-img", args...).CombinedOutput(); err != nil {
			t.Fatalf("qemu-img %v: %v\n%s", args, err, out)
		}
	}
	cases := []struct{ name, format string }{
		{"src.raw", "raw"}, {"img.qcow2", "qcow2"}, {"img.vmdk", "vmdk"}, {"img.vhdx", "vhdx"},
		{"img.vpc", "vpc"}, {"img.vdi", "vdi"}, {"over.qcow2", "qcow2"},
	}
	for _, c := range cases[1:6] {
		qemu("convert", "-q", "-O", c.format, raw, filepath.Join(dir, c.name))
	}
	// An overlay over the qcow2 that holds one MiB of its own.
	qemu("create", "-q", "-f", "qcow2", "-b", "img.qcow2", "-F", "qcow2", filepath.Join(dir, "over.qcow2"))
	if out, err := exec.Command("qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 1M 1M", filepath.Join(dir, "over.qcow2")).CombinedOutput(); err != nil {
		t.Fatalf("qemu-io: %v\n%s", err, out)
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			o, err := Open(filepath.Join(dir, c.name), Options{Format: c.format, Backend: "threads"})
			if err != nil {
				t.Fatal(err)
			}
			defer o.Image.Close()
			img := o.Image
			pl, ok := img.(formats.PageLender)
			if !ok {
				t.Fatalf("%T does not lend", img)
			}
			all := make([]byte, img.Size())
			if _, err := img.ReadAt(t.Context(), all, 0); err != nil {
				t.Fatal(err) // and its files' pages are in the cache now
			}
			lent := 0
			const tries = 400
			for i := range tries {
				n := int64(1 + r.IntN(1<<20))
				if i%2 == 0 {
					n = 4096 << r.IntN(5)
				}
				off := r.Int64N(img.Size() - n + 1)
				if i%3 == 0 {
					off &^= 4095
				}
				if c.format == "qcow2" { // lends within one cluster
					off = off &^ (64<<10 - 1)
					n = min(n, 64<<10)
				}
				v, ok := pl.TryLendAt(off, n, nil)
				if !ok {
					continue
				}
				lent++
				if got := bytes.Join(v, nil); !bytes.Equal(got, all[off:off+n]) {
					t.Fatalf("[%d, +%d): lent %d bytes in %d slices, not what ReadAt read", off, n, len(got), len(v))
				}
			}
			if lent < tries*9/10 {
				t.Fatalf("%d of %d ranges of a cached image lent", lent, tries)
			}
			if _, ok := pl.TryLendAt(img.Size()-4096, 8192, nil); ok {
				t.Fatal("a range past the end lent")
			}
			if _, ok := pl.TryLendAt(-1, 10, nil); ok {
				t.Fatal("a range before the start lent")
			}
		})
	}
}
