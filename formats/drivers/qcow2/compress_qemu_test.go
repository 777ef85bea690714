package qcow2

import (
	"bytes"
	"compress/flate"
	"context"
	"encoding/binary"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// readAsQemu reads img whole as qemu-img convert does (the reference:
// QEMU inflates a compressed cluster with one inflate(Z_FINISH) that must
// fill it, over compressed bytes that read as zeroes past the end of the
// file) and as we do; it returns both verdicts and both images.
func readAsQemu(t *testing.T, img string) (qemuOK bool, qemu []byte, oursOK bool, ours []byte) {
	t.Helper()
	out := filepath.Join(t.TempDir(), "ref.raw")
	if err := exec.Command("qemu-img", "convert", "-f", "qcow2", "-O", "raw", img, out).Run(); err == nil {
		qemuOK = true
		if qemu, err = os.ReadFile(out); err != nil {
			t.Fatal(err)
		}
	}
	q, err := openTest(img, testOpts{})
	if err != nil {
		t.Fatalf("open %s: %v", img, err)
	}
	defer q.Close()
	ours = make([]byte, q.Size())
	_, err = q.ReadAt(context.Background(), ours, 0)
	return qemuOK, qemu, err == nil, ours
}

// compressedClusters lists the host offset and size (as the L2 entry
// gives them) of the compressed clusters under the first L1 entry.
func compressedClusters(t *testing.T, img []byte) (offs, sizes []int64) {
	t.Helper()
	cb := binary.BigEndian.Uint32(img[20:])
	l1 := binary.BigEndian.Uint64(img[40:])
	l2 := binary.BigEndian.Uint64(img[l1:]) & 0x00fffffffffffe00
	shift := 62 - (cb - 8)
	for j := uint64(0); j < 1<<cb/8; j++ {
		e := binary.BigEndian.Uint64(img[l2+8*j:])
		if e&(1<<62) == 0 {
			continue
		}
		off := int64(e & (1<<shift - 1))
		n := int64(e>>shift&(1<<(cb-8)-1)) + 1
		offs, sizes = append(offs, off), append(sizes, n*512-off%512)
	}
	if len(offs) < 2 {
		t.Fatalf("%d compressed clusters", len(offs))
	}
	return offs, sizes
}

// A compressed cluster whose stream fills the cluster exactly and goes on
// reads as QEMU reads it: zlib reads on past the full output to the next
// literal or copy, so an invalid block there fails QEMU's read (and ours),
// a valid one does not; and a file cut inside the last compressed cluster
// inflates the zeroes QEMU reads past its end. Each image goes through
// qemu-img convert and through our reader: the same verdict, the same
// bytes.
func TestCompressedClustersReadAsQemuReadsThem(t *testing.T) {
	dir := t.TempDir()
	base := compressedImage(t, dir, "zlib")
	orig, err := os.ReadFile(base)
	if err != nil {
		t.Fatal(err)
	}
	offs, sizes := compressedClusters(t, orig)
	cs := 1 << binary.BigEndian.Uint32(orig[20:])

	// 64 KiB of 'Q' as a non-final block and a sync flush (an empty
	// stored block): the output is full at a block's end.
	var b bytes.Buffer
	w, _ := flate.NewWriter(&b, flate.BestCompression)
	w.Write(bytes.Repeat([]byte{'Q'}, cs))
	w.Flush()
	full := b.Bytes()
	for _, c := range []struct {
		name string
		tail []byte
		ok   bool
	}{
		{"then a block of type 3", []byte{0x07}, false},
		{"then a stored block whose length is not its complement", []byte{0x00, 5, 0, 5, 0}, false},
		{"then a final block of its end alone", []byte{0x03, 0x00}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			stream := append(bytes.Clone(full), c.tail...)
			i := 0
			for i < len(offs) && sizes[i] < int64(len(stream)) {
				i++
			}
			if i == len(offs) {
				t.Fatalf("no compressed cluster has room for the %d-byte stream: the case tried nothing", len(stream))
			}
			img := bytes.Clone(orig)
			copy(img[offs[i]:], stream)
			p := filepath.Join(t.TempDir(), "crafted.qcow2")
			if err := os.WriteFile(p, img, 0o644); err != nil {
				t.Fatal(err)
			}
			qok, qemu, ok, ours := readAsQemu(t, p)
			if qok != c.ok {
				t.Fatalf("qemu-img convert: ok %v, this test expects %v", qok, c.ok)
			}
			if ok != qok || ok && !bytes.Equal(ours, qemu) {
				t.Fatalf("ours ok %v, qemu-img ok %v (same bytes: %v)", ok, qok, bytes.Equal(ours, qemu))
			}
		})
	}

	// The file cut inside its last compressed cluster, at several points.
	last := 0
	for i := range offs {
		if offs[i] > offs[last] {
			last = i
		}
	}
	if end := offs[last] + sizes[last]; end < int64(len(orig))-512 {
		t.Fatalf("the last compressed cluster ends at %d, the file at %d: the cuts would miss it", end, len(orig))
	}
	// Cuts that reach into the stream itself (not only the slack of its
	// last sector) inflate zero bits: other bytes, or a failure.
	_, want, _, _ := readAsQemu(t, base)
	differs := 0
	for _, cut := range []int64{1, 8, 100, 400, 1000} {
		if cut >= sizes[last] {
			continue
		}
		p := filepath.Join(t.TempDir(), "cut.qcow2")
		if err := os.WriteFile(p, orig[:offs[last]+sizes[last]-cut], 0o644); err != nil {
			t.Fatal(err)
		}
		qok, qemu, ok, ours := readAsQemu(t, p)
		if ok != qok || ok && !bytes.Equal(ours, qemu) {
			t.Errorf("cut %d bytes into the last cluster: ours ok %v, qemu-img ok %v (same bytes: %v)", cut, ok, qok, bytes.Equal(ours, qemu))
		}
		if !qok || !bytes.Equal(qemu, want) {
			differs++
		}
	}
	if differs == 0 {
		t.Fatal("no cut reached the compressed stream: the test tried nothing")
	}
}
