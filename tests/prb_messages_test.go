package tests

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestPrbNotQCOW2: `-f qcow2` on a file that is no qcow2 image said
// "corrupt image", which sends a user looking for damage (and `check -r`)
// in a healthy raw file. It says "not a qcow2 image", with qemu-img's exit
// status (1; qemu-img: "Image is not in qcow2 format"), for a raw image
// and for a file too short to hold a header.
func TestPrbNotQCOW2(t *testing.T) {
	dir := t.TempDir()
	rawImg := filepath.Join(dir, "disk.raw")
	run(t, "qemu-img", "create", "-q", "-f", "raw", rawImg, "1M")
	tiny := filepath.Join(dir, "tiny")
	if err := os.WriteFile(tiny, []byte("hello"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, img := range []string{rawImg, tiny} {
		for _, cmd := range [][]string{{"info", "-f", "qcow2", img}, {"map", "-f", "qcow2", img}, {"check", "-f", "qcow2", img}} {
			code, out := runBlockexport(t, cmd...)
			if code != 1 || !strings.Contains(out, "not a qcow2 image") || strings.Contains(out, "corrupt") {
				t.Errorf("%v: exit %d, want 1 and \"not a qcow2 image\" (not \"corrupt\"):\n%s", cmd, code, out)
			}
		}
		mnt := filepath.Join(t.TempDir(), "export")
		if code, out := tryExport(t, mnt, "-f", "qcow2", img); code != 1 || !strings.Contains(out, "not a qcow2 image") {
			t.Errorf("fuse -f qcow2 %s: exit %d:\n%s", filepath.Base(img), code, out)
		}
	}
}
