package daemon

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

func TestMountpointRules(t *testing.T) {
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, 1<<20, 6)
	before := harness.FileHash(t, img)

	t.Run("missing mountpoint is created and removed", func(t *testing.T) {
		mnt := filepath.Join(dir, "created")
		d := harness.StartExport(t, img, mnt, "-f", "raw")
		if st, err := os.Stat(mnt); err != nil || st.Size() != 1<<20 {
			t.Fatalf("stat of created mountpoint: %v", err)
		}
		d.StopClean()
		if _, err := os.Stat(mnt); !os.IsNotExist(err) {
			t.Fatalf("created mountpoint left behind: %v", err)
		}
	})
	t.Run("directory mountpoint", func(t *testing.T) {
		code, out := harness.RunBlockexport(t, "fuse", "-f", "raw", img, dir)
		if code != 1 || !strings.Contains(out, "is a directory") || !strings.Contains(out, "--file-name") || strings.Count(out, "\n") != 1 {
			t.Fatalf("exit %d, output %q; want 1 and one line saying it is a directory (and what to pass)", code, out)
		}
	})
	t.Run("file-name needs a directory", func(t *testing.T) {
		file := filepath.Join(dir, "plain")
		os.WriteFile(file, nil, 0o600)
		defer os.Remove(file)
		for _, mnt := range []string{file, filepath.Join(dir, "absent")} {
			code, out := harness.RunBlockexport(t, "fuse", "-f", "raw", "--file-name", "disk.img", img, mnt)
			if code != 1 || !strings.Contains(out, "directory") || strings.Count(out, "\n") != 1 {
				t.Fatalf("%s: exit %d, output %q; want 1 and one line asking for a directory", mnt, code, out)
			}
		}
		if _, err := os.Stat(filepath.Join(dir, "absent")); !os.IsNotExist(err) {
			t.Fatalf("a missing directory was created: %v", err)
		}
	})
	t.Run("bad file-name", func(t *testing.T) {
		for _, name := range []string{"", ".", "..", "a/b", strings.Repeat("x", 256)} {
			code, out := harness.RunBlockexport(t, "fuse", "-f", "raw", "--file-name", name, img, dir)
			if code != 2 || !strings.Contains(out, "--file-name") || strings.Count(out, "\n") != 1 {
				t.Fatalf("--file-name %q: exit %d, output %q; want 2 and one line", name, code, out)
			}
		}
	})
	t.Run("missing parent directory", func(t *testing.T) {
		code, out := harness.RunBlockexport(t, "fuse", "-f", "raw", img, filepath.Join(dir, "nope", "mnt"))
		if code != 1 || !strings.Contains(out, "cannot create") {
			t.Fatalf("exit %d, output %q", code, out)
		}
	})
	t.Run("second export on the same path", func(t *testing.T) {
		mnt := filepath.Join(dir, "dup")
		harness.StartExport(t, img, mnt, "-f", "raw")
		code, out := harness.RunBlockexport(t, "fuse", "-f", "raw", img, mnt)
		if code != 1 || !strings.Contains(out, "already is a FUSE export") {
			t.Fatalf("exit %d, output %q", code, out)
		}
		if !harness.IsFuseMount(mnt) {
			t.Fatal("the first export was unmounted by the second attempt")
		}
	})
	if harness.FileHash(t, img) != before {
		t.Fatal("the image changed")
	}
}

func TestBadInputIsRefusedWithOneLine(t *testing.T) {
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, 1<<20, 7)
	before := harness.FileHash(t, img)
	qcow := filepath.Join(dir, "x.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", qcow, "1M")
	markCorrupt(t, qcow)
	mnt := filepath.Join(dir, "mnt")
	cases := []struct {
		name string
		args []string
		code int
		say  string
	}{
		{"unknown flag", []string{"fuse", "--bogus", img, mnt}, 2, "unknown flag"},
		{"unknown format", []string{"fuse", "-f", "vmdx", img, mnt}, 2, "unknown format"},
		{"bad null size", []string{"fuse", "null:12Q", mnt}, 2, "bad size"},
		{"missing arguments", []string{"fuse", img}, 2, "want IMAGE and MOUNTPOINT"},
		{"growable without writable", []string{"fuse", "--growable", img, mnt}, 2, "--growable needs --writable"},
		{"bad aio", []string{"fuse", "--aio", "posix", img, mnt}, 2, "unknown aio backend"},
		{"unknown command", []string{"frobnicate"}, 2, "unknown command"},
		{"missing image", []string{"fuse", filepath.Join(dir, "absent.img"), mnt}, 1, "no such file"},
		{"writable qcow2 marked corrupt", []string{"fuse", "-w", qcow, mnt}, 1, "marked corrupt"},
		{"null given as a path", []string{"fuse", "-f", "null", img, mnt}, 2, "null:SIZE"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			code, out := harness.RunBlockexport(t, c.args...)
			if code != c.code || !strings.Contains(strings.ToLower(out), strings.ToLower(c.say)) || strings.Count(strings.TrimSpace(out), "\n") != 0 {
				t.Fatalf("exit %d, output %q; want exit %d and one line containing %q", code, out, c.code, c.say)
			}
			if harness.IsFuseMount(mnt) {
				t.Fatal("something got mounted")
			}
		})
	}
	if harness.FileHash(t, img) != before {
		t.Fatal("the image changed")
	}
	if _, err := os.Stat(mnt); !os.IsNotExist(err) {
		t.Fatalf("a failed export left its mountpoint behind: %v", err)
	}
}

// markCorrupt sets a qcow2 image's corrupt bit (incompatible feature 1),
// as QEMU does when it finds inconsistent metadata.
func markCorrupt(t *testing.T, img string) {
	t.Helper()
	f, err := os.OpenFile(img, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var b [1]byte
	if _, err := f.ReadAt(b[:], 79); err != nil { // low byte of the field at 72
		t.Fatal(err)
	}
	b[0] |= 2
	if _, err := f.WriteAt(b[:], 79); err != nil {
		t.Fatal(err)
	}
}
