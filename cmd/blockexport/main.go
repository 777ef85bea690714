// Command blockexport presents a disk image (raw, qcow2, the read-only
// foreign formats, or a null device; a local file, an NBD export or an
// HTTP(S) or S3 object) as one regular file through FUSE, the way
// `qemu-storage-daemon --export type=fuse` does, and serves it over NBD.
//
// Exit status: 0 success, 1 runtime error (unreadable image, mount refused),
// 2 usage error (bad flag, bad size, unknown format); check has qemu-img
// check's own (see check.go).
//
// The commands are cobra commands (one file each) so that shell completion
// and the man pages are generated from the same flag sets the commands
// parse: a flag cannot be added without its completion and its page.
package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"runtime/debug"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/blockexport/blockexport/formats/registry"
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

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run runs the command line args and returns the exit status.
func run(args []string, stdout, stderr io.Writer) int {
	return execute(rootCommand(soleVerb(args)), args, stdout, stderr)
}

// execute runs the command line args on root and returns the exit status.
func execute(root *cobra.Command, args []string, stdout, stderr io.Writer) int {
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	return report(root.Execute(), stderr)
}

// verb builds one command of blockexport; name is the command's name.
type verb struct {
	name  string
	build func() *cobra.Command
}

// verbs are blockexport's commands in the order help lists them.
func verbs() []verb {
	return []verb{{"fuse", fuseCommand}, {"nbd", nbdCommand}, {"daemon", daemonCommand}, {"info", infoCommand}, {"map", mapCommand},
		{"check", checkCommand}, {"create", createCommand}, {"compare", compareCommand}, {"convert", convertCommand},
		{"stream", streamCommand}, {"rebase", rebaseCommand}, {"commit", commitCommand}, {"snapshot", snapshotCommand},
		{"bitmap", bitmapCommand}, {"measure", measureCommand}, {"resize", resizeCommand}, {"dd", ddCommand},
		{"amend", amendCommand}, {"version", versionCommand}, {"man", manCommand}}
}

// soleVerb is the command args run when that command is all the root
// needs ("" otherwise: the whole tree). Building every command (flag
// sets, completions, and cobra's work over them) was 1.2M of the 10.6M
// instructions a measure of a 64 GiB qcow2 ran (valgrind --tool=lackey),
// paid by every call of every verb; a script calls info or measure many
// times. man documents the whole tree, help and completion (cobra's own
// commands) list it, and anything else (a flag of the root's, an
// unknown command) is answered by the root with every command known.
func soleVerb(args []string) string {
	if len(args) == 0 || args[0] == "man" {
		return ""
	}
	for _, v := range verbs() {
		if v.name == args[0] {
			return v.name
		}
	}
	return ""
}

// rootCommand is blockexport and its commands: all of them, or only the
// one named only. The root itself runs only for --version, no command
// at all (usage on stderr, exit 2) and unknown commands (exit 2), as
// before cobra.
func rootCommand(only string) *cobra.Command {
	var showVersion bool
	root := &cobra.Command{
		Use:   "blockexport",
		Short: "export disk images (" + strings.Join(registry.FileFormats(), ", ") + ", null) as a regular file through FUSE, or over NBD",
		Long: "blockexport presents a disk image (" + strings.Join(registry.FileFormats(), ", ") + ", or a null device;\n" +
			"a local file, an NBD export, or an object in HTTP(S) or S3 storage) as one regular file\n" +
			"through FUSE, as qemu-storage-daemon --export type=fuse does, and serves the same\n" +
			"images over NBD. It also inspects (info, map), creates and checks images.\n\n" +
			"Exit status: 0 success, 1 runtime error (an unreadable image, a refused mount),\n" +
			"2 usage error (a bad flag, size or format). check exits as qemu-img check does:\n" +
			"0 clean, 2 corruptions, 3 leaked clusters only, 1 the check could not finish.",
		Args:          cobra.ArbitraryArgs,
		SilenceErrors: true, // report() says it, in one line
		SilenceUsage:  true,
		RunE: func(c *cobra.Command, args []string) error {
			switch {
			case showVersion:
				fmt.Fprintln(c.OutOrStdout(), version())
				return nil
			case len(args) == 0:
				c.SetOut(c.ErrOrStderr())
				c.Usage()
				return exitStatus(exitUsage)
			}
			hint := "see blockexport --help"
			if s := c.SuggestionsFor(args[0]); len(s) > 0 {
				hint = "did you mean " + s[0] + "?"
			}
			return usagef("unknown command %q (%s)", args[0], hint)
		},
	}
	root.SuggestionsMinimumDistance = 2
	root.Flags().BoolVar(&showVersion, "version", false, "print the version and the VCS revision it was built from")
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	root.CompletionOptions.HiddenDefaultCmd = false
	// cobra's completion command (four shells' help texts, formatted
	// each run) only runs in the whole tree: soleVerb never names it.
	root.CompletionOptions.DisableDefaultCmd = only != ""
	for _, v := range verbs() {
		if only == "" || v.name == only {
			root.AddCommand(v.build())
		}
	}
	for _, c := range root.Commands() {
		c.Flags().SortFlags = false // in the order they are declared: most used first
	}
	return root
}

func versionCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "print the version and the VCS revision it was built from (also --version)",
		Args:  noArgs,
		Run:   func(c *cobra.Command, _ []string) { fmt.Fprintln(c.OutOrStdout(), version()) },
	}
}

// noArgs refuses arguments with a usage error.
func noArgs(c *cobra.Command, args []string) error {
	if len(args) > 0 {
		return usagef("%s takes no arguments, got %d", c.Name(), len(args))
	}
	return nil
}

// completeWords makes a flag complete to a fixed set of values.
func completeWords(c *cobra.Command, flag string, words ...string) {
	err := c.RegisterFlagCompletionFunc(flag, func(*cobra.Command, []string, string) ([]string, cobra.ShellCompDirective) {
		return words, cobra.ShellCompDirectiveNoFileComp
	})
	if err != nil {
		panic(fmt.Sprintf("completion for --%s: %v", flag, err)) // a programming error: the flag is not declared
	}
}

// version is the module version and the VCS revision of this build, from
// the build information the Go toolchain embeds:
// "blockexport VERSION (REVISION[, modified], TIME) GOVERSION".
func version() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "blockexport (no build information)"
	}
	vcs := buildSettings(bi)
	detail := "revision unknown"
	if rev := vcs["vcs.revision"]; rev != "" {
		detail = rev
		if vcs["vcs.modified"] == "true" {
			detail += ", modified"
		}
		if when := vcs["vcs.time"]; when != "" {
			detail += ", " + when
		}
	}
	return fmt.Sprintf("blockexport %s (%s) %s", bi.Main.Version, detail, bi.GoVersion)
}

// buildSettings are a build's settings (vcs.revision, vcs.time, ...) by key.
func buildSettings(bi *debug.BuildInfo) map[string]string {
	m := make(map[string]string, len(bi.Settings))
	for _, s := range bi.Settings {
		m[s.Key] = s.Value
	}
	return m
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
