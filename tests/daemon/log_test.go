package daemon

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// daemonPid reads the PID a --daemonize run left in pidfile, and stops
// that process at the end of the test.
func daemonPid(t *testing.T, pidfile string) int {
	t.Helper()
	pid := 0
	if b, err := os.ReadFile(pidfile); err == nil {
		fmt.Sscanf(string(b), "%d", &pid)
	}
	if pid > 0 {
		t.Cleanup(func() { stopPid(pid) })
	}
	return pid
}

// stopPid sends SIGTERM to pid and waits (up to 10 s) for it to go.
func stopPid(pid int) bool {
	syscall.Kill(pid, syscall.SIGTERM)
	for i := 0; i < 1000; i++ {
		if syscall.Kill(pid, 0) != nil {
			return true
		}
		time.Sleep(10 * time.Millisecond)
	}
	return false
}

// TestDaemonLogFileKeepsLinesAfterDaemonize: after --daemonize, stderr is /dev/null, so every
// line the daemon logged once up (corruption reports too) was lost. With
// --log-file the lines before and after it is up (serving, stopping) are
// appended to the file, which is created 0600 and keeps what it had. A
// log file that cannot be opened is one line and exit 1, before anything
// starts.
func TestDaemonLogFileKeepsLinesAfterDaemonize(t *testing.T) {
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, 1<<20, 28)
	mnt := filepath.Join(dir, "mnt")
	pidfile := filepath.Join(dir, "pid")
	logf := filepath.Join(dir, "export.log")
	code, out := harness.RunBlockexport(t, "fuse", "-f", "raw", "--daemonize", "--pidfile", pidfile, "--log-file", logf, img, mnt)
	pid := daemonPid(t, pidfile)
	t.Cleanup(func() {
		if harness.IsFuseMount(mnt) {
			syscall.Unmount(mnt, syscall.MNT_DETACH)
		}
	})
	if code != 0 || pid <= 0 {
		t.Fatalf("--daemonize --log-file: exit %d, pid %d: %q", code, pid, out)
	}
	st, err := os.Stat(logf)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Fatalf("log file mode %v, want 0600", st.Mode().Perm())
	}
	b, _ := os.ReadFile(logf)
	if !strings.Contains(string(b), "msg=exporting") {
		t.Fatalf("the log file has no serving line:\n%s", b)
	}
	if !stopPid(pid) {
		t.Fatal("the daemon did not exit on SIGTERM")
	}
	b, _ = os.ReadFile(logf)
	if !strings.Contains(string(b), "msg=stopping") {
		t.Fatalf("a line logged after the daemon was up (stopping) is not in the log file:\n%s", b)
	}

	// Appended to, never truncated.
	before := string(b)
	mnt2 := filepath.Join(dir, "mnt2")
	d := harness.StartDaemon(t, mnt2, harness.Bin, "fuse", "-f", "raw", "--log-file", logf, img, mnt2)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if b, _ = os.ReadFile(logf); strings.Count(string(b), "msg=exporting") == 2 || time.Now().After(deadline) {
			break
		}
	}
	d.StopClean()
	b, _ = os.ReadFile(logf)
	if !strings.HasPrefix(string(b), before) || strings.Count(string(b), "msg=exporting") != 2 {
		t.Fatalf("the second run did not append to the log file:\n%s", b)
	}
	if strings.Contains(d.Log(), "msg=exporting") {
		t.Fatalf("with --log-file the log still went to stderr:\n%s", d.Log())
	}

	// Errors at start: one line, exit 1, nothing mounted or created.
	for _, args := range [][]string{
		{"fuse", "-f", "raw", "--log-file", filepath.Join(dir, "absent", "log"), img, filepath.Join(dir, "mnt3")},
		{"fuse", "-f", "raw", "--daemonize", "--log-file", dir, img, filepath.Join(dir, "mnt3")},
		{"nbd", "-f", "raw", "--listen", "unix:" + filepath.Join(dir, "s.sock"), "--log-file", filepath.Join(dir, "absent", "log"), img},
	} {
		code, out := harness.RunBlockexport(t, args...)
		if code != 1 || strings.Count(out, "\n") != 1 || !strings.Contains(out, "--log-file") {
			t.Fatalf("%v: exit %d, %q; want 1 and one line naming --log-file", args, code, out)
		}
	}
	for _, p := range []string{filepath.Join(dir, "mnt3"), filepath.Join(dir, "s.sock")} {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Fatalf("%s was created by a run refused for its log file", p)
		}
	}
}

