package tests

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// testUser is the unprivileged user the tests below run the exporter as.
const testUser = "bexport-test"

// asUser holds what a test needs to run commands as testUser.
type asUser struct {
	uid, gid int
	dir      string // a directory the user owns, removed at the end
}

// unprivileged sets the machine up for a test that runs the exporter as
// an ordinary user, for the test's duration only: the user (created if
// missing, deleted again), /dev/fuse readable and writable by all (as
// distributions ship it; restored after), the test binary's directory
// searchable, and a directory the user owns.
func unprivileged(t *testing.T) *asUser {
	t.Helper()
	if _, err := user.Lookup(testUser); err != nil {
		run(t, "useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", testUser)
		t.Cleanup(func() { exec.Command("userdel", testUser).Run() })
	}
	u, err := user.Lookup(testUser)
	if err != nil {
		t.Fatal(err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	var st syscall.Stat_t
	if err := syscall.Stat("/dev/fuse", &st); err != nil {
		t.Fatal(err)
	}
	if mode := st.Mode & 0o7777; mode != 0o666 {
		if err := os.Chmod("/dev/fuse", 0o666); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.Chmod("/dev/fuse", os.FileMode(mode)) })
	}
	binDir := filepath.Dir(bin)
	if err := os.Chmod(binDir, 0o755); err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "blockexport-user-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(dir, uid, gid); err != nil {
		t.Fatal(err)
	}
	return &asUser{uid: uid, gid: gid, dir: dir}
}

// argv prefixes a command line so that it runs as the user.
func (u *asUser) argv(args ...string) []string {
	return append([]string{"--reuid", strconv.Itoa(u.uid), "--regid", strconv.Itoa(u.gid), "--init-groups"}, args...)
}

