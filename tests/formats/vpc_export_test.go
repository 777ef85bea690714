package formats

import (
	"bytes"
	"encoding/binary"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// vpcSameInspection: info and map, as JSON, equal qemu-img's on img
// (fmtArgs: "-f", "vpc" for a fixed disk, which both probe as raw).
func vpcSameInspection(t *testing.T, img string, fmtArgs ...string) {
	t.Helper()
	for _, cmd := range []string{"info", "map"} {
		args := append(append([]string{cmd, "--output=json"}, fmtArgs...), img)
		if got, want := harness.JSONOf(t, harness.Bin, args...), harness.JSONOf(t, "qemu-img", args...); !reflect.DeepEqual(got, want) {
			t.Errorf("%s differs from qemu-img's\n got %v\nwant %v", cmd, got, want)
		}
	}
}

// TestVpcConvertedImagesExportAsQemuReadsThem: qemu-img's dynamic, fixed
// and force_size VHDs of a raw disk with holes and zero runs read back
// through the FUSE export and NBD as qemu-img reads them (a fixed one given -f
// vpc: both tools probe it as raw), byte for byte against the raw source
// where the size is the source's (force_size; otherwise the CHS geometry
// sizes the disk, as in QEMU); info and map equal qemu-img's; an overlay
// on the VHD exports read-write under fio verify, the VHD unchanged
// (writing the VHD itself: TestVpcWritableExports).
func TestVpcConvertedImagesExportAsQemuReadsThem(t *testing.T) {
	dir := t.TempDir()
	src := vdiRawWithHoles(t, dir)
	for _, c := range []struct {
		name, opts string
		fmtArgs    []string
	}{
		{"dynamic", "subformat=dynamic", nil},
		{"dynamic force_size", "subformat=dynamic,force_size=on", nil},
		{"fixed", "subformat=fixed", []string{"-f", "vpc"}},
		{"fixed force_size", "subformat=fixed,force_size=on", []string{"-f", "vpc"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			// Each subformat has its own image, exports and overlay;
			// the source is only read.
			t.Parallel()
			d := t.TempDir()
			img := filepath.Join(d, "d.vhd")
			harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vpc", "-o", c.opts, src, img)
			// Written back now: the file system allocates its own metadata
			// (extent tree blocks, counted in st_blocks) at write-back, which
			// under load came between the export's stat and the test's.
			harness.Run(t, "sync", img)
			mnt := filepath.Join(d, "mnt")
			harness.StartExport(t, img, mnt, c.fmtArgs...)
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "vpc", mnt, img)
			dmnt := filepath.Join(d, "dmnt") // O_DIRECT: the footer, BAT and data through aligned bounce buffers
			harness.StartExport(t, img, dmnt, append([]string{"--cache", "none"}, c.fmtArgs...)...)
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "vpc", dmnt, img)
			srv := harness.StartNBD(t, img, false, c.fmtArgs...)
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "vpc", srv.URI, img)
			if strings.Contains(c.opts, "force_size") {
				harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", mnt, src)
			}
			vpcSameInspection(t, img, c.fmtArgs...)
			vdiSeekAndBlocksAsQemu(t, mnt, img, c.fmtArgs...)

			ov := filepath.Join(d, "ov.qcow2")
			harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", img, "-F", "vpc", ov)
			omnt := filepath.Join(d, "omnt")
			e := harness.StartExport(t, ov, omnt, "-w")
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "vpc", omnt, img)
			harness.Run(t, "fio", append(harness.FioJob("vpc", "4k", "0", "60M", 27), "--io_size=8M", "--filename="+omnt)...)
			e.StopClean()
			if strings.Contains(c.opts, "force_size") {
				harness.Run(t, "qemu-img", "compare", "-f", "vpc", "-F", "raw", img, src)
			}
		})
	}
}

// TestVpcHostileBATsRefusedWhereQemuReadsMetadata: BAT entries QEMU 7.2
// opens and serves (a block over the footer copy and dynamic header, two
// entries naming one block), each refused here with one line, and a BAT
// past the end, which both refuse (QEMU: "the image has been truncated");
// a writable export of each is refused the same way, the file untouched.
func TestVpcHostileBATsRefusedWhereQemuReadsMetadata(t *testing.T) {
	dir := t.TempDir()
	src := harness.RandomImage(t, dir, 8<<20, 28)
	img := filepath.Join(dir, "d.vhd")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vpc", "-o", "force_size=on", src, img)
	good, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	be := binary.BigEndian
	batOff := int64(be.Uint64(good[512+16:]))
	cases := map[string]func(b []byte){
		"entry at the footer copy": func(b []byte) { be.PutUint32(b[batOff+4:], 0) },
		"duplicate entries":        func(b []byte) { copy(b[batOff+4:], b[batOff:batOff+4]) },
		"BAT past the end":         func(b []byte) { be.PutUint64(b[512+16:], uint64(len(b))+1<<20) },
	}
	qemuRefuses := map[string]bool{"BAT past the end": true}
	for name, mod := range cases {
		t.Run(name, func(t *testing.T) {
			b := append([]byte(nil), good...)
			mod(b)
			p := filepath.Join(t.TempDir(), "h.vhd")
			if err := os.WriteFile(p, b, 0o644); err != nil {
				t.Fatal(err)
			}
			if qemuRefuses[name] {
				if out, err := exec.Command("qemu-img", "info", "-f", "vpc", p).CombinedOutput(); err == nil {
					t.Fatalf("qemu-img opens it after all:\n%s", out)
				}
			} else {
				harness.Run(t, "qemu-img", "compare", "-q", "-f", "vpc", "-F", "vpc", p, p) // QEMU opens and reads it
			}
			code, out := harness.RunBlockexport(t, "info", p)
			if code == 0 || strings.Count(strings.TrimSpace(out), "\n") != 0 || !strings.Contains(out, "corrupt") {
				t.Fatalf("blockexport info: exit %d, want a one-line refusal:\n%s", code, out)
			}
			// Writable, as read: refused in one line, nothing written.
			mnt := filepath.Join(t.TempDir(), "w")
			os.Mkdir(mnt, 0o755)
			if code, out := harness.TryExport(t, mnt, "-w", p); code == 0 || strings.Count(strings.TrimSpace(out), "\n") != 0 || !strings.Contains(out, "corrupt") {
				t.Fatalf("fuse -w: exit %d, want a one-line refusal:\n%s", code, out)
			}
			if after, _ := os.ReadFile(p); !bytes.Equal(after, b) {
				t.Fatal("a refused writable open changed the image")
			}
		})
	}
}
