package registry

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/blockexport/blockexport/formats/drivers/qcow2"
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
	if _, err := Open("null:x", Options{}); !errors.Is(err, ErrBadSpec) {
		t.Fatalf("null:x: %v, want a usage error", err)
	}
	if _, err := Open(rawPath, Options{Format: "qed"}); !errors.Is(err, ErrBadSpec) {
		t.Fatalf("qed: %v, want a usage error", err)
	}
}

// TestBackingLoopIsRefused: two images that name each other as backing
// file are refused as corrupt, at once, not opened forever.
func TestBackingLoopIsRefused(t *testing.T) {
	dir := t.TempDir()
	a := filepath.Join(dir, "a.qcow2")
	b := filepath.Join(dir, "b.qcow2")
	for _, args := range [][]string{
		{"create", "-q", "-f", "qcow2", a, "1M"},
		{"create", "-q", "-f", "qcow2", "-b", "a.qcow2", "-F", "qcow2", b, "1M"},
		{"rebase", "-u", "-f", "qcow2", "-b", "b.qcow2", "-F", "qcow2", a},
	} {
		if out, err := exec.Command("qemu-img", args...).CombinedOutput(); err != nil {
			t.Fatalf("qemu-img %v: %v\n%s", args, err, out)
		}
	}
	done := make(chan error, 1)
	go func() {
		img, err := Open(b, Options{})
		if err == nil {
			img.Image.Close()
		}
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, qcow2.ErrCorrupt) || !strings.Contains(err.Error(), "loops") {
			t.Fatalf("backing loop: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("opening a backing loop hangs")
	}
}

// TestBackingChainOfBothFormats: a qcow2 overlay on a raw file, without a
// backing format in its header, reads the raw file's bytes (detected
// here), and the chain's files are locked as QEMU locks them: the raw
// backing file refuses a writer while the overlay is open.
func TestBackingChainOfBothFormats(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.raw")
	top := filepath.Join(dir, "top.qcow2")
	want := make([]byte, 1<<20)
	for i := range want {
		want[i] = byte(i * 7)
	}
	if err := os.WriteFile(base, want, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := qcow2.Create(top, qcow2.CreateOptions{Size: 1 << 20, BackingFile: "base.raw"}); err != nil {
		t.Fatal(err)
	}
	img, err := Open(top, Options{Lock: true, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Image.Close()
	got := make([]byte, len(want))
	if _, err := img.Image.ReadAt(context.Background(), got, 0); err != nil {
		t.Fatal(err)
	}
	if string(got) != string(want) {
		t.Fatal("the overlay does not read its raw backing file's bytes")
	}
	if _, err := Open(base, Options{Lock: true, Writable: true, Format: Raw}); err == nil {
		t.Fatal("a raw backing file in use opened for writing")
	}
}

// TestFormatsAreWhatParseFormatTakes: --format's list (help, completion,
// the errors' "want ...") is every format read here, each accepted; a
// format QEMU reads and we do not, and a misspelt one, are refused with
// that list.
func TestFormatsAreWhatParseFormatTakes(t *testing.T) {
	got := strings.Join(Formats(), " ")
	if want := "auto null qcow2 raw vmdk vhdx vpc vdi"; got != want {
		t.Fatalf("Formats() = %s; want %s", got, want)
	}
	for _, f := range Formats() {
		if p, err := ParseFormat(f); err != nil || p != f {
			t.Errorf("ParseFormat(%s) = %q, %v", f, p, err)
		}
	}
	for _, f := range []string{"qed", "vmdx"} {
		_, err := ParseFormat(f)
		if err == nil || !strings.Contains(err.Error(), "want auto, null, qcow2, raw, vmdk, vhdx, vpc or vdi") {
			t.Errorf("ParseFormat(%s): %v; want the readable formats listed", f, err)
		}
	}
}
