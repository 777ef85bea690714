// Package harness is what the end-to-end test packages under tests/
// share: Main (their TestMain: tools, root, the blockexport binary),
// starting and stopping exports and NBD servers, the
// servers remote images are read from (nginx, versitygw), the outside
// clients (fio, qemu-img), and small file helpers. Every helper fails its
// test (t.Fatal) rather than return an error the test would have to check.
package harness

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Bin is the blockexport binary built for this test run; Main sets it
// before any test runs.
var Bin string

// requiredTools maps each client the tests drive to the apt package that
// installs it (.ci/deps installs the same list). A missing one fails the
// run: a test must never pass, or skip, for want of a tool.
var requiredTools = map[string]string{
	"fio": "fio", "qemu-img": "qemu-utils", "qemu-io": "qemu-utils", "qemu-nbd": "qemu-utils",
	"qemu-storage-daemon": "qemu-system-common", "nbdinfo": "libnbd-bin", "nbdcopy": "libnbd-bin",
	"nbdkit": "nbdkit", "losetup": "mount", "mkfs.ext4": "e2fsprogs", "e2fsck": "e2fsprogs",
	"fallocate": "util-linux", "partx": "util-linux", "prlimit": "util-linux", "setpriv": "util-linux", "unshare": "util-linux",
	"sfdisk": "fdisk", "mkfs.vfat": "dosfstools", "fsck.vfat": "dosfstools", "fuse2fs": "fuse2fs",
	"fusermount3": "fuse3", "mount": "mount", "umount": "mount", "script": "bsdutils", "cmp": "diffutils",
	"man": "man-db", "bash": "bash",
}

// blockexportPkg is the command the tests build, named by import path so
// that every package under tests/ builds it alike, whatever its directory.
const blockexportPkg = "github.com/blockexport/blockexport/cmd/blockexport"

