package formats

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// check's exit statuses against qemu-img check's on what is not a corrupt
// qcow2 (usage errors, formats without checks, files too large), and the
// memory a check of a huge sparse image takes.

// checkExit runs name with args and returns its exit status, its output and
// its peak memory in KiB. The peak is GNU time's: Go starts a child with
// vfork, whose exec carries the parent's high-water mark into the child's
// ru_maxrss, so a child of a large (say race-built) test binary would
// report the test's memory, not its own; time(1) forks, so its child's
// figure is the child's.
func checkExit(t *testing.T, name string, args ...string) (int, string, int64) {
	t.Helper()
	peak := filepath.Join(t.TempDir(), "peak")
	cmd := exec.Command("/usr/bin/time", append([]string{"-f", "%M", "-o", peak, name}, args...)...)
	out, err := cmd.CombinedOutput()
	if _, ok := err.(*exec.ExitError); err != nil && !ok {
		t.Fatalf("%s %v: %v", name, args, err)
	}
	b, err := os.ReadFile(peak)
	if err != nil {
		t.Fatalf("time(1) wrote no peak for %s %v: %v", name, args, err)
	}
	// time(1) says "Command exited with non-zero status N" before the
	// figure when the command fails: the figure is the last line.
	lines := strings.Fields(strings.TrimSpace(string(b)))
	kib, err := strconv.ParseInt(lines[len(lines)-1], 10, 64)
	if err != nil {
		t.Fatalf("time(1) peak %q: %v", b, err)
	}
	return cmd.ProcessState.ExitCode(), string(out), kib
}

// TestCheckExitStatusesMatchQemuImg: usage errors exit 1, and a format without
// checks (raw, with or without -r) exits 63 saying so, as in qemu-img.
func TestCheckExitStatusesMatchQemuImg(t *testing.T) {
	dir := t.TempDir()
	raw := harness.SparseImage(t, dir, "r.raw", 1<<20)
	img := filepath.Join(dir, "i.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", img, "1M")
	for _, args := range [][]string{
		{"check", "-f", "raw", raw},
		{"check", "-f", "raw", "-r", "leaks", raw},
		{"check", "-f", "raw", "-r", "all", raw},
		{"check", "-f", "raw", "--output=json", raw},
		{"check", raw},
		{"check", "-r", "bogus", img},
		{"check"},
		{"check", img, img},
		{"check", "--output=bogus", img},
		{"check", "--no-such-flag", img},
	} {
		qcode, qout, _ := checkExit(t, "qemu-img", args...)
		ocode, oout, _ := checkExit(t, harness.Bin, args...)
		if qcode != ocode {
			t.Errorf("%v: qemu-img exits %d, blockexport %d\nqemu-img: %sblockexport: %s", args, qcode, ocode, qout, oout)
		}
		if qcode == 63 && !strings.Contains(oout, "does not support checks") {
			t.Errorf("%v: exit 63 without saying why: %s", args, oout)
		}
	}
	// The null device has no checks either (qemu-img: null-co, 63).
	qcode, qout, _ := checkExit(t, "qemu-img", "check", "null-co://")
	for _, args := range [][]string{{"check", "null:1M"}, {"check", "-r", "all", "null:1M"}} {
		if ocode, oout, _ := checkExit(t, harness.Bin, args...); ocode != qcode || !strings.Contains(oout, "does not support checks") {
			t.Errorf("%v: exit %d (qemu-img on null-co: %d %s)\n%s", args, ocode, qcode, qout, oout)
		}
	}
}

// TestCheckMemoryBoundedOnHugeSparseFiles: the memory of a check is bounded by what the
// image references, not by the file's size (a 64 GiB sparse file of
// 512-byte clusters is 2^27 clusters: qemu-img holds 256 MiB for it), and
// a file of more clusters than QEMU checks (2^31) is refused as qemu-img
// refuses it, up to a file of 2^63-512 bytes, without a panic.
func TestCheckMemoryBoundedOnHugeSparseFiles(t *testing.T) {
	dir := t.TempDir()
	small := filepath.Join(dir, "small.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=512", small, "1M")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 7 0 64k", small)
	img := filepath.Join(dir, "h.qcow2")
	copyFile(t, small, img)
	if err := os.Truncate(img, 64<<30); err != nil {
		t.Fatal(err)
	}
	q := runCheck(t, "qemu-img", "", img)
	o := runCheck(t, harness.Bin, "", img)
	if q.String() != o.String() {
		t.Fatalf("64 GiB sparse: qemu-img %v, blockexport %v\n%s", q, o, o.stderr)
	}
	if _, _, rss := checkExit(t, harness.Bin, "check", img); rss > 64<<10 {
		t.Errorf("checking a 64 GiB sparse file took %d MiB", rss>>10)
	}

	huge := []struct {
		dir  string
		size int64
	}{
		{dir, 512 << 31},          // 2^31 clusters: one more than QEMU's limit
		{"/dev/shm", 1<<63 - 512}, // tmpfs holds files up to 2^63-1 bytes
	}
	for _, h := range huge {
		if _, err := os.Stat(h.dir); err != nil {
			t.Logf("no %s: %v", h.dir, err)
			continue
		}
		hdir, err := os.MkdirTemp(h.dir, "chk-huge-")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(hdir) })
		big := filepath.Join(hdir, "big.qcow2")
		copyFile(t, small, big)
		if err := os.Truncate(big, h.size); err != nil {
			t.Fatalf("truncate to %d: %v", h.size, err)
		}
		for _, mode := range []string{"", "leaks", "all"} {
			args := []string{"check", "-f", "qcow2"}
			if mode != "" {
				args = append(args, "-r", mode)
			}
			args = append(args, big)
			qcode, qout, _ := checkExit(t, "qemu-img", args...)
			ocode, oout, rss := checkExit(t, harness.Bin, args...)
			if qcode != 1 || ocode != 1 || !strings.Contains(oout, "file too large") || strings.Contains(oout, "panic") {
				t.Errorf("%d bytes, %v: qemu-img exit %d, blockexport exit %d\nqemu-img: %sblockexport: %s", h.size, args, qcode, ocode, qout, oout)
			}
			if rss > 64<<10 {
				t.Errorf("%d bytes, %v: %d MiB", h.size, args, rss>>10)
			}
		}
	}
}
