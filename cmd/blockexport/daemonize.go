package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// --daemonize: the process re-executes itself in a new session with a pipe
// on fd 3. The child opens the image, mounts and starts serving, then writes
// "ready" to the pipe; the parent exits 0 when it reads that, or with the
// child's status (whose error is already on stderr) when the pipe closes
// without it.

const daemonEnv = "BLOCKEXPORT_DAEMON_READY_FD"

// daemonExit carries the child's exit status to the parent's exit.
type daemonExit int

func (d daemonExit) Error() string { return "the background export did not come up" }

func isDaemonChild() bool { return os.Getenv(daemonEnv) != "" }

func daemonize(argv []string) error {
	r, w, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("daemonize: %w", err)
	}
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("daemonize: %w", err)
	}
	devnull, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("daemonize: %w", err)
	}
	defer devnull.Close()
	cmd := exec.Command(self, argv[1:]...)
	cmd.Env = append(os.Environ(), daemonEnv+"=3")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = devnull, devnull, os.Stderr
	cmd.ExtraFiles = []*os.File{w}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("daemonize: %w", err)
	}
	w.Close()
	line, _ := bufio.NewReader(r).ReadString('\n')
	r.Close()
	if line == "ready\n" {
		cmd.Process.Release()
		return nil
	}
	err = cmd.Wait()
	var ee *exec.ExitError
	if errors.As(err, &ee) && ee.ExitCode() > 0 {
		// The child has printed its error; exit with its status, quietly.
		os.Exit(ee.ExitCode())
	}
	return daemonExit(exitRuntime)
}

// notifyReady tells a waiting parent that the export is serving.
func notifyReady() {
	fdStr := os.Getenv(daemonEnv)
	if fdStr == "" {
		return
	}
	fd, err := strconv.Atoi(fdStr)
	if err != nil {
		return
	}
	f := os.NewFile(uintptr(fd), "ready-pipe")
	f.Write([]byte("ready\n"))
	f.Close()
	os.Unsetenv(daemonEnv)
	// Like QEMU's --daemonize: once up, let go of the caller's stderr, so
	// that a caller reading it (a pipe, $(...)) is not held open by us.
	if devnull, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0); err == nil {
		syscall.Dup2(int(devnull.Fd()), 2)
		devnull.Close()
	}
}

// stopSignal is a SIGINT or SIGTERM and when it came.
type stopSignal struct {
	sig os.Signal
	at  time.Time
}

// stopSignals delivers SIGINT/SIGTERM, each stamped on arrival by one
// goroutine that does nothing else: how far apart two signals came is
// then not skewed by how late the serving code got round to the first
// (on a loaded machine, hundreds of milliseconds). SIGPIPE is ignored, so
// that a log reader that went away cannot kill us before we unmount or
// flush.
func stopSignals() chan stopSignal {
	signal.Ignore(syscall.SIGPIPE)
	raw := make(chan os.Signal, 4)
	signal.Notify(raw, syscall.SIGINT, syscall.SIGTERM)
	sigs := make(chan stopSignal, 4)
	go func() {
		for s := range raw {
			sigs <- stopSignal{sig: s, at: time.Now()}
		}
	}()
	return sigs
}

// exitJobs are what a process that exits at once (a second signal while
// stopping) must still undo: the mount, the files it created. Each job is
// safe to run while the orderly shutdown runs too.
type exitJobs struct {
	mu   sync.Mutex
	jobs []func()
}

func (e *exitJobs) add(job func()) {
	e.mu.Lock()
	e.jobs = append(e.jobs, job)
	e.mu.Unlock()
}

// run runs the jobs, the last added first.
func (e *exitJobs) run() {
	e.mu.Lock()
	defer e.mu.Unlock()
	for i := len(e.jobs) - 1; i >= 0; i-- {
		e.jobs[i]()
	}
}

// repeatWindow is how soon after the first signal the same signal again is
// taken for the same request: timeout(1) sends its signal to the process
// and then to its process group, the process included, microseconds apart.
// Taken for a second request, that pair skipped the final flush.
const repeatWindow = 500 * time.Millisecond

// stopping logs the first signal and makes a second one end the process at
// once, for a shutdown that hangs. The fast exit does not wait for
// requests or the final flush, but it still runs the exit jobs, leaving no
// mount or file of ours.
func stopping(logger *slog.Logger, first stopSignal, sigs chan stopSignal, jobs *exitJobs) {
	logger.Info("stopping", "signal", first.sig.String())
	go func() {
		for s := range sigs {
			if s.sig == first.sig && s.at.Sub(first.at) < repeatWindow {
				logger.Debug("the same signal again at once: one request to stop", "signal", s.sig.String())
				continue
			}
			logger.Error("second signal while stopping; exiting at once", "signal", s.sig.String())
			jobs.run()
			os.Exit(exitRuntime)
		}
	}()
}

// writePidfile writes our PID to path ("" writes nothing) and returns the
// function that removes it. The file is ours while we run: mode 0600 and
// locked (flock), so a second instance given the same pidfile is refused
// (with the PID of the one that holds it) instead of overwriting it; and
// it is removed at exit only if path still names the file we locked.
func writePidfile(path string) (remove func(), err error) {
	if path == "" {
		return func() {}, nil
	}
	for try := 0; ; try++ {
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW, 0o600)
		if err != nil {
			return nil, fmt.Errorf("pidfile: %w", err)
		}
		if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
			pid, _ := io.ReadAll(io.LimitReader(f, 32))
			f.Close()
			if errors.Is(err, syscall.EWOULDBLOCK) {
				return nil, fmt.Errorf("pidfile %s is held by another running instance (pid %s)", path, strings.TrimSpace(string(pid)))
			}
			return nil, fmt.Errorf("pidfile %s: lock: %w", path, err)
		}
		// The holder we waited out may have removed the file between
		// our open and our lock: then the lock is on a file nobody
		// else will see; open again.
		same, err := sameFile(f, path)
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("pidfile: %w", err)
		}
		if !same {
			f.Close()
			if try >= 10 {
				return nil, fmt.Errorf("pidfile %s keeps being replaced under us", path)
			}
			continue
		}
		if err := writePid(f); err != nil {
			f.Close()
			return nil, fmt.Errorf("pidfile %s: %w", path, err)
		}
		return sync.OnceFunc(func() {
			// Unlink before letting go of the lock: a new instance
			// that takes the lock then sees the file gone and makes
			// its own.
			if same, _ := sameFile(f, path); same {
				os.Remove(path)
			}
			f.Close()
		}), nil
	}
}

// writePid replaces f's contents with our PID and makes it 0600 (a file
// that was there keeps its mode otherwise).
func writePid(f *os.File) error {
	if err := f.Chmod(0o600); err != nil {
		return err
	}
	if err := f.Truncate(0); err != nil {
		return err
	}
	_, err := f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	return err
}

// sameFile says whether path names the file f has open (not a symlink).
func sameFile(f *os.File, path string) (bool, error) {
	fi, err := f.Stat()
	if err != nil {
		return false, err
	}
	pi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return os.SameFile(fi, pi), nil
}

// startCPUProfile profiles the process into path until stop is called
// ("": no profile, stop does nothing).
func startCPUProfile(path string) (stop func(), err error) {
	if path == "" {
		return func() {}, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("cpuprofile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("cpuprofile: %w", err)
	}
	return func() { pprof.StopCPUProfile(); f.Close() }, nil
}
