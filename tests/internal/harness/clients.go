package harness

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// FioVerifyThroughExport writes ioSize of random 4 KiB blocks at queue
// depth 16 through an export of a new 64 MiB raw image, each checked with
// crc32c as fio reads it back; then the export stops cleanly and the same
// job verifies the image file itself.
func FioVerifyThroughExport(t *testing.T, ioSize string, seed int, exportArgs ...string) {
	t.Helper()
	dir := t.TempDir()
	img := SparseImage(t, dir, "fio.img", 64<<20)
	mnt := filepath.Join(dir, "mnt")
	d := StartExport(t, img, mnt, append([]string{"-f", "raw", "-w"}, exportArgs...)...)
	job := []string{"--name=verify", "--rw=randwrite", "--bs=4k", "--size=64M", "--io_size=" + ioSize,
		"--ioengine=libaio", "--iodepth=16", "--direct=1", "--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0",
		fmt.Sprintf("--randseed=%d", seed), "--minimal"}
	Run(t, "fio", append(job, "--filename="+mnt)...)
	d.StopClean()
	Run(t, "fio", append(job, "--filename="+img, "--verify_only")...)
}

// QemuImgCheck fails the test unless qemu-img check finds the image clean
// (no corruption, no leaks).
func QemuImgCheck(t *testing.T, img string) {
	t.Helper()
	out, err := exec.Command("qemu-img", "check", "-f", "qcow2", img).CombinedOutput()
	if err != nil {
		t.Fatalf("qemu-img check %s: %v\n%s", img, err, out)
	}
}

// ToRaw converts img to a raw file with QEMU's own qcow2 driver.
func ToRaw(t *testing.T, img, dir string) string {
	t.Helper()
	out := filepath.Join(dir, fmt.Sprintf("as-raw-%d.raw", time.Now().UnixNano()))
	Run(t, "qemu-img", "convert", "-f", "qcow2", "-O", "raw", img, out)
	return out
}

// FioJob is a crc32c-verified random-write job on one region of a file.
func FioJob(name, bs, offset, size string, seed int) []string {
	return []string{"--name=" + name, "--rw=randwrite", "--bs=" + bs, "--offset=" + offset, "--size=" + size,
		"--ioengine=libaio", "--iodepth=16", "--direct=1", "--verify=crc32c", "--verify_fatal=1",
		"--verify_state_save=0", "--randseed=" + strconv.Itoa(seed), "--minimal"}
}

// CheckJSON runs a checker's --output=json and returns its exit status and
// the counts it printed.
func CheckJSON(t *testing.T, name string, args ...string) (int, map[string]any) {
	t.Helper()
	cmd := exec.Command(name, args...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("%s %v: %v", name, args, err)
	}
	m := map[string]any{}
	if err := json.Unmarshal(out, &m); err != nil {
		t.Fatalf("%s %v: exit %d, not JSON: %v\n%s\n%s", name, args, code, err, out, stderr.String())
	}
	delete(m, "filename") // the same file, named as each was told
	return code, m
}

// CompareChecks runs both checkers on img and fails unless they agree.
func CompareChecks(t *testing.T, img string) map[string]any {
	t.Helper()
	qcode, q := CheckJSON(t, "qemu-img", "check", "-f", "qcow2", "--output=json", img)
	ocode, o := CheckJSON(t, Bin, "check", "-f", "qcow2", "--output=json", img)
	qj, _ := json.Marshal(q)
	oj, _ := json.Marshal(o)
	if qcode != ocode || string(qj) != string(oj) {
		t.Fatalf("qemu-img check: exit %d %s\nblockexport check: exit %d %s", qcode, qj, ocode, oj)
	}
	return q
}

// QcowChain makes base (raw) <- mid.qcow2 <- top.qcow2 (compressed data in
// mid, zero clusters and data in top) and returns top.
func QcowChain(t *testing.T, dir string) string {
	t.Helper()
	base := RandomImage(t, dir, 6<<20, 11)
	mid := filepath.Join(dir, "mid.qcow2")
	Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "raw", mid, "8M")
	Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x42 1M 512k", "-c", "write -c -P 0x43 4M 64k", mid)
	top := filepath.Join(dir, "top.qcow2")
	Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", "mid.qcow2", "-F", "qcow2", top, "8M")
	Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x44 1200k 100k", "-c", "write -z 2M 128k", "-c", "write -P 0x45 7M 4k", top)
	return top
}

// JSONOf runs a command printing JSON and decodes it.
func JSONOf(t *testing.T, name string, args ...string) any {
	t.Helper()
	var v any
	out := Run(t, name, args...)
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		t.Fatalf("%s %v: %v\n%s", name, args, err, out)
	}
	return v
}

// DataRanges lists a file's data as [start, end) pairs by SEEK_DATA and
// SEEK_HOLE.
func DataRanges(t *testing.T, path string) [][2]int64 {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, _ := f.Stat()
	var r [][2]int64
	for off := int64(0); off < st.Size(); {
		d, err := f.Seek(off, 3) // SEEK_DATA
		if ErrnoOf(err) == syscall.ENXIO {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		h, err := f.Seek(d, 4) // SEEK_HOLE
		if err != nil {
			t.Fatal(err)
		}
		r = append(r, [2]int64{d, h})
		off = h
	}
	return r
}
