package tests

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestLfcSecondSigtermCleansUp: timeout(1) and systemd send SIGTERM twice
// in a row (to the process and to its group); the second one takes the
// "exiting at once" path, which once left the mount dead and the
// mountpoint file we had created behind. The fast path still unmounts and
// removes what it created: with nothing in use (the two signals back to
// back), and with the file held open, so that the first SIGTERM's unmount
// is still retrying when the second comes.
func TestLfcSecondSigtermCleansUp(t *testing.T) {
	dir := t.TempDir()
	img := randomImage(t, dir, 1<<20, 25)
	for _, busy := range []bool{false, true} {
		name := "idle"
		if busy {
			name = "busy"
		}
		t.Run(name, func(t *testing.T) {
			mnt := filepath.Join(dir, "mnt-"+name)
			d := startExport(t, img, mnt, "-f", "raw")
			if busy {
				f, err := os.Open(mnt)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { f.Close() })
			}
			d.cmd.Process.Signal(syscall.SIGTERM)
			if busy {
				time.Sleep(50 * time.Millisecond) // the unmount is retrying (EBUSY)
			}
			d.cmd.Process.Signal(syscall.SIGTERM)
			d.wait(20 * time.Second)
			if isFuseMount(mnt) {
				t.Fatalf("still mounted after two SIGTERMs\n%s", d.log())
			}
			if _, err := os.Lstat(mnt); !os.IsNotExist(err) {
				t.Fatalf("the mountpoint file we created is left behind (%v)\n%s", err, d.log())
			}
		})
	}
}

// TestLfcMountpointRemovedOnlyIfOurs: the mountpoint file we created is
// removed at exit only if it is still the inode we created. Here the
// export is detached from outside while a reader holds it open, and
// another file is renamed into its place; when the reader lets go the
// export ends, and the file put there must survive (it was removed).
func TestLfcMountpointRemovedOnlyIfOurs(t *testing.T) {
	dir := t.TempDir()
	img := randomImage(t, dir, 1<<20, 26)
	mnt := filepath.Join(dir, "mnt")
	d := startExport(t, img, mnt, "-f", "raw")
	held, err := os.Open(mnt)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	if err := syscall.Unmount(mnt, syscall.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	theirs := filepath.Join(dir, "theirs")
	if err := os.WriteFile(theirs, []byte("not the exporter's\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(theirs, mnt); err != nil {
		t.Fatal(err)
	}
	held.Close() // the last user: the FUSE connection ends, the export exits
	if code := d.wait(20 * time.Second); code != 0 {
		t.Fatalf("exit %d\n%s", code, d.log())
	}
	b, err := os.ReadFile(mnt)
	if err != nil || string(b) != "not the exporter's\n" {
		t.Fatalf("the file renamed into the mountpoint's place was removed or changed at exit: %q %v\n%s", b, err, d.log())
	}
}

// TestLfcPidfile: the pidfile is 0600 (a file that was there with another
// mode too) and locked while the export runs; a second instance given the
// same pidfile is refused with one line before it mounts anything; the
// file is removed at exit only if it is still ours; a stale pidfile (no
// holder) is taken over.
func TestLfcPidfile(t *testing.T) {
	dir := t.TempDir()
	img := randomImage(t, dir, 1<<20, 27)
	pidfile := filepath.Join(dir, "pid")
	// Stale: left by a process that is gone, world-readable.
	if err := os.WriteFile(pidfile, []byte("999999999\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	d := startExport(t, img, filepath.Join(dir, "mnt1"), "-f", "raw", "--pidfile", pidfile)
	st, err := os.Stat(pidfile)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Fatalf("pidfile mode %v, want 0600", st.Mode().Perm())
	}
	want := strconv.Itoa(d.cmd.Process.Pid) + "\n"
	if b, _ := os.ReadFile(pidfile); string(b) != want {
		t.Fatalf("pidfile holds %q, want %q", b, want)
	}
	mnt2 := filepath.Join(dir, "mnt2")
	code, out := runBlockexport(t, "fuse", "-f", "raw", "--pidfile", pidfile, img, mnt2)
	if code != 1 || strings.Count(out, "\n") != 1 || !strings.Contains(out, "pidfile") || !strings.Contains(out, strconv.Itoa(d.cmd.Process.Pid)) {
		t.Fatalf("a second instance with the same pidfile: exit %d, %q; want 1 and one line naming the pidfile and its holder", code, out)
	}
	if _, err := os.Lstat(mnt2); !os.IsNotExist(err) {
		t.Fatalf("the refused instance created its mountpoint (%v)", err)
	}
	if b, _ := os.ReadFile(pidfile); string(b) != want {
		t.Fatalf("the refused instance changed the pidfile to %q", b)
	}
	// Someone else's file in its place is not ours to remove.
	theirs := filepath.Join(dir, "theirs")
	os.WriteFile(theirs, []byte("1\n"), 0o644)
	if err := os.Rename(theirs, pidfile); err != nil {
		t.Fatal(err)
	}
	d.stopClean()
	if b, err := os.ReadFile(pidfile); err != nil || string(b) != "1\n" {
		t.Fatalf("a pidfile that was no longer ours was removed or changed at exit: %q %v", b, err)
	}
	os.Remove(pidfile)
	// Ours is removed at exit.
	d = startExport(t, img, filepath.Join(dir, "mnt3"), "-f", "raw", "--pidfile", pidfile)
	d.stopClean()
	if _, err := os.Lstat(pidfile); !os.IsNotExist(err) {
		t.Fatalf("pidfile left behind: %v", err)
	}
}
