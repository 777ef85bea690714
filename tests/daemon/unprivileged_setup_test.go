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

// runAs runs the exporter as the user to completion (at most 10 s) and
// returns its exit code and output, leaving the mount, if any, for the
// caller to see; t.Cleanup detaches it.
func runAs(t *testing.T, u *harness.User, mnt string, args ...string) (int, string) {
	t.Helper()
	t.Cleanup(func() {
		if harness.IsFuseMount(mnt) {
			syscall.Unmount(mnt, syscall.MNT_DETACH)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "setpriv", u.Argv(append([]string{harness.Bin}, args...)...)...).CombinedOutput()
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
// setup fails after fusermount3 has mounted it (--passthrough on, which
// needs CAP_SYS_ADMIN or a raw image) once left a dead mount (ENOTCONN)
// and the mountpoint file behind: umount2 as a user fails with EPERM. It
// is undone with fusermount3 -u now.
func TestUnprivilegedSetupFailureUnmounts(t *testing.T) {
	u := harness.Unprivileged(t)
	img := u.Image(t, "pt.img", 1<<20, 30)
	qcow := filepath.Join(u.Dir, "pt.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", qcow, "1M")
	if err := os.Chown(qcow, u.UID, u.GID); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ name, format, image string }{
		{"raw, passthrough refused by the kernel", "raw", img},
		{"qcow2, passthrough impossible", "qcow2", qcow},
	} {
		t.Run(c.name, func(t *testing.T) {
			mnt := filepath.Join(u.Dir, "pt-"+c.format+".mnt")
			code, out := runAs(t, u, mnt, "fuse", "-f", c.format, "--passthrough", "on", c.image, mnt)
			if code != 1 || !strings.Contains(out, "--passthrough on") {
				t.Fatalf("exit %d, %q; want 1 and a line about --passthrough on", code, out)
			}
			if harness.IsFuseMount(mnt) {
				t.Fatalf("the failed export left its mount behind: %q", out)
			}
			if _, err := os.Lstat(mnt); !os.IsNotExist(err) {
				t.Fatalf("the failed export left the mountpoint file it created (%v): %q", err, out)
			}
		})
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
