package registry

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// A VMDK descriptor whose one FLAT extent is name: every file an attacker
// would name is refused in one line, without a hang (QEMU 7.2 reads
// /etc/passwd, /dev/zero and the image itself through such an extent, and
// hangs on a FIFO).
func TestRelatedRefusesOutsideAndSpecialFiles(t *testing.T) {
	root := t.TempDir()
	dir := filepath.Join(root, "img")
	other := filepath.Join(root, "other")
	for _, d := range []string{dir, other, filepath.Join(dir, "sub")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(other, "secret"), make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "ok-flat"), make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(filepath.Join(dir, "fifo"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(other, "secret"), filepath.Join(dir, "link-out")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("ok-flat", filepath.Join(dir, "link-in")); err != nil {
		t.Fatal(err)
	}
	desc := func(names ...string) string {
		s := "# Disk DescriptorFile\nversion=1\nCID=1\nparentCID=ffffffff\ncreateType=\"twoGbMaxExtentFlat\"\n"
		for _, n := range names {
			s += fmt.Sprintf("RW 8 FLAT \"%s\" 0\n", n)
		}
		return s
	}
	img := filepath.Join(dir, "d.vmdk")
	for _, c := range []struct {
		names []string
		ok    bool
		dirs  []string
	}{
		{names: []string{"ok-flat"}, ok: true},
		{names: []string{"link-in"}, ok: true},
		{names: []string{"../../../../../../etc/passwd"}},
		{names: []string{"/etc/passwd"}},
		{names: []string{"../other/secret"}},
		{names: []string{"link-out"}},
		{names: []string{"../other/secret"}, ok: true, dirs: []string{other}},
		{names: []string{"/dev/zero"}},
		{names: []string{"/dev/zero"}, dirs: []string{"/dev"}},
		{names: []string{"fifo"}},
		{names: []string{"sub"}},
		{names: []string{"d.vmdk"}},
		{names: []string{"./d.vmdk"}},
		{names: []string{"ok-flat", "ok-flat"}},
		{names: []string{"missing"}},
	} {
		t.Run(strings.Join(c.names, ","), func(t *testing.T) {
			if err := os.WriteFile(img, []byte(desc(c.names...)), 0o644); err != nil {
				t.Fatal(err)
			}
			type res struct {
				o   *Opened
				err error
			}
			ch := make(chan res, 1)
			go func() {
				o, err := Open(img, Options{Format: "vmdk", Backend: "threads", Lock: true, RelatedDirs: c.dirs})
				ch <- res{o, err}
			}()
			var r res
			select {
			case r = <-ch:
			case <-time.After(10 * time.Second):
				t.Fatal("open hangs")
			}
			if c.ok {
				if r.err != nil {
					t.Fatalf("refused: %v", r.err)
				}
				r.o.Image.Close()
				return
			}
			if r.err == nil {
				r.o.Image.Close()
				t.Fatal("opened")
			}
			if strings.Contains(r.err.Error(), "\n") {
				t.Fatalf("more than one line: %q", r.err)
			}
			if c.names[0] != "missing" && !errors.Is(r.err, ErrRelatedRefused) {
				t.Fatalf("error %v is not ErrRelatedRefused", r.err)
			}
		})
	}
}

// A delta disk naming itself as its parent, and two naming each other,
// are loops.
func TestRelatedParentLoops(t *testing.T) {
	dir := t.TempDir()
	flat := filepath.Join(dir, "f")
	if err := os.WriteFile(flat, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	d := func(parent, extent string) string {
		return fmt.Sprintf("# Disk DescriptorFile\nversion=1\nCID=1\nparentCID=1\nparentFileNameHint=\"%s\"\ncreateType=\"monolithicFlat\"\nRW 8 FLAT \"%s\" 0\n", parent, extent)
	}
	if err := os.WriteFile(filepath.Join(dir, "self.vmdk"), []byte(d("self.vmdk", "f")), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(filepath.Join(dir, "self.vmdk"), Options{Format: "vmdk", Backend: "threads"}); err == nil || !errors.Is(err, ErrRelatedRefused) {
		t.Fatalf("self parent: %v", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "f2"), make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dir, "a.vmdk"), []byte(d("b.vmdk", "f")), 0o644)
	os.WriteFile(filepath.Join(dir, "b.vmdk"), []byte(d("a.vmdk", "f2")), 0o644)
	if _, err := Open(filepath.Join(dir, "a.vmdk"), Options{Format: "vmdk", Backend: "threads"}); err == nil || !errors.Is(err, ErrRelatedRefused) {
		t.Fatalf("a-b loop: %v", err)
	}
}
