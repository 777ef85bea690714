package fuse

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// bitmapImage is a 64 MiB qcow2 image with data, an internal snapshot and
// two persistent dirty bitmaps of 64 KiB granularity, made by QEMU's
// tools: bm0 enabled, with 30M+4k dirty; bm1 disabled, with 20M+64k dirty.
func bitmapImage(t *testing.T, dir string) string {
	t.Helper()
	img := filepath.Join(dir, "bitmaps.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", img, "64M")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0xaa 0 4M", img)
	harness.Run(t, "qemu-img", "snapshot", "-c", "s1", img)
	harness.Run(t, "qemu-img", "bitmap", "--add", img, "bm1")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x11 20M 64k", img)
	harness.Run(t, "qemu-img", "bitmap", "--disable", img, "bm1")
	harness.Run(t, "qemu-img", "bitmap", "--add", img, "bm0")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x22 30M 4k", img)
	return img
}

// TestBitmapSurvivesAWriteSessionThroughTheExport: writes, a punched hole
// and a zeroed range through a writable export, then a clean stop: qemu-img
// check finds no leak, qemu-img info lists bm0 consistent, qemu-nbd's
// dirty blocks of bm0 are exactly the ones written (64 KiB granularity,
// which also covers a kernel cache's whole-page writes) and those dirty
// before, the disabled bm1 is unchanged, and our info and check agree.
func TestBitmapSurvivesAWriteSessionThroughTheExport(t *testing.T) {
	const size = 64 << 20
	dir := t.TempDir()
	img := bitmapImage(t, dir)
	bm1 := harness.DirtyRanges(t, img, "bm1")
	if want := [][2]int64{{20 << 20, 20<<20 + 64<<10}}; !slices.Equal(bm1, want) {
		t.Fatalf("bm1 before the session: %v, want %v", bm1, want)
	}
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, img, mnt, "-w")
	f, err := os.OpenFile(mnt, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	written := [][2]int64{{10 << 20, 1 << 20}, {100_000, 5000}, {40 << 20, 256 << 10}, {50<<20 + 100, 70_000}}
	if _, err := f.WriteAt(bytes.Repeat([]byte{0x5a}, 1<<20), 10<<20); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(bytes.Repeat([]byte{0x6b}, 5000), 100_000); err != nil {
		t.Fatal(err)
	}
	const keepSize, punchHole, zeroRange = 0x01, 0x02, 0x10
	if err := syscall.Fallocate(int(f.Fd()), keepSize|punchHole, 40<<20, 256<<10); err != nil {
		t.Fatalf("punch a hole through the export: %v", err)
	}
	if err := syscall.Fallocate(int(f.Fd()), keepSize|zeroRange, 50<<20+100, 70_000); err != nil {
		t.Fatalf("zero a range through the export: %v", err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if b := harness.QemuBitmaps(t, img); !slices.Equal(b["bm0"].Flags, []string{"in-use", "auto"}) {
		t.Errorf("during the session qemu-img info shows bm0 %+v, want it in use", b["bm0"])
	}
	d.StopClean()

	raw, err := exec.Command("qemu-img", "check", img).CombinedOutput()
	if out := string(raw); err != nil || strings.Contains(out, "eaked") || strings.Contains(out, "inconsistent") {
		t.Fatalf("qemu-img check after the session: %v\n%s", err, raw)
	}
	b := harness.QemuBitmaps(t, img)
	if !slices.Equal(b["bm0"].Flags, []string{"auto"}) || b["bm0"].Granularity != 64<<10 || !slices.Equal(b["bm1"].Flags, []string{}) {
		t.Errorf("qemu-img info lists %+v; want bm0 auto (not in use), bm1 disabled", b)
	}
	want := harness.DirtyRuns(size, 64<<10, append(written, [2]int64{30 << 20, 4096})...)
	if got := harness.DirtyRanges(t, img, "bm0"); !slices.Equal(got, want) {
		t.Errorf("bm0 dirty blocks %v, want %v", got, want)
	}
	if got := harness.DirtyRanges(t, img, "bm1"); !slices.Equal(got, bm1) {
		t.Errorf("disabled bm1 dirty blocks %v, want %v as before", got, bm1)
	}
	if code, out := harness.RunBlockexport(t, "check", img); code != 0 {
		t.Errorf("blockexport check: exit %d\n%s", code, out)
	}
	code, out := harness.RunBlockexport(t, "info", "--output=json", img)
	var info struct {
		FormatSpecific struct {
			Data struct {
				Bitmaps []harness.QemuBitmap `json:"bitmaps"`
			} `json:"data"`
		} `json:"format-specific"`
	}
	if err := json.Unmarshal([]byte(out), &info); code != 0 || err != nil {
		t.Fatalf("blockexport info: exit %d, %v\n%s", code, err, out)
	}
	ours := map[string]harness.QemuBitmap{}
	for _, x := range info.FormatSpecific.Data.Bitmaps {
		ours[x.Name] = x
	}
	for name, q := range b {
		if o := ours[name]; o.Name != q.Name || o.Granularity != q.Granularity || !slices.Equal(o.Flags, q.Flags) {
			t.Errorf("blockexport info lists %s as %+v, qemu-img as %+v", name, o, q)
		}
	}
}

// TestBitmapStaysInUseWhenTheExportIsKilled: SIGKILL after a write leaves
// bm0 marked in use, so that QEMU's tools know it missed that write.
func TestBitmapStaysInUseWhenTheExportIsKilled(t *testing.T) {
	dir := t.TempDir()
	img := bitmapImage(t, dir)
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, img, mnt, "-w")
	f, err := os.OpenFile(mnt, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(bytes.Repeat([]byte{0x77}, 4096), 8<<20); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	d.Cmd.Process.Kill()
	<-d.Exited
	if b := harness.QemuBitmaps(t, img); !slices.Equal(b["bm0"].Flags, []string{"in-use", "auto"}) || !slices.Equal(b["bm1"].Flags, []string{}) {
		t.Errorf("after SIGKILL qemu-img info lists %+v; want bm0 in use, bm1 untouched", b)
	}
	code, out := harness.RunBlockexport(t, "info", img)
	if code != 0 || !strings.Contains(out, "[0]: in-use") {
		t.Errorf("blockexport info after SIGKILL: exit %d, want bm0 shown in use\n%s", code, out)
	}
}
