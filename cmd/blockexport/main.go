// Command blockexport presents a disk image (raw, qcow2 or a null device) as
// one regular file through FUSE, the way `qemu-storage-daemon --export
// type=fuse` does.
//
// Exit status: 0 success, 1 runtime error (unreadable image, mount refused),
// 2 usage error (bad flag, bad size, unknown format).
package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"runtime/debug"
	"time"

	"github.com/spf13/pflag"
)

const (
	exitOK      = 0
	exitRuntime = 1
	exitUsage   = 2
)

// usageError marks mistakes in the command line; they exit 2.
type usageError struct{ err error }

func (u usageError) Error() string { return u.err.Error() }
func (u usageError) Unwrap() error { return u.err }

func usagef(format string, a ...any) error { return usageError{fmt.Errorf(format, a...)} }

// pollDuration checks a --poll-us value (fuse and nbd) and converts it.
func pollDuration(us int) (time.Duration, error) {
	if us < 0 || us > 1_000_000 {
		return 0, usagef("--poll-us %d: want 0 to 1000000", us)
	}
	return time.Duration(us) * time.Microsecond, nil
}

type command struct {
	name, summary string
	run           func(args []string, stdout, stderr io.Writer) error
}

func commands() []command {
	return []command{
		{"fuse", "export an image as a regular file through FUSE", runFuse},
		{"info", "describe an image (format, sizes, backing chain, features)", runInfo},
		{"map", "print an image's allocation, as qemu-img map does", runMap},
		{"nbd", "serve an image over NBD (unix socket or TCP)", runNBD},
		{"create", "create a new raw or qcow2 image", runCreate},
		{"check", "check (and repair) an image's metadata, as qemu-img check does", runCheck},
	}
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && (args[0] == "--version" || args[0] == "version") {
		fmt.Fprintln(stdout, version())
		return exitOK
	}
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		w := stdout
		code := exitOK
		if len(args) == 0 {
			w, code = stderr, exitUsage
		}
		topUsage(w)
		return code
	}
	for _, c := range commands() {
		if c.name == args[0] {
			err := c.run(args[1:], stdout, stderr)
			return report(err, stderr)
		}
	}
	fmt.Fprintf(stderr, "blockexport: unknown command %q (see blockexport --help)\n", args[0])
	return exitUsage
}

// version is the module version and the VCS revision of this build, from
// the build information the Go toolchain embeds:
// "blockexport VERSION (REVISION[, modified], TIME) GOVERSION".
func version() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "blockexport (no build information)"
	}
	var rev, when string
	modified := false
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.time":
			when = s.Value
		case "vcs.modified":
			modified = s.Value == "true"
		}
	}
	detail := "revision unknown"
	if rev != "" {
		detail = rev
		if modified {
			detail += ", modified"
		}
		if when != "" {
			detail += ", " + when
		}
	}
	return fmt.Sprintf("blockexport %s (%s) %s", bi.Main.Version, detail, bi.GoVersion)
}

// report prints err as one line and picks the exit status.
func report(err error, stderr io.Writer) int {
	if err == nil || errors.Is(err, pflag.ErrHelp) {
		return exitOK
	}
	var s exitStatus
	if errors.As(err, &s) {
		return int(s) // the command has said why
	}
	fmt.Fprintf(stderr, "blockexport: %v\n", err)
	var u usageError
	if errors.As(err, &u) {
		return exitUsage
	}
	var d daemonExit
	if errors.As(err, &d) {
		return int(d)
	}
	return exitRuntime
}

func topUsage(w io.Writer) {
	fmt.Fprintln(w, "Usage: blockexport COMMAND [flags] ARGS...")
	fmt.Fprintln(w, "\nCommands:")
	for _, c := range commands() {
		fmt.Fprintf(w, "  %-8s %s\n", c.name, c.summary)
	}
	fmt.Fprintf(w, "  %-8s %s\n", "version", "print the version and the VCS revision it was built from (also --version)")
	fmt.Fprintln(w, "\nRun 'blockexport COMMAND --help' for a command's flags.")
}

// newFlagSet makes a flag set that reports errors instead of exiting.
func newFlagSet(name, synopsis string, stdout io.Writer) *pflag.FlagSet {
	fs := pflag.NewFlagSet(name, pflag.ContinueOnError)
	fs.SortFlags = false
	fs.SetOutput(io.Discard) // errors are reported by report(), one line
	fs.Usage = func() {
		fmt.Fprintf(stdout, "Usage: blockexport %s\n\nFlags:\n", synopsis)
		fs.SetOutput(stdout)
		fs.PrintDefaults()
		fs.SetOutput(io.Discard)
	}
	return fs
}

// parseFlags parses args, turning flag errors into usage errors.
func parseFlags(fs *pflag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			return err // pflag has printed the usage
		}
		return usageError{err}
	}
	return nil
}
