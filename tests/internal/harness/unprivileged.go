package harness

import (
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
)

// User holds what a test needs to run commands as TestUser.
type User struct {
	UID, GID int
	Dir      string // a directory the user owns, removed at the end
}

// Unprivileged sets the machine up for a test that runs the exporter as
// an ordinary user, for the test's duration only: the user (created if
// missing, deleted again), /dev/fuse readable and writable by all (as
// distributions ship it; restored after), the test binary's directory
// searchable, and a directory the user owns.
func Unprivileged(t *testing.T) *User {
	t.Helper()
	if _, err := user.Lookup(TestUser); err != nil {
		Run(t, "useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", TestUser)
		t.Cleanup(func() { exec.Command("userdel", TestUser).Run() })
	}
	u, err := user.Lookup(TestUser)
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
	binDir := filepath.Dir(Bin)
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
	return &User{UID: uid, GID: gid, Dir: dir}
}

// Argv prefixes a command line so that it runs as the user.
func (u *User) Argv(args ...string) []string {
	return append([]string{"--reuid", strconv.Itoa(u.UID), "--regid", strconv.Itoa(u.GID), "--init-groups"}, args...)
}

// Run runs a command as the user and returns its combined output.
func (u *User) Run(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command("setpriv", u.Argv(args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("as %s: %v: %v\n%s", TestUser, args, err, out)
	}
	return string(out)
}

// Image makes a random raw image the user owns.
func (u *User) Image(t *testing.T, name string, size int64, seed uint64) string {
	t.Helper()
	src := RandomImage(t, t.TempDir(), size, seed)
	path := filepath.Join(u.Dir, name)
	data, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(path, u.UID, u.GID); err != nil {
		t.Fatal(err)
	}
	return path
}

// Export starts `blockexport fuse ARGS IMAGE MNT` as the user.
func (u *User) Export(t *testing.T, image, mnt string, args ...string) *Daemon {
	t.Helper()
	argv := append([]string{Bin, "fuse"}, args...)
	return StartDaemon(t, mnt, "setpriv", u.Argv(append(argv, image, mnt)...)...)
}

// TestUser is the unprivileged user the tests below run the exporter as.
const TestUser = "bexport-test"