// syslogListener is a fake syslog daemon: a datagram socket that collects the
// messages sent to it.
type syslogListener struct {
	mu   sync.Mutex
	msgs []string
}

func (s *syslogListener) text() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return strings.Join(s.msgs, "\n")
}

// listenSyslog listens on a datagram socket at path until the test ends.
func listenSyslog(t *testing.T, path string) *syslogListener {
	t.Helper()
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	s := &syslogListener{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 64<<10)
		for {
			n, err := c.Read(buf)
			if err != nil {
				return
			}
			s.mu.Lock()
			s.msgs = append(s.msgs, string(buf[:n]))
			s.mu.Unlock()
		}
	}()
	t.Cleanup(func() { c.Close(); <-done; os.Remove(path) })
	return s
}

// withDevLog returns a command line that runs argv with target at
// /dev/log: when the machine has a /dev/log, in a private mount namespace
// with target bound over it (the machine's logging is left alone); when it
// has none, target is made there for the test's duration (mk is called to
// make it) and removed after.
func withDevLog(t *testing.T, target string, mk func(path string), argv ...string) []string {
	t.Helper()
	if _, err := os.Lstat("/dev/log"); os.IsNotExist(err) {
		mk("/dev/log")
		t.Cleanup(func() { os.Remove("/dev/log") })
		return argv
	}
	mk(target)
	script := `mount --bind "$0" /dev/log && exec "$@"`
	return append([]string{"unshare", "--mount", "--propagation", "private", "sh", "-c", script, target}, argv...)
}

// TestDaemonLogsToSyslogOrSaysItCannot: a daemon without --log-file logs to syslog
// where /dev/log takes messages (journald reads it), lines after it is up
// included, at the priority of their level; where nothing takes them, it
// says at start, on the caller's terminal, that its log will go nowhere.
func TestDaemonLogsToSyslogOrSaysItCannot(t *testing.T) {
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, 1<<20, 29)
	sock := filepath.Join(dir, "nbd.sock")
	pidfile := filepath.Join(dir, "pid")
	var sl *syslogListener
	argv := withDevLog(t, filepath.Join(dir, "log.sock"), func(p string) { sl = listenSyslog(t, p) },
		harness.Bin, "nbd", "--daemonize", "--pidfile", pidfile, "--listen", "unix:"+sock, "-f", "raw", img)
	out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput()
	pid := daemonPid(t, pidfile)
	if err != nil || pid <= 0 {
		t.Fatalf("--daemonize: %v, pid %d: %s", err, pid, out)
	}
	if !strings.Contains(string(out), "msg=\"serving NBD\"") {
		t.Fatalf("the lines before the daemon is up no longer reach the caller's terminal: %q", out)
	}
	if !stopPid(pid) {
		t.Fatal("the daemon did not exit on SIGTERM")
	}
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(sl.text(), "msg=stopping") && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	got := sl.text()
	// <30>: daemon (3<<3) | info (6).
	if !strings.Contains(got, "<30>") || !strings.Contains(got, "blockexport") || !strings.Contains(got, "msg=\"serving NBD\"") || !strings.Contains(got, "msg=stopping") {
		t.Fatalf("syslog did not get the daemon's lines (serving, then stopping once it was up) at daemon.info:\n%s", got)
	}

	// Nothing takes syslog messages: a warning at start.
	pidfile2 := filepath.Join(dir, "pid2")
	argv = withDevLog(t, filepath.Join(dir, "not-a-socket"), func(p string) {
		if err := os.WriteFile(p, nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}, harness.Bin, "nbd", "--daemonize", "--pidfile", pidfile2, "--listen", "unix:"+filepath.Join(dir, "nbd2.sock"), "-f", "raw", img)
	out, err = exec.Command(argv[0], argv[1:]...).CombinedOutput()
	pid = daemonPid(t, pidfile2)
	if err != nil || pid <= 0 {
		t.Fatalf("--daemonize: %v, pid %d: %s", err, pid, out)
	}
	if !strings.Contains(string(out), "goes nowhere") || !strings.Contains(string(out), "--log-file") {
		t.Fatalf("no warning that the daemon's log goes nowhere: %q", out)
	}
}
