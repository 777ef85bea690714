package daemon

import (
	"bufio"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// mountOptions returns the per-mount options of the FUSE mount on path
// ("" if none).
func mountOptions(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 10 && fields[4] == path && harness.IsFuseMount(path) {
			return fields[5]
		}
	}
	return ""
}

// runAs runs argv (the exporter, or a command that runs it) as the user
// to completion (at most 10 s) and returns its exit code and output,
// leaving the mount, if any, for the caller to see; t.Cleanup detaches it.
func runAs(t *testing.T, u *harness.User, mnt string, argv ...string) (int, string) {
	t.Helper()
	t.Cleanup(func() {
		if harness.IsFuseMount(mnt) {
			syscall.Unmount(mnt, syscall.MNT_DETACH)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "setpriv", u.Argv(argv...)...).CombinedOutput()
	if ctx.Err() != nil {
		return -1, string(out)
	}
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode(), string(out)
	}
	if err != nil {
		t.Fatal(err)
	}
	return 0, string(out)
}

// TestUnprivilegedSetupFailureUnmounts: an ordinary user's export whose
// setup fails after fusermount3 has mounted it once left a dead mount
// (ENOTCONN) and the mountpoint file behind: umount2 as a user fails with
// EPERM. It is undone with fusermount3 -u now. The failure here: the
// process may hold 16 descriptors, and the mount needs about ten, so
// cloning the /dev/fuse queues --queues 64 asks for runs out.
func TestUnprivilegedSetupFailureUnmounts(t *testing.T) {
	u := harness.Unprivileged(t)
	mnt := filepath.Join(u.Dir, "queues.mnt")
	code, out := runAs(t, u, mnt, "prlimit", "--nofile=16:16", harness.Bin, "fuse", "--queues", "64", "null:1M", mnt)
	if code != 1 || !strings.Contains(out, "too many open files") {
		t.Fatalf("exit %d, %q; want 1 and the failed clone of a queue", code, out)
	}
	if harness.IsFuseMount(mnt) {
		t.Fatalf("the failed export left its mount behind: %q", out)
	}
	if _, err := os.Lstat(mnt); !os.IsNotExist(err) {
		t.Fatalf("the failed export left the mountpoint file it created (%v): %q", err, out)
	}
}

// TestUnprivilegedImageNameKeepsReadOnly: fusermount3 reads a backslash in
// fsname= as escaping the next character, so an IMAGE named "x\" turned
// "fsname=x\,ro" into one option and mounted a read-only export writable.
// Names with backslashes and commas keep "ro" now.
func TestUnprivilegedImageNameKeepsReadOnly(t *testing.T) {
	u := harness.Unprivileged(t)
	for i, name := range []string{`back\`, `two\\`, `a\,b`} {
		t.Run(name, func(t *testing.T) {
			img := u.Image(t, name, 1<<20, uint64(31+i))
			mnt := filepath.Join(u.Dir, "name.mnt")
			d := u.Export(t, img, mnt, "-f", "raw")
			opts := mountOptions(t, mnt)
			if !strings.Contains(","+opts+",", ",ro,") {
				t.Fatalf("a read-only export of %q is mounted %q", img, opts)
			}
			d.StopClean()
		})
	}
}
