package daemon

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// withUringParam sets the fuse module's enable_uring for the test and
// puts the old value back when it ends, also on failure.
func withUringParam(t *testing.T, on bool) {
	t.Helper()
	restore, err := harness.SetUringParam(on)
	if err != nil {
		harness.SkipLoudly(t, "FUSE over io_uring cannot be tested here: %v", err)
	}
	t.Cleanup(restore)
}

// TestIOURingUnavailable: with the module parameter off, --io-uring on is
// refused in one line that says why and how; auto serves /dev/fuse and
// says so once.
func TestIOURingUnavailable(t *testing.T) {
	withUringParam(t, false)
	dir := t.TempDir()
	mnt := filepath.Join(dir, "mnt")
	code, out := harness.TryExport(t, mnt, "--io-uring", "on", "null:1G")
	if code != 1 || !strings.Contains(out, "enable_uring") || strings.Count(strings.TrimSpace(out), "\n") != 0 {
		t.Fatalf("--io-uring on with the module parameter off: exit %d, %q", code, out)
	}
	d := harness.StartExport(t, "null:1G", mnt, "--io-uring", "auto")
	if got := harness.ReadAll(t, mnt)[:4096]; strings.Count(string(got), "\x00") != 4096 {
		t.Fatal("reading the null device through /dev/fuse failed")
	}
	d.StopClean()
	if n := strings.Count(d.Log(), "serving /dev/fuse"); n != 1 {
		t.Fatalf("auto falling back logged it %d times:\n%s", n, d.Log())
	}
	if code, out := harness.TryExport(t, mnt, "--io-uring", "on", "--poll-us", "10", "null:1G"); code != 2 {
		t.Fatalf("--io-uring on with --poll-us: exit %d, %q; want a usage error", code, out)
	}
}

// TestIOURingServes: with the parameter on, requests come through the
// rings (one per possible CPU), fio's crc32c verify passes, --stats
// counts them, and a daemon killed with SIGKILL leaves no client hanging.
func TestIOURingServes(t *testing.T) {
	withUringParam(t, true)
	cpus, err := os.ReadFile("/sys/devices/system/cpu/possible")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	img := harness.SparseImage(t, dir, "u.img", 64<<20)
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, img, mnt, "-f", "raw", "-w", "--io-uring", "on", "--stats", "1s")
	if !strings.Contains(d.Log(), "FUSE over io_uring on") {
		t.Fatalf("the export does not say it serves io_uring:\n%s", d.Log())
	}
	harness.Run(t, "fio", "--name=verify", "--filename="+mnt, "--rw=randwrite", "--bs=4k", "--size=64M", "--io_size=16M",
		"--ioengine=libaio", "--iodepth=16", "--direct=1", "--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0", "--minimal")
	harness.Run(t, "fio", "--name=big", "--filename="+mnt, "--rw=write", "--bs=1M", "--size=64M",
		"--ioengine=libaio", "--iodepth=4", "--direct=1", "--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0", "--minimal")
	d.StopClean()
	// fio wrote 4096 4 KiB blocks and 64 of 1 MiB, and read them back.
	m := regexp.MustCompile(`stats summary.*write (\d+) ops`).FindStringSubmatch(d.Log())
	if n, _ := strconv.Atoi(m2(m)); n < 4096+64 {
		t.Errorf("--stats counted %d writes through the rings, want at least %d:\n%s", n, 4096+64, d.Log())
	}
	harness.Run(t, "fio", "--name=big", "--filename="+img, "--rw=write", "--bs=1M", "--size=64M", "--ioengine=psync",
		"--verify=crc32c", "--verify_only", "--verify_state_save=0", "--minimal")

	// A null device does no host I/O: its only rings are its queues,
	// one per possible CPU. SIGKILL: the kernel aborts the connection;
	// fio fails, it does not hang.
	d = harness.StartExport(t, "null:1G", mnt, "-w", "--io-uring", "on")
	if n, want := fdsTo(t, d.Cmd.Process.Pid, "anon_inode:[io_uring]"), possibleCPUs(t, string(cpus)); n != want {
		t.Fatalf("the daemon holds %d io_uring instances; want one per possible CPU (%s)", n, strings.TrimSpace(string(cpus)))
	}
	fio := exec.Command("fio", "--name=r", "--filename="+mnt, "--rw=randread", "--bs=4k", "--size=1G",
		"--ioengine=libaio", "--iodepth=16", "--direct=1", "--time_based", "--runtime=60", "--minimal")
	if err := fio.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- fio.Wait() }()
	time.Sleep(500 * time.Millisecond)
	d.Cmd.Process.Kill()
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		fio.Process.Kill()
		<-done
		t.Fatal("fio hangs after the daemon was killed")
	}
}

// m2 is a match's first group, or "".
func m2(m []string) string {
	if len(m) < 2 {
		return ""
	}
	return m[1]
}

// possibleCPUs counts the CPUs of a list such as "0-3,8".
func possibleCPUs(t *testing.T, list string) int {
	t.Helper()
	n := 0
	for _, part := range strings.Split(strings.TrimSpace(list), ",") {
		lo, hi, found := strings.Cut(part, "-")
		a, err := strconv.Atoi(lo)
		z := a
		if found {
			z, err = strconv.Atoi(hi)
		}
		if err != nil {
			t.Fatalf("CPU list %q: %v", list, err)
		}
		n += z - a + 1
	}
	return n
}
