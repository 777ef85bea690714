package daemon

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestSecondSigtermIsAnOrderlyStop: timeout(1) sends SIGTERM to the process
// and to its group, so the process gets it twice, microseconds apart; the
// second once took the "exiting at once" path, which skipped the final
// flush and left the mount dead and the mountpoint file behind. The same
// signal again at once is now the same request (an orderly stop, exit 0,
// nothing left behind), with nothing in use and with the file held open
// (the unmount retrying when the second comes).
func TestSecondSigtermIsAnOrderlyStop(t *testing.T) {
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, 1<<20, 25)
	for _, busy := range []bool{false, true} {
		name := "idle"
		if busy {
			name = "busy"
		}
		t.Run(name, func(t *testing.T) {
			mnt := filepath.Join(dir, "mnt-"+name)
			d := harness.StartExport(t, img, mnt, "-f", "raw")
			if busy {
				f, err := os.Open(mnt)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { f.Close() })
			}
			d.Cmd.Process.Signal(syscall.SIGTERM)
			if busy {
				time.Sleep(50 * time.Millisecond) // the unmount is retrying (EBUSY)
			}
			d.Cmd.Process.Signal(syscall.SIGTERM)
			if code := d.Wait(20 * time.Second); code != 0 {
				t.Fatalf("exit %d after SIGTERM twice at once; want an orderly stop (0)\n%s", code, d.Log())
			}
			if harness.IsFuseMount(mnt) {
				t.Fatalf("still mounted after two SIGTERMs\n%s", d.Log())
			}
			if _, err := os.Lstat(mnt); !os.IsNotExist(err) {
				t.Fatalf("the mountpoint file we created is left behind (%v)\n%s", err, d.Log())
			}
		})
	}
}

// TestSignalDuringHungStopExitsAndCleansUp: a second signal while a stop hangs (here the
// final flush, to an NBD server that was stopped) exits at once, status 1,
// and still leaves no mount, no mountpoint file and no pidfile of ours.
func TestSignalDuringHungStopExitsAndCleansUp(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "src.raw")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "raw", src, "4M")
	sock := filepath.Join(dir, "s.sock")
	srv := harness.StartServerProc(t, sock, "qemu-nbd", "-f", "raw", "-t", "-k", sock, src)
	t.Cleanup(func() { srv.Cmd.Process.Signal(syscall.SIGCONT) })
	mnt := filepath.Join(dir, "mnt")
	pidfile := filepath.Join(dir, "pid")
	d := harness.StartExport(t, harness.NBDURI("", sock), mnt, "-w", "--reconnect-timeout", "60s", "--pidfile", pidfile)
	// A write, so that the final flush has something to send.
	f, err := os.OpenFile(mnt, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(make([]byte, 4096)); err != nil {
		t.Fatal(err)
	}
	f.Close()
	srv.Cmd.Process.Signal(syscall.SIGSTOP)
	d.Cmd.Process.Signal(syscall.SIGTERM)
	time.Sleep(time.Second)
	select {
	case <-d.Exited:
		t.Fatalf("the stop did not hang on the stopped server; nothing to test\n%s", d.Log())
	default:
	}
	d.Cmd.Process.Signal(syscall.SIGTERM)
	if code := d.Wait(20 * time.Second); code != 1 {
		t.Fatalf("exit %d after a second SIGTERM; want 1 (exited at once)\n%s", code, d.Log())
	}
	if !strings.Contains(d.Log(), "exiting at once") {
		t.Fatalf("no log line for the fast exit:\n%s", d.Log())
	}
	if harness.IsFuseMount(mnt) {
		t.Fatalf("the fast exit left the mount\n%s", d.Log())
	}
	for _, p := range []string{mnt, pidfile} {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Fatalf("the fast exit left %s behind (%v)\n%s", p, err, d.Log())
		}
	}
}

// TestMountpointFileRemovedOnlyIfOurs: the mountpoint file we created is
// removed at exit only if it is still the inode we created. Here the
// export is detached from outside while a reader holds it open, and
// another file is renamed into its place; when the reader lets go the
// export ends, and the file put there must survive (it was removed).
func TestMountpointFileRemovedOnlyIfOurs(t *testing.T) {
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, 1<<20, 26)
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, img, mnt, "-f", "raw")
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
	if code := d.Wait(20 * time.Second); code != 0 {
		t.Fatalf("exit %d\n%s", code, d.Log())
	}
	b, err := os.ReadFile(mnt)
	if err != nil || string(b) != "not the exporter's\n" {
		t.Fatalf("the file renamed into the mountpoint's place was removed or changed at exit: %q %v\n%s", b, err, d.Log())
	}
}

// TestPidfileLockedPrivateAndRemovedOnlyIfOurs: the pidfile is 0600 (a file that was there with another
// mode too) and locked while the export runs; a second instance given the
// same pidfile is refused with one line before it mounts anything; the
// file is removed at exit only if it is still ours; a stale pidfile (no
// holder) is taken over.
func TestPidfileLockedPrivateAndRemovedOnlyIfOurs(t *testing.T) {
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, 1<<20, 27)
	pidfile := filepath.Join(dir, "pid")
	// Stale: left by a process that is gone, world-readable.
	if err := os.WriteFile(pidfile, []byte("999999999\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	d := harness.StartExport(t, img, filepath.Join(dir, "mnt1"), "-f", "raw", "--pidfile", pidfile)
	st, err := os.Stat(pidfile)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Fatalf("pidfile mode %v, want 0600", st.Mode().Perm())
	}
	want := strconv.Itoa(d.Cmd.Process.Pid) + "\n"
	if b, _ := os.ReadFile(pidfile); string(b) != want {
		t.Fatalf("pidfile holds %q, want %q", b, want)
	}
	mnt2 := filepath.Join(dir, "mnt2")
	code, out := harness.RunBlockexport(t, "fuse", "-f", "raw", "--pidfile", pidfile, img, mnt2)
	if code != 1 || strings.Count(out, "\n") != 1 || !strings.Contains(out, "pidfile") || !strings.Contains(out, strconv.Itoa(d.Cmd.Process.Pid)) {
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
	d.StopClean()
	if b, err := os.ReadFile(pidfile); err != nil || string(b) != "1\n" {
		t.Fatalf("a pidfile that was no longer ours was removed or changed at exit: %q %v", b, err)
	}
	os.Remove(pidfile)
	// Ours is removed at exit.
	d = harness.StartExport(t, img, filepath.Join(dir, "mnt3"), "-f", "raw", "--pidfile", pidfile)
	d.StopClean()
	if _, err := os.Lstat(pidfile); !os.IsNotExist(err) {
		t.Fatalf("pidfile left behind: %v", err)
	}
}