// Main is each end-to-end test package's TestMain: it checks the tools and
// root, builds the blockexport binary into a temporary directory (Go's
// build cache makes the builds after the first package's a link), runs
// the tests and exits with their status.
func Main(m *testing.M) {
	var missing, pkgs []string
	for tool, pkg := range requiredTools {
		if _, err := exec.LookPath(tool); err != nil {
			missing = append(missing, tool)
			if !slices.Contains(pkgs, pkg) {
				pkgs = append(pkgs, pkg)
			}
		}
	}
	if len(missing) > 0 {
		slices.Sort(missing)
		slices.Sort(pkgs)
		fmt.Fprintf(os.Stderr, "tests: missing tools %v; install them with: apt-get install -y %s (or run .ci/deps as root)\n", missing, strings.Join(pkgs, " "))
		os.Exit(1)
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "tests: the end-to-end tests mount FUSE file systems and loop devices; run them as root")
		os.Exit(1)
	}
	dir, err := os.MkdirTemp("", "blockexport-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	Bin = filepath.Join(dir, "blockexport")
	// BLOCKEXPORT_RACE=1 builds the exporter with the race detector, so
	// that the end-to-end tests look for data races in the daemon too.
	buildArgs := []string{"build", "-buildvcs=auto", "-o", Bin}
	if os.Getenv("BLOCKEXPORT_RACE") == "1" {
		buildArgs = append(buildArgs, "-race")
	}
	build := exec.Command("go", append(buildArgs, blockexportPkg)...)
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if os.Getenv("BLOCKEXPORT_RACE") != "1" {
		// Static, as make build makes it (the race detector needs cgo).
		build.Env = append(os.Environ(), "CGO_ENABLED=0")
	}
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "tests: building blockexport:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// SkipLoudly skips t for a reason that is no fault of the code under test
// (the kernel lacks a feature, a race the test cannot force) and never for
// a missing tool, which is a failure; it says so on stderr as well, so
// that the skip shows in a run without -v.
func SkipLoudly(t *testing.T, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	fmt.Fprintf(os.Stderr, "SKIPPED %s: %s\n", t.Name(), msg)
	t.Skip(msg)
}

// Daemon is one running export process (ours or qemu-storage-daemon).
type Daemon struct {
	t       *testing.T
	Cmd     *exec.Cmd
	Mnt     string
	LogFile string
	Exited  chan struct{}
	Err     error // the process's exit, valid once exited is closed
}

// StartExport runs `blockexport fuse ARGS... IMAGE MNT` and returns once MNT
// is a FUSE mount. The export is stopped and unmounted in t.Cleanup.
func StartExport(t *testing.T, image, mnt string, args ...string) *Daemon {
	t.Helper()
	argv := append(append([]string{"fuse"}, kernelCacheArgs()...), args...)
	argv = append(argv, image, mnt)
	d := StartDaemon(t, mnt, Bin, argv...)
	// The mount shows as soon as mount(2) returns; the export serves once
	// INIT is answered, which it logs.
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(d.Log(), "exporting"); {
		select {
		case <-d.Exited:
			t.Fatalf("blockexport exited before serving: %v\n%s", d.Err, d.Log())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("blockexport did not say it serves in time\n%s", d.Log())
		}
		time.Sleep(5 * time.Millisecond)
	}
	return d
}

// StartDaemon runs prog ARGV... (an exporter: ours or
// qemu-storage-daemon) and returns once mnt is a FUSE mount; the process
// is stopped and the mount removed in t.Cleanup.
func StartDaemon(t *testing.T, mnt, prog string, argv ...string) *Daemon {
	t.Helper()
	d := &Daemon{t: t, Mnt: mnt, Exited: make(chan struct{})}
	d.LogFile = filepath.Join(t.TempDir(), "daemon.log")
	logFile, err := os.Create(d.LogFile)
	if err != nil {
		t.Fatal(err)
	}
	d.Cmd = exec.Command(prog, argv...)
	d.Cmd.Stdout, d.Cmd.Stderr = logFile, logFile
	if err := d.Cmd.Start(); err != nil {
		t.Fatal(err)
	}
	logFile.Close()
	go func() {
		d.Err = d.Cmd.Wait()
		close(d.Exited)
	}()
	t.Cleanup(d.cleanup)
	deadline := time.Now().Add(15 * time.Second)
	for !IsFuseMount(mnt) {
		select {
		case <-d.Exited:
			t.Fatalf("%s exited before mounting: %v\n%s", filepath.Base(prog), d.Err, d.Log())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not mount %s in time\n%s", filepath.Base(prog), mnt, d.Log())
		}
		time.Sleep(10 * time.Millisecond)
	}
	return d
}

// Log is everything the process wrote to stdout and stderr so far.
func (d *Daemon) Log() string {
	b, _ := os.ReadFile(d.LogFile)
	return string(b)
}

// Stop sends SIGTERM and waits for the exit; it returns the exit code.
func (d *Daemon) Stop() int {
	d.t.Helper()
	select {
	case <-d.Exited:
	default:
		d.Cmd.Process.Signal(syscall.SIGTERM)
	}
	return d.Wait(20 * time.Second)
}

// StopClean stops the process and fails the test unless it exits 0.
func (d *Daemon) StopClean() {
	d.t.Helper()
	if code := d.Stop(); code != 0 {
		d.t.Fatalf("export exit %d\n%s", code, d.Log())
	}
}

// Wait waits for the process to exit by itself and returns its exit code.
func (d *Daemon) Wait(timeout time.Duration) int {
	d.t.Helper()
	select {
	case <-d.Exited:
	case <-time.After(timeout):
		d.t.Fatalf("export did not exit within %v\n%s", timeout, d.Log())
	}
	var ee *exec.ExitError
	if errors.As(d.Err, &ee) {
		return ee.ExitCode()
	}
	if d.Err != nil {
		d.t.Fatalf("waiting for export: %v", d.Err)
	}
	return 0
}

// cleanup leaves nothing behind, whatever the test did: the process is
// stopped (killed if it will not stop) and the mount is gone.
func (d *Daemon) cleanup() {
	select {
	case <-d.Exited:
	default:
		d.Cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-d.Exited:
		case <-time.After(10 * time.Second):
			d.Cmd.Process.Kill()
			<-d.Exited
		}
	}
	if IsFuseMount(d.Mnt) {
		syscall.Unmount(d.Mnt, syscall.MNT_DETACH)
	}
}

// IsFuseMount says whether path is a FUSE mount point in our namespace.
func IsFuseMount(path string) bool {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 10 || fields[4] != path {
			continue
		}
		for i, x := range fields {
			if x == "-" && i+1 < len(fields) && strings.HasPrefix(fields[i+1], "fuse") {
				return true
			}
		}
	}
	return false
}

// RunBlockexport runs the binary to completion and returns its exit code
// and combined output.
func RunBlockexport(t *testing.T, args ...string) (int, string) {
	t.Helper()
	cmd := exec.Command(Bin, args...)
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode(), string(out)
	}
	if err != nil {
		t.Fatalf("running blockexport %v: %v", args, err)
	}
	return 0, string(out)
}

// SmallHost mounts a tmpfs of size (mount's syntax: "256k") under dir, for
// images whose host runs out of space; it is unmounted in t.Cleanup.
func SmallHost(t *testing.T, dir, size string) string {
	t.Helper()
	small := filepath.Join(dir, "small")
	os.Mkdir(small, 0o755)
	Run(t, "mount", "-t", "tmpfs", "-o", "size="+size, "tmpfs", small)
	t.Cleanup(func() { syscall.Unmount(small, syscall.MNT_DETACH) })
	return small
}

