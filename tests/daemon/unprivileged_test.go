package daemon

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestUnprivilegedExport runs the exporter as an ordinary user, mounting
// through fusermount3: read-only and writable exports of the user's image,
// allow_other falling back with one log line (fuse.conf has no
// user_allow_other), SIGTERM unmounting and exiting 0, an external
// fusermount3 -u ending the export with exit 0, and an image the user may
// not read refused with a clear error.
func TestUnprivilegedExport(t *testing.T) {
	if b, _ := os.ReadFile("/etc/fuse.conf"); bytes.Contains(b, []byte("\nuser_allow_other")) || bytes.HasPrefix(b, []byte("user_allow_other")) {
		t.Fatal("/etc/fuse.conf allows user_allow_other: the fallback this test checks cannot happen")
	}
	u := harness.Unprivileged(t)
	const size = 4 << 20

	t.Run("read-only, SIGTERM", func(t *testing.T) {
		img := u.Image(t, "ro.img", size, 21)
		mnt := filepath.Join(u.Dir, "ro.mnt") // created by the exporter
		d := u.Export(t, img, mnt, "-f", "raw")
		got := u.Run(t, "cmp", img, mnt)
		if got != "" {
			t.Fatalf("cmp: %s", got)
		}
		if n := linesWith(d.Log(), "allow_other"); n != 1 {
			t.Errorf("want one log line about allow_other falling back, got %d:\n%s", n, d.Log())
		}
		if code := d.Stop(); code != 0 {
			t.Fatalf("exit %d after SIGTERM\n%s", code, d.Log())
		}
		if harness.IsFuseMount(mnt) {
			t.Fatalf("SIGTERM left the mount behind\n%s", d.Log())
		}
		if _, err := os.Stat(mnt); !os.IsNotExist(err) {
			t.Fatalf("the mountpoint file the exporter created is still there: %v", err)
		}
		if !strings.Contains(d.Log(), "stopping") {
			t.Fatalf("no log line for the signal:\n%s", d.Log())
		}
	})

	t.Run("writable, external unmount", func(t *testing.T) {
		img := u.Image(t, "rw.img", size, 22)
		mnt := filepath.Join(u.Dir, "rw.mnt")
		d := u.Export(t, img, mnt, "-f", "raw", "-w")
		patch := u.Image(t, "patch", 64<<10, 23)
		u.Run(t, "dd", "if="+patch, "of="+mnt, "bs=64k", "seek=3", "conv=notrunc,fsync", "status=none")
		u.Run(t, "fusermount3", "-u", mnt)
		if code := d.Wait(20 * time.Second); code != 0 {
			t.Fatalf("exit %d after fusermount3 -u\n%s", code, d.Log())
		}
		if !strings.Contains(d.Log(), "unmounted from outside") {
			t.Fatalf("no log line for the external unmount:\n%s", d.Log())
		}
		want, _ := os.ReadFile(patch)
		got, err := os.ReadFile(img)
		if err != nil {
			t.Fatal(err)
		}
		harness.MustEqualBytes(t, "the write through the export", got[3*64<<10:4*64<<10], want)
	})

	t.Run("over the image itself, writable, SIGTERM", func(t *testing.T) {
		img := u.Image(t, "self.img", size, 26)
		d := u.Export(t, img, img, "-f", "raw", "-w")
		patch := u.Image(t, "patch2", 64<<10, 27)
		u.Run(t, "dd", "if="+patch, "of="+img, "bs=64k", "seek=1", "conv=notrunc", "status=none")
		time.Sleep(300 * time.Millisecond) // an early "unmounted from outside" would show now
		if !harness.IsFuseMount(img) {
			t.Fatalf("the export went away by itself\n%s", d.Log())
		}
		if code := d.Stop(); code != 0 {
			t.Fatalf("exit %d after SIGTERM\n%s", code, d.Log())
		}
		if harness.IsFuseMount(img) {
			t.Fatalf("SIGTERM left the mount behind\n%s", d.Log())
		}
		want, _ := os.ReadFile(patch)
		got, err := os.ReadFile(img)
		if err != nil {
			t.Fatal(err)
		}
		harness.MustEqualBytes(t, "the write through the export", got[64<<10:128<<10], want)
	})

	t.Run("image the user may not read", func(t *testing.T) {
		img := harness.RandomImage(t, t.TempDir(), size, 24) // root's, mode 0644 in a 0700 directory
		mnt := filepath.Join(u.Dir, "refused.mnt")
		code, out := harness.TryRun(t, mnt, "setpriv", u.Argv(harness.Bin, "fuse", "-f", "raw", img, mnt)...)
		if code != 1 || !strings.Contains(out, "permission denied") || strings.Count(out, "\n") != 1 {
			t.Fatalf("exit %d; want 1 and one line saying permission denied, got:\n%s", code, out)
		}
		if harness.IsFuseMount(mnt) {
			t.Fatal("a refused export left a mount behind")
		}
	})

	t.Run("daemonize and pidfile", func(t *testing.T) {
		img := u.Image(t, "bg.img", size, 25)
		mnt := filepath.Join(u.Dir, "bg.mnt")
		pidfile := filepath.Join(u.Dir, "bg.pid")
		u.Run(t, harness.Bin, "fuse", "-f", "raw", "--daemonize", "--pidfile", pidfile, img, mnt)
		b, err := os.ReadFile(pidfile)
		if err != nil {
			t.Fatal(err)
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			syscall.Kill(pid, syscall.SIGKILL)
			if harness.IsFuseMount(mnt) {
				syscall.Unmount(mnt, syscall.MNT_DETACH)
			}
		})
		if !harness.IsFuseMount(mnt) {
			t.Fatal("--daemonize returned before the export was mounted")
		}
		if out := u.Run(t, "cmp", img, mnt); out != "" {
			t.Fatal(out)
		}
		syscall.Kill(pid, syscall.SIGTERM)
		deadline := time.Now().Add(20 * time.Second)
		for alive(pid) {
			if time.Now().After(deadline) {
				t.Fatal("the background export did not exit after SIGTERM")
			}
			time.Sleep(20 * time.Millisecond)
		}
		if harness.IsFuseMount(mnt) {
			t.Fatal("SIGTERM left the background export's mount behind")
		}
		if _, err := os.Stat(pidfile); !os.IsNotExist(err) {
			t.Fatalf("pidfile left behind: %v", err)
		}
	})
}

// linesWith counts the lines of s that contain sub.
func linesWith(s, sub string) int {
	n := 0
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			n++
		}
	}
	return n
}

// alive says whether pid is running (not gone, not a zombie).
func alive(pid int) bool {
	if syscall.Kill(pid, 0) != nil {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// pid (comm) STATE ...: the state follows the last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] != 'Z'
}
