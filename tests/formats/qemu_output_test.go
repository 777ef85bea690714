package formats

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// qemuOutputImages makes images whose maps have a few extents: a qcow2
// with data, a hole and zero clusters, a raw file with holes, a
// compressed qcow2, a streamOptimized vmdk, an empty qcow2, an overlay
// and a qcow2 with persistent dirty bitmaps (one enabled, one disabled).
func qemuOutputImages(t *testing.T) []string {
	t.Helper()
	dir := t.TempDir()
	q := filepath.Join(dir, "a.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", q, "16M")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 1 0 64k", "-c", "write -P 2 1M 128k", "-c", "write -z 4M 64k", "-c", "write -P 3 8M 64k", q)
	r := harness.SparseImage(t, dir, "r.raw", 10<<20)
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 4 192k 128k", "-c", "write -P 5 8788k 4k", r)
	c := filepath.Join(dir, "c.qcow2")
	harness.Run(t, "qemu-img", "convert", "-c", "-O", "qcow2", q, c)
	v := filepath.Join(dir, "s.vmdk")
	harness.Run(t, "qemu-img", "convert", "-O", "vmdk", "-o", "subformat=streamOptimized", q, v)
	e := filepath.Join(dir, "e.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", e, "0")
	o := filepath.Join(dir, "o.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", q, "-F", "qcow2", o)
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 6 1M 64k", o)
	b := filepath.Join(dir, "b.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", b, "16M")
	harness.Run(t, "qemu-img", "bitmap", "--add", b, "b0")
	harness.Run(t, "qemu-img", "bitmap", "--add", "--disable", "-g", "512", b, "b1")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 7 2M 64k", b)
	return []string{q, r, c, v, e, o, b}
}

// qemuAndOurs runs qemu-img and blockexport with args in dir and
// returns each one's stdout and exit status.
func qemuAndOurs(t *testing.T, dir string, args ...string) (qout string, qcode int, out string, code int) {
	t.Helper()
	status := func(name string, args ...string) (string, int) {
		cmd := exec.Command(name, args...)
		cmd.Dir = dir
		b, err := cmd.Output()
		if ee, ok := err.(*exec.ExitError); ok {
			return string(b), ee.ExitCode()
		} else if err != nil {
			t.Fatalf("%s %v: %v", name, args, err)
		}
		return string(b), 0
	}
	qout, qcode = status("qemu-img", args...)
	out, code = status(harness.Bin, args...)
	return qout, qcode, out, code
}

// TestMapInfoCheckPrintQemuImgBytes: map (JSON and human), info and
// check --output=json print what qemu-img 7.2 prints, byte for byte,
// and exit as it exits: map's JSON one entry a line with qemu-img's
// spacing, the others in the key order of QEMU's dictionaries; human
// map of an image with compressed data fails (exit 1) as qemu-img's.
func TestMapInfoCheckPrintQemuImgBytes(t *testing.T) {
	for _, img := range qemuOutputImages(t) {
		dir, name := filepath.Split(img)
		for _, args := range [][]string{
			{"map", "--output=json", name},
			{"map", "--output=human", name},
			{"info", "--output=json", name},
			{"info", "--output=json", "--backing-chain", name},
			{"check", "--output=json", name},
		} {
			qout, qcode, out, code := qemuAndOurs(t, dir, args...)
			if out != qout || code != qcode {
				t.Errorf("%v: exit %d\n%s\nqemu-img: exit %d\n%s", args, code, out, qcode, qout)
			}
		}
	}
}

// TestMapOfCompressedVmdkFailsAsQemuImg: the human map of a
// streamOptimized vmdk says why it fails, in qemu-img's words.
func TestMapOfCompressedVmdkFailsAsQemuImg(t *testing.T) {
	imgs := qemuOutputImages(t)
	code, out := harness.RunBlockexport(t, "map", imgs[3])
	if code != 1 || !strings.Contains(out, "File contains external, encrypted or compressed clusters.") {
		t.Fatalf("map of a streamOptimized vmdk: exit %d\n%s", code, out)
	}
}

// TestErrorsNameTheImageOnce: an error names the image once, not
// "part.raw: part.raw:".
func TestErrorsNameTheImageOnce(t *testing.T) {
	dir := t.TempDir()
	raw := harness.SparseImage(t, dir, "part.raw", 1<<20)
	for _, args := range [][]string{
		{"check", raw},
		{"check", "-f", "qcow2", raw},
		{"convert", "-f", "qcow2", raw, filepath.Join(dir, "out.raw")},
		{"compare", "-f", "qcow2", raw, raw},
		{"stream", raw},
	} {
		code, out := harness.RunBlockexport(t, args...)
		if code == 0 || strings.Count(out, raw) != 1 {
			t.Errorf("%v: exit %d, the image named %d times:\n%s", args, code, strings.Count(out, raw), out)
		}
	}
	// Each driver says its own name once, however it refuses the file.
	for _, format := range []string{"qcow2", "vmdk", "vhdx", "vpc", "vdi"} {
		code, out := harness.RunBlockexport(t, "info", "-f", format, raw)
		if code == 0 || strings.Count(out, raw) != 1 || strings.Count(out, format+":") > 1 {
			t.Errorf("info -f %s: exit %d, a doubled name:\n%s", format, code, out)
		}
	}
}

// TestMapOfAnOddSizedRawFileAsQemuImg: qemu-img sees a raw file in whole
// sectors; its map ends at the next 512-byte boundary, the tail past the
// file's end a zero run.
func TestMapOfAnOddSizedRawFileAsQemuImg(t *testing.T) {
	dir := t.TempDir()
	for name, data := range map[string]int{"hole.raw": 0, "d1000.raw": 1000, "d5000.raw": 5000} {
		path := harness.SparseImage(t, dir, name, 1000)
		if name == "d5000.raw" {
			path = harness.SparseImage(t, dir, name, 70000)
		}
		if data > 0 {
			harness.Run(t, "qemu-io", "-f", "raw", "-c", fmt.Sprintf("write -P 7 0 %d", data), path)
		}
		for _, o := range []string{"json", "human"} {
			qout, qcode, out, code := qemuAndOurs(t, dir, "map", "--output="+o, name)
			if out != qout || code != qcode {
				t.Errorf("map --output=%s %s: exit %d\n%s\nqemu-img: exit %d\n%s", o, name, code, out, qcode, qout)
			}
		}
	}
}
