package formats

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestQcow2GrowableExport: writes past the end grow the image, truncate
// shrinks it, and qemu-img info shows the size each time.
func TestQcow2GrowableExport(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "g.qcow2")
	harness.CreateImage(t, "-f", "qcow2", img, "1M")
	virtualSize := func() int64 {
		var info struct {
			VirtualSize int64 `json:"virtual-size"`
		}
		out := harness.Run(t, "qemu-img", "info", "-U", "--output=json", img)
		if err := json.Unmarshal([]byte(out), &info); err != nil {
			t.Fatal(err)
		}
		return info.VirtualSize
	}
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, img, mnt, "-w", "--growable")
	f, err := os.OpenFile(mnt, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	tail := bytes.Repeat([]byte{0xab}, 64<<10)
	if _, err := f.WriteAt(tail, 3<<20); err != nil {
		t.Fatalf("write past the end of a growable export: %v", err)
	}
	if st, _ := f.Stat(); st.Size() != 3<<20+64<<10 {
		t.Fatalf("size %d after writing past the end", st.Size())
	}
	if got := virtualSize(); got != 3<<20+64<<10 {
		t.Fatalf("qemu-img info: virtual size %d after growing, want %d", got, 3<<20+64<<10)
	}
	if err := f.Truncate(2 << 20); err != nil {
		t.Fatal(err)
	}
	if got := virtualSize(); got != 2<<20 {
		t.Fatalf("qemu-img info: virtual size %d after truncate, want %d", got, 2<<20)
	}
	if _, err := f.WriteAt(tail[:4096], 2<<20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	d.StopClean()
	harness.QemuImgCheck(t, img)
	got := harness.ReadAll(t, harness.ToRaw(t, img, dir))
	want := append(make([]byte, 2<<20), tail[:4096]...)
	harness.MustEqualBytes(t, "grown image", got, want)
}

// TestCreateCommand: images qemu-img accepts, sizes from the backing file,
// no overwriting without --force, and usage errors.
func TestCreateCommand(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "a.qcow2")
	empty := filepath.Join(dir, "empty.qcow2")
	harness.CreateImage(t, "-f", "qcow2", empty, "0")
	harness.QemuImgCheck(t, empty)
	for _, cs := range []string{"512", "4k", "64k", "2M"} {
		harness.CreateImage(t, "-f", "qcow2", "--cluster-size", cs, "--force", img, "10G")
		harness.QemuImgCheck(t, img)
		out := harness.Run(t, "qemu-img", "info", img)
		if !strings.Contains(out, "virtual size: 10 GiB") {
			t.Fatalf("qemu-img info after create --cluster-size %s:\n%s", cs, out)
		}
	}
	before := harness.FileHash(t, img)
	if code, out := harness.RunBlockexport(t, "create", "-f", "qcow2", img, "1G"); code != 1 || !strings.Contains(out, "--force") {
		t.Fatalf("create over an existing file: exit %d, %q", code, out)
	}
	if harness.FileHash(t, img) != before {
		t.Fatal("a refused create changed the existing file")
	}
	over := filepath.Join(dir, "over.qcow2")
	harness.CreateImage(t, "-f", "qcow2", "-b", "a.qcow2", over)
	var info struct {
		VirtualSize   int64  `json:"virtual-size"`
		Backing       string `json:"backing-filename"`
		BackingFormat string `json:"backing-filename-format"`
	}
	if err := json.Unmarshal([]byte(harness.Run(t, "qemu-img", "info", "--output=json", over)), &info); err != nil {
		t.Fatal(err)
	}
	if info.VirtualSize != 10<<30 || info.Backing != "a.qcow2" || info.BackingFormat != "qcow2" {
		t.Fatalf("overlay: %+v", info)
	}
	rawImg := filepath.Join(dir, "r.raw")
	harness.CreateImage(t, rawImg, "3M")
	if st, err := os.Stat(rawImg); err != nil || st.Size() != 3<<20 {
		t.Fatalf("raw image: %v", err)
	}
	// A size that is not whole sectors is rounded up, as qemu-img does.
	odd := filepath.Join(dir, "odd.qcow2")
	harness.CreateImage(t, "-f", "qcow2", odd, "1000")
	if got := harness.JSONOf(t, "qemu-img", "info", "--output=json", odd).(map[string]any)["virtual-size"]; got != float64(1024) {
		t.Fatalf("create -f qcow2 IMAGE 1000: virtual size %v, qemu-img makes 1024", got)
	}
	for _, args := range [][]string{
		{"create", "-f", "qcow2", "--cluster-size", "3000", filepath.Join(dir, "x.qcow2"), "1M"},
		{"create", "-f", "vmdk", "-o", "subformat=monolithicFlat,zeroed_grain=on", filepath.Join(dir, "x.img"), "1M"},
		{"create", filepath.Join(dir, "x.img")},
	} {
		if code, _ := harness.RunBlockexport(t, args...); code == 0 {
			t.Fatalf("%v succeeded", args)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "x.qcow2")); err == nil {
		t.Fatal("a refused create left a file behind")
	}
}

// TestQcow2HostFull: a qcow2 image on a host file system that fills up.
// Writes get ENOSPC (not EIO), what was written and flushed before reads
// back, the exporter keeps serving and exits, and the image is never
// corrupt (tmpfs has no FALLOC_FL_ZERO_RANGE: the fallback path runs).
func TestQcow2HostFull(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(harness.SmallHost(t, dir, "1m"), "full.qcow2")
	harness.CreateImage(t, "-f", "qcow2", "--cluster-size", "4k", img, "8M")
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, img, mnt, "-w")
	f, err := os.OpenFile(mnt, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	first := bytes.Repeat([]byte{7}, 64<<10)
	if _, err := f.WriteAt(first, 0); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	block := bytes.Repeat([]byte{8}, 64<<10)
	var werr error
	for off := int64(64 << 10); off < 8<<20 && werr == nil; off += int64(len(block)) {
		_, werr = f.WriteAt(block, off)
	}
	if !errors.Is(werr, syscall.ENOSPC) {
		t.Fatalf("filling a full host: %v, want ENOSPC", werr)
	}
	got := make([]byte, len(first))
	if _, err := f.ReadAt(got, 0); err != nil || !bytes.Equal(got, first) {
		t.Fatalf("read after ENOSPC: %v", err)
	}
	f.Close()
	d.Stop() // the last write-back may fail for want of space: exit 0 or 1
	if strings.Contains(d.Log(), "panic") {
		t.Fatalf("the exporter panicked:\n%s", d.Log())
	}
	out, _ := exec.Command("qemu-img", "check", "-f", "qcow2", "--output=json", img).Output()
	var check struct {
		Corruptions int `json:"corruptions"`
	}
	if err := json.Unmarshal(out, &check); err != nil || check.Corruptions != 0 {
		t.Fatalf("qemu-img check after ENOSPC: %v\n%s", err, out)
	}
	harness.MustEqualBytes(t, "flushed data", harness.ReadAll(t, harness.ToRaw(t, img, dir))[:len(first)], first)
}