// CreateImage runs `blockexport create ARGS...` and fails the test if it
// fails.
func CreateImage(t *testing.T, args ...string) {
	t.Helper()
	if code, out := RunBlockexport(t, append([]string{"create"}, args...)...); code != 0 {
		t.Fatalf("blockexport create %v: exit %d\n%s", args, code, out)
	}
}

// Run runs a client command and fails the test if it fails.
func Run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// RandomImage writes a raw image of size random bytes and returns its path.
func RandomImage(t *testing.T, dir string, size int64, seed uint64) string {
	t.Helper()
	path := filepath.Join(dir, "disk.img")
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	buf := make([]byte, 1<<20)
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for written := int64(0); written < size; {
		n := min(int64(len(buf)), size-written)
		for i := range buf[:n] {
			buf[i] = byte(r.Uint32())
		}
		if _, err := f.Write(buf[:n]); err != nil {
			t.Fatal(err)
		}
		written += n
	}
	return path
}

// SparseImage makes a sparse raw image of size bytes.
func SparseImage(t *testing.T, dir, name string, size int64) string {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, size); err != nil {
		t.Fatal(err)
	}
	return path
}

// FileHash is the SHA-256 of the file at path.
func FileHash(t *testing.T, path string) [32]byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	var sum [32]byte
	copy(sum[:], h.Sum(nil))
	return sum
}

// ReadAll reads the file at path, failing the test on error.
func ReadAll(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// MustEqualBytes fails the test unless got equals want, naming what and
// the first offset where they differ.
func MustEqualBytes(t *testing.T, what string, got, want []byte) {
	t.Helper()
	if !bytes.Equal(got, want) {
		i := 0
		for i < len(got) && i < len(want) && got[i] == want[i] {
			i++
		}
		t.Fatalf("%s: contents differ (len %d vs %d, first difference at %d)", what, len(got), len(want), i)
	}
}

// ErrnoOf digs the errno out of an os error.
func ErrnoOf(err error) syscall.Errno {
	var en syscall.Errno
	if errors.As(err, &en) {
		return en
	}
	return 0
}

// ProcField is the number after key on its line of /proc/PID/FILE
// ("VmHWM:" in status, in KiB; "read_bytes:" in io).
func ProcField(t *testing.T, pid int, file, key string) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/%s", pid, file))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, key); ok {
			f := strings.Fields(rest)
			if len(f) == 0 {
				break
			}
			n, err := strconv.ParseInt(f[0], 10, 64)
			if err != nil {
				t.Fatalf("/proc/%d/%s: %s %q: %v", pid, file, key, rest, err)
			}
			return n
		}
	}
	t.Fatalf("no %s in /proc/%d/%s", key, pid, file)
	return 0
}

// TryExport runs `blockexport fuse ARGS MNT` expecting a refusal; see
// TryRun.
func TryExport(t *testing.T, mnt string, args ...string) (int, string) {
	t.Helper()
	return TryRun(t, mnt, Bin, append(append([]string{"fuse"}, args...), mnt)...)
}

// TryRun runs an export command that should be refused and returns its
// exit code and output. Should the export come up after all, it is
// stopped at a deadline (exit -1) and MNT unmounted, so that the test
// fails instead of hanging.
func TryRun(t *testing.T, mnt, prog string, argv ...string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, prog, argv...).CombinedOutput()
	if IsFuseMount(mnt) {
		syscall.Unmount(mnt, syscall.MNT_DETACH)
	}
	if ctx.Err() != nil {
		return -1, string(out)
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode(), string(out)
	}
	if err != nil {
		t.Fatalf("running %s %v: %v", prog, argv, err)
	}
	return 0, string(out)
}

// WaitUnlocked waits (up to 10 s) until nobody holds a lock on the bytes
// QEMU's image locking uses (100-299) of path. A killed exporter's locks
// go with its last reference to the file, and io_uring drops the
// references of its requests in a kernel worker after the process is
// reaped: qemu-img run at once may still find the image locked.
func WaitUnlocked(t *testing.T, path string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		lk := unix.Flock_t{Type: unix.F_WRLCK, Whence: 0, Start: 100, Len: 200}
		if err := unix.FcntlFlock(f.Fd(), unix.F_OFD_GETLK, &lk); err != nil {
			t.Fatalf("F_OFD_GETLK on %s: %v", path, err)
		}
		if lk.Type == unix.F_UNLCK {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s is still locked 10 s after its exporter exited", path)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
