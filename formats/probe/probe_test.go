package probe

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/blockexport/blockexport/formats/qcow2"
)

func TestParseSize(t *testing.T) {
	good := map[string]int64{
		"0": 0, "4096": 4096, "1k": 1024, "1K": 1024, "512M": 512 << 20, "1G": 1 << 30,
		"1.5G": 3 << 29, "2T": 2 << 40, "1GiB": 1 << 30, "1GB": 1 << 30, "8E": -1,
	}
	for in, want := range good {
		got, err := ParseSize(in)
		if want < 0 {
			if err == nil {
				t.Errorf("ParseSize(%q) = %d, want an overflow error", in, got)
			}
			continue
		}
		if err != nil || got != want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "abc", "-1", "12Q", "1.5", "G", "1e3K", "NaNG", "1..2M"} {
		if n, err := ParseSize(bad); err == nil {
			t.Errorf("ParseSize(%q) = %d, want an error", bad, n)
		}
	}
}

func TestOpenDetectsFormats(t *testing.T) {
	dir := t.TempDir()
	rawPath := filepath.Join(dir, "r.img")
	os.WriteFile(rawPath, make([]byte, 4096), 0o644)
	img, err := Open(rawPath, Options{Backend: "threads"})
	if err != nil {
		t.Fatal(err)
	}
	if img.Format != Raw || !img.Probed || img.Image.Size() != 4096 {
		t.Fatalf("raw: format %s probed %v size %d", img.Format, img.Probed, img.Image.Size())
	}
	img.Image.Close()

	q := filepath.Join(dir, "q.img")
	os.WriteFile(q, []byte{'Q', 'F', 'I', 0xfb, 0, 0, 0, 3}, 0o644)
	if _, err := Open(q, Options{Writable: true}); !errors.Is(err, qcow2.ErrCorrupt) {
		t.Fatalf("writable truncated qcow2: %v, want a corrupt-image error", err)
	}
	if _, err := Open(q, Options{}); err == nil {
		t.Fatal("a truncated qcow2 header opened")
	}
	if err := qcow2.Create(q, qcow2.CreateOptions{Size: 1 << 20, Force: true}); err != nil {
		t.Fatal(err)
	}
	w, err := Open(q, Options{Writable: true, Backend: "threads"})
	if err != nil || w.Format != QCOW2 || !w.Probed {
		t.Fatalf("writable qcow2: %v", err)
	}
	if _, err := w.Image.WriteAt(context.Background(), []byte("x"), 0); err != nil {
		t.Fatalf("write to a writable qcow2: %v", err)
	}
	w.Image.Close()
	d, err := Open(q, Options{Writable: true, Direct: true, Backend: "threads"})
	if err != nil {
		t.Fatalf("writable qcow2 with O_DIRECT: %v", err)
	}
	if _, err := d.Image.WriteAt(context.Background(), []byte("yz"), 1); err != nil {
		t.Fatalf("unaligned write to a qcow2 image with O_DIRECT: %v", err)
	}
	d.Image.Close()
	n, err := Open("null:1M", Options{NullReadZeroes: true})
	if err != nil || n.Format != Null || n.Image.Size() != 1<<20 {
		t.Fatalf("null:1M: %v", err)
	}
	if _, err := Open("null:x", Options{}); !errors.Is(err, ErrUsage) {
		t.Fatalf("null:x: %v, want a usage error", err)
	}
	if _, err := Open(rawPath, Options{Format: "vmdk"}); !errors.Is(err, ErrUsage) {
		t.Fatalf("vmdk: %v, want a usage error", err)
	}
}