// run runs a command as the user and returns its combined output.
func (u *asUser) run(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command("setpriv", u.argv(args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("as %s: %v: %v\n%s", testUser, args, err, out)
	}
	return string(out)
}

// image makes a random raw image the user owns.
func (u *asUser) image(t *testing.T, name string, size int64, seed uint64) string {
	t.Helper()
	src := randomImage(t, t.TempDir(), size, seed)
	path := filepath.Join(u.dir, name)
	data, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(path, u.uid, u.gid); err != nil {
		t.Fatal(err)
	}
	return path
}

// export starts `blockexport fuse ARGS IMAGE MNT` as the user.
func (u *asUser) export(t *testing.T, image, mnt string, args ...string) *daemon {
	t.Helper()
	argv := append([]string{bin, "fuse"}, args...)
	return startDaemon(t, mnt, "setpriv", u.argv(append(argv, image, mnt)...)...)
}

// TestUnprivilegedExport runs the exporter as an ordinary user, mounting
// through fusermount3: read-only and writable exports of the user's image,
// allow_other and --passthrough auto falling back with one log line each
// (fuse.conf has no user_allow_other; passthrough needs CAP_SYS_ADMIN), SIGTERM unmounting and exiting 0, an external
// fusermount3 -u ending the export with exit 0, and an image the user may
// not read refused with a clear error.
func TestUnprivilegedExport(t *testing.T) {
	if b, _ := os.ReadFile("/etc/fuse.conf"); bytes.Contains(b, []byte("\nuser_allow_other")) || bytes.HasPrefix(b, []byte("user_allow_other")) {
		t.Fatal("/etc/fuse.conf allows user_allow_other: the fallback this test checks cannot happen")
	}
	u := unprivileged(t)
	const size = 4 << 20

	t.Run("read-only, SIGTERM", func(t *testing.T) {
		img := u.image(t, "ro.img", size, 21)
		mnt := filepath.Join(u.dir, "ro.mnt") // created by the exporter
		d := u.export(t, img, mnt, "-f", "raw", "--passthrough", "auto")
		got := u.run(t, "cmp", img, mnt)
		if got != "" {
			t.Fatalf("cmp: %s", got)
		}
		if n := linesWith(d.log(), "allow_other"); n != 1 {
			t.Errorf("want one log line about allow_other falling back, got %d:\n%s", n, d.log())
		}
		if n := linesWith(d.log(), "passthrough"); n != 1 {
			t.Errorf("want one log line about passthrough being unavailable, got %d:\n%s", n, d.log())
		}
		if code := d.stop(); code != 0 {
			t.Fatalf("exit %d after SIGTERM\n%s", code, d.log())
		}
		if isFuseMount(mnt) {
			t.Fatalf("SIGTERM left the mount behind\n%s", d.log())
		}
		if _, err := os.Stat(mnt); !os.IsNotExist(err) {
			t.Fatalf("the mountpoint file the exporter created is still there: %v", err)
		}
		if !strings.Contains(d.log(), "stopping") {
			t.Fatalf("no log line for the signal:\n%s", d.log())
		}
	})

	t.Run("writable, external unmount", func(t *testing.T) {
		img := u.image(t, "rw.img", size, 22)
		mnt := filepath.Join(u.dir, "rw.mnt")
		d := u.export(t, img, mnt, "-f", "raw", "-w")
		patch := u.image(t, "patch", 64<<10, 23)
		u.run(t, "dd", "if="+patch, "of="+mnt, "bs=64k", "seek=3", "conv=notrunc,fsync", "status=none")
		u.run(t, "fusermount3", "-u", mnt)
		if code := d.wait(20 * time.Second); code != 0 {
			t.Fatalf("exit %d after fusermount3 -u\n%s", code, d.log())
		}
		if !strings.Contains(d.log(), "unmounted from outside") {
			t.Fatalf("no log line for the external unmount:\n%s", d.log())
		}
		want, _ := os.ReadFile(patch)
		got, err := os.ReadFile(img)
		if err != nil {
			t.Fatal(err)
		}
		mustEqualBytes(t, "the write through the export", got[3*64<<10:4*64<<10], want)
	})

	t.Run("over the image itself, writable, SIGTERM", func(t *testing.T) {
		img := u.image(t, "self.img", size, 26)
		d := u.export(t, img, img, "-f", "raw", "-w")
		patch := u.image(t, "patch2", 64<<10, 27)
		u.run(t, "dd", "if="+patch, "of="+img, "bs=64k", "seek=1", "conv=notrunc", "status=none")
		time.Sleep(300 * time.Millisecond) // an early "unmounted from outside" would show now
		if !isFuseMount(img) {
			t.Fatalf("the export went away by itself\n%s", d.log())
		}
		if code := d.stop(); code != 0 {
			t.Fatalf("exit %d after SIGTERM\n%s", code, d.log())
		}
		if isFuseMount(img) {
			t.Fatalf("SIGTERM left the mount behind\n%s", d.log())
		}
		want, _ := os.ReadFile(patch)
		got, err := os.ReadFile(img)
		if err != nil {
			t.Fatal(err)
		}
		mustEqualBytes(t, "the write through the export", got[64<<10:128<<10], want)
	})

	t.Run("image the user may not read", func(t *testing.T) {
		img := randomImage(t, t.TempDir(), size, 24) // root's, mode 0644 in a 0700 directory
		mnt := filepath.Join(u.dir, "refused.mnt")
		code, out := tryRun(t, mnt, "setpriv", u.argv(bin, "fuse", "-f", "raw", img, mnt)...)
		if code != 1 || !strings.Contains(out, "permission denied") || strings.Count(out, "\n") != 1 {
			t.Fatalf("exit %d; want 1 and one line saying permission denied, got:\n%s", code, out)
		}
		if isFuseMount(mnt) {
			t.Fatal("a refused export left a mount behind")
		}
	})

	t.Run("daemonize and pidfile", func(t *testing.T) {
		img := u.image(t, "bg.img", size, 25)
		mnt := filepath.Join(u.dir, "bg.mnt")
		pidfile := filepath.Join(u.dir, "bg.pid")
		u.run(t, bin, "fuse", "-f", "raw", "--daemonize", "--pidfile", pidfile, img, mnt)
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
			if isFuseMount(mnt) {
				syscall.Unmount(mnt, syscall.MNT_DETACH)
			}
		})
		if !isFuseMount(mnt) {
			t.Fatal("--daemonize returned before the export was mounted")
		}
		if out := u.run(t, "cmp", img, mnt); out != "" {
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
		if isFuseMount(mnt) {
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
