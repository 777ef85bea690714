package formats

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// The differential run of qcow2_check_differential_test.go over images
// unlike the first one: compressed clusters, version 2 (compat=0.10),
// refcounts of 1 and 64 bits, persistent dirty bitmaps, 512-byte
// clusters. Each gets the corruptions that mean something there, through
// a layout read from the image itself.

// variantLayout is what the variant cases corrupt.
type variantLayout struct {
	cs, size, order int64
	rt, rb0, l1, l2 int64
	e0              uint64 // the first L2 entry (data or compressed)
	host0           int64  // the host cluster it points into
}

func variantLayoutOf(t *testing.T, img string) variantLayout {
	t.Helper()
	b := harness.ReadAll(t, img)
	be := binary.BigEndian
	l := variantLayout{cs: 1 << be.Uint32(b[20:]), size: int64(len(b)), order: 4}
	if be.Uint32(b[4:]) >= 3 {
		l.order = int64(be.Uint32(b[96:]))
	}
	l.rt = int64(be.Uint64(b[48:]))
	l.rb0 = int64(be.Uint64(b[l.rt:]))
	l.l1 = int64(be.Uint64(b[40:]))
	l.l2 = int64(be.Uint64(b[l.l1:]) & 0x00fffffffffffe00)
	l.e0 = be.Uint64(b[l.l2:])
	if l.e0&(1<<62) != 0 {
		bits := 62 - (be.Uint32(b[20:]) - 8)
		l.host0 = int64(l.e0&(1<<bits-1)) / l.cs * l.cs
	} else {
		l.host0 = int64(l.e0 & 0x00fffffffffffe00)
	}
	if l.l2 == 0 || l.host0 == 0 {
		t.Fatalf("variant image without data: %+v", l)
	}
	return l
}

// setVariantRefcount sets the refcount of the cluster at host offset off, whatever
// the refcount width.
func setVariantRefcount(t *testing.T, img string, l variantLayout, off int64, v uint64) {
	t.Helper()
	k := off / l.cs
	bits := int64(1) << l.order
	f, err := os.OpenFile(img, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if bits >= 8 {
		b := make([]byte, bits/8)
		for i := range b {
			b[len(b)-1-i] = byte(v >> (8 * i))
		}
		if _, err := f.WriteAt(b, l.rb0+k*bits/8); err != nil {
			t.Fatal(err)
		}
		return
	}
	var b [1]byte
	bit := k * bits
	if _, err := f.ReadAt(b[:], l.rb0+bit/8); err != nil {
		t.Fatal(err)
	}
	mask := byte(1<<bits-1) << (bit % 8)
	b[0] = b[0]&^mask | byte(v)<<(bit%8)&mask
	if _, err := f.WriteAt(b[:], l.rb0+bit/8); err != nil {
		t.Fatal(err)
	}
}

func TestQcow2CheckAndRepairMatchQemuImgOnLayoutVariants(t *testing.T) {
	const bit63 = uint64(1) << 63
	type varCase struct {
		name    string
		corrupt func(t *testing.T, img string, l variantLayout)
	}
	common := []varCase{
		{"clean", func(t *testing.T, img string, l variantLayout) {}},
		{"leaked cluster", func(t *testing.T, img string, l variantLayout) {
			if err := os.Truncate(img, l.size+l.cs); err != nil {
				t.Fatal(err)
			}
			setVariantRefcount(t, img, l, l.size, 1)
		}},
		{"refcount zero for data", func(t *testing.T, img string, l variantLayout) { setVariantRefcount(t, img, l, l.host0, 0) }},
		{"reftable entry to data", func(t *testing.T, img string, l variantLayout) { patch64(t, img, l.rt, uint64(l.host0)) }},
		{"L2 entry COPIED flipped", func(t *testing.T, img string, l variantLayout) { patch64(t, img, l.l2, l.e0^bit63) }},
		{"two L2 entries, one cluster", func(t *testing.T, img string, l variantLayout) { patch64(t, img, l.l2+8*3, l.e0) }},
		{"L1 entry past EOF", func(t *testing.T, img string, l variantLayout) { patch64(t, img, l.l1, bit63|uint64(l.size+16*l.cs)) }},
	}
	tooHigh := varCase{"refcount too high", func(t *testing.T, img string, l variantLayout) { setVariantRefcount(t, img, l, l.host0, 3) }}
	variants := []struct {
		name  string
		make  func(t *testing.T, img string)
		extra []varCase
	}{
		{"compressed", func(t *testing.T, img string) {
			src := img + ".src"
			harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", src, "4M")
			harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 0 192k", "-c", "write -P 0x33 1M 64k", src)
			harness.Run(t, "qemu-img", "convert", "-c", "-f", "qcow2", "-O", "qcow2", src, img)
		}, []varCase{tooHigh, {"compressed entry past EOF", func(t *testing.T, img string, l variantLayout) {
			patch64(t, img, l.l2, l.e0&^(uint64(1)<<54-1)|uint64(l.size+16*l.cs))
		}}}},
		{"v2 with a snapshot", func(t *testing.T, img string) {
			harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "compat=0.10", img, "4M")
			harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 0 128k", img)
			harness.Run(t, "qemu-img", "snapshot", "-c", "s1", img)
			harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x77 0 64k", img)
		}, []varCase{tooHigh}},
		{"1-bit refcounts", func(t *testing.T, img string) {
			harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "refcount_bits=1", img, "4M")
			harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 0 128k", img)
		}, nil},
		{"64-bit refcounts", func(t *testing.T, img string) {
			harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "refcount_bits=64", img, "4M")
			harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 0 128k", img)
		}, []varCase{tooHigh}},
		{"persistent bitmaps", func(t *testing.T, img string) {
			harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", img, "8M")
			harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 0 1M", img)
			harness.Run(t, "qemu-img", "bitmap", "--add", img, "b0")
			harness.Run(t, "qemu-img", "bitmap", "--add", "-g", "512", img, "b1")
			harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x33 2M 64k", img)
		}, []varCase{tooHigh}},
		{"512-byte clusters", func(t *testing.T, img string) {
			harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=512", img, "1M")
			harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 0 8k", "-c", "write -P 0x33 512k 4k", img)
		}, []varCase{tooHigh}},
	}
	for _, v := range variants {
		t.Run(v.name, func(t *testing.T) {
			base := filepath.Join(t.TempDir(), "base.qcow2")
			v.make(t, base)
			l := variantLayoutOf(t, base)
			orig := guestBytes(t, base)
			for _, c := range append(append([]varCase{}, common...), v.extra...) {
				t.Run(c.name, func(t *testing.T) {
					t.Parallel() // each case has its own copy; the base is only read
					broken := filepath.Join(t.TempDir(), "broken.qcow2")
					copyFile(t, base, broken)
					c.corrupt(t, broken, l)
					compareCheckRuns(t, broken, orig, nil)
				})
			}
		})
	}
}
