package main

import (
	"bufio"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"runtime/pprof"
	"strconv"
	"syscall"
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

// stopSignals delivers SIGINT/SIGTERM. SIGPIPE is ignored, so that a log
// reader that went away cannot kill us before we unmount or flush.
func stopSignals() chan os.Signal {
	signal.Ignore(syscall.SIGPIPE)
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	return sigs
}

// stopping logs the first signal and makes a second one end the process at
// once, for a shutdown that hangs.
func stopping(logger *slog.Logger, first os.Signal, sigs chan os.Signal) {
	logger.Info("stopping", "signal", first.String())
	go func() {
		s := <-sigs
		logger.Error("second signal while stopping; exiting at once", "signal", s.String())
		os.Exit(exitRuntime)
	}()
}

// writePidfile writes our PID to path ("" writes nothing) and returns the
// function that removes it.
func writePidfile(path string) (remove func(), err error) {
	if path == "" {
		return func() {}, nil
	}
	if err := os.WriteFile(path, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644); err != nil {
		return nil, fmt.Errorf("pidfile: %w", err)
	}
	return func() { os.Remove(path) }, nil
}

// startCPUProfile profiles the process into path until stop is called.
func startCPUProfile(path string) (stop func(), err error) {
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
