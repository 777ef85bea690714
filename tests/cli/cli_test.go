package cli

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/formats/registry"
	"github.com/blockexport/blockexport/tests/internal/harness"
)

// commandNames are the commands every user-facing test below covers.
var commandNames = []string{"fuse", "nbd", "info", "map", "create", "check", "version", "man", "completion", "stream"}

// TestUsageAndExitStatus: the exit statuses of the command line itself
// (the commands' own are tested with them).
func TestUsageAndExitStatus(t *testing.T) {
	cmd := exec.Command(harness.Bin)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 2 || stdout.Len() != 0 || !strings.Contains(stderr.String(), "Usage:") {
		t.Errorf("no command: %v, stdout %q, stderr %q; want exit 2 and the usage on stderr", err, stdout.String(), stderr.String())
	}
	for _, args := range [][]string{{"--help"}, {"help"}, {"-h"}} {
		code, out := harness.RunBlockexport(t, args...)
		if code != 0 || !strings.Contains(out, "Usage:") {
			t.Errorf("%v: exit %d, %q", args, code, out)
		}
		for _, name := range commandNames {
			if !strings.Contains(out, "\n  "+name+" ") {
				t.Errorf("%v does not list %s:\n%s", args, name, out)
			}
		}
	}
	code, out := harness.RunBlockexport(t, "fuze", "x", "y")
	if code != 2 || !strings.Contains(out, `unknown command "fuze"`) || !strings.Contains(out, "did you mean fuse?") || strings.Count(out, "\n") != 1 {
		t.Errorf("fuze: exit %d, %q; want 2, one line and a suggestion", code, out)
	}
	for _, name := range commandNames {
		code, out := harness.RunBlockexport(t, name, "--help")
		if code != 0 || !strings.Contains(out, "blockexport "+name) || !strings.Contains(out, "-h, --help") {
			t.Errorf("%s --help: exit %d, %q", name, code, out)
		}
	}
}

// flagsOf lists the long flags a command's --help shows.
func flagsOf(t *testing.T, name string) []string {
	t.Helper()
	code, out := harness.RunBlockexport(t, name, "--help")
	if code != 0 {
		t.Fatalf("%s --help: exit %d, %s", name, code, out)
	}
	var flags []string
	for _, m := range regexp.MustCompile(`(?m)^\s+(?:-\w, )?(--[a-z0-9-]+)`).FindAllStringSubmatch(out, -1) {
		flags = append(flags, m[1])
	}
	if !slices.Contains(flags, "--help") {
		t.Fatalf("%s --help lists %v; want its flags and --help", name, flags)
	}
	return flags
}

// TestManPages: a page per command, each naming every flag its --help
// shows, that man renders without a warning; and docs/man is what the
// current commands generate.
func TestManPages(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "man1")
	if code, out := harness.RunBlockexport(t, "man", dir); code != 0 {
		t.Fatalf("man: exit %d, %s", code, out)
	}
	for _, name := range append([]string{""}, commandNames...) {
		page := "blockexport.1"
		if name != "" {
			page = "blockexport-" + name + ".1"
		}
		cmd := exec.Command("man", "--warnings", "-l", "-P", "cat", filepath.Join(dir, page))
		cmd.Env = append(os.Environ(), "MANWIDTH=200", "LC_ALL=C.UTF-8")
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil || stderr.Len() != 0 {
			t.Errorf("man -l %s: %v, warnings %q", page, err, stderr.String())
			continue
		}
		// Undo man's line breaks: its hyphenation (U+2010 at a line end)
		// and breaks after a hyphen in a name.
		text := regexp.MustCompile(`\x{2010}\n\s*`).ReplaceAllString(stdout.String(), "")
		text = regexp.MustCompile(`(\w-)\n\s*`).ReplaceAllString(text, "$1")
		text = strings.Join(strings.Fields(text), " ")
		if !strings.Contains(text, "NAME") || !strings.Contains(text, "SYNOPSIS") {
			t.Errorf("%s has no NAME or SYNOPSIS:\n%s", page, text)
		}
		if name == "" {
			for _, sub := range commandNames {
				if !strings.Contains(text, "blockexport-"+sub+"(1)") {
					t.Errorf("blockexport.1 does not refer to blockexport-%s(1)", sub)
				}
			}
			if !strings.Contains(text, "Exit status") {
				t.Errorf("blockexport.1 does not give the exit statuses")
			}
			continue
		}
		for _, flag := range flagsOf(t, name) {
			if !strings.Contains(text, flag) {
				t.Errorf("%s does not describe %s", page, flag)
			}
		}
	}

	// docs/man must be current: make man regenerates it. The .TH line
	// carries the build's date and is left out.
	committed, err := filepath.Glob("../../docs/man/*.1")
	if err != nil || len(committed) == 0 {
		t.Fatalf("docs/man has no pages (%v)", err)
	}
	generated, _ := filepath.Glob(filepath.Join(dir, "*.1"))
	if names(committed) != names(generated) {
		t.Fatalf("docs/man holds %s; the commands generate %s (run make man)", names(committed), names(generated))
	}
	for _, path := range generated {
		want, _ := os.ReadFile(path)
		got, err := os.ReadFile(filepath.Join("../../docs/man", filepath.Base(path)))
		if err != nil || withoutTH(got) != withoutTH(want) {
			t.Errorf("docs/man/%s is stale (run make man)", filepath.Base(path))
		}
	}
}

func names(paths []string) string {
	var n []string
	for _, p := range paths {
		n = append(n, filepath.Base(p))
	}
	slices.Sort(n)
	return strings.Join(n, " ")
}

func withoutTH(page []byte) string {
	return regexp.MustCompile(`(?m)^\.TH .*$`).ReplaceAllString(string(page), "")
}

// TestBashCompletion sources the generated script into bash with
// bash-completion, as a login shell would, and completes command lines.
func TestBashCompletion(t *testing.T) {
	work := t.TempDir()
	for _, f := range []string{"disk.qcow2", "disk.raw", "other.img"} {
		if err := os.WriteFile(filepath.Join(work, f), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cases := []struct {
		line string
		want []string
	}{
		{"blockexport ch", []string{"check"}},
		{"blockexport fuse --cache ", []string{"writeback", "none"}},
		{"blockexport fuse --allow-other ", []string{"auto", "on", "off"}},
		{"blockexport nbd --aio ", []string{"io_uring", "threads"}},
		{"blockexport check -r ", []string{"leaks", "all"}},
		{"blockexport info --output ", []string{"human", "json"}},
		{"blockexport create -f ", registry.CreatableFormats()}, // the registry's, whatever they are
		{"blockexport fuse --fi", []string{"--file-name"}},
		{"blockexport completion ", []string{"bash", "fish", "powershell", "zsh"}},
	}
	var script strings.Builder
	script.WriteString("source /usr/share/bash-completion/bash_completion\nsource <(blockexport completion bash)\n")
	for _, c := range cases {
		words := strings.Fields(c.line)
		if strings.HasSuffix(c.line, " ") {
			words = append(words, "")
		}
		quoted := make([]string, len(words))
		for i, w := range words {
			quoted[i] = "'" + w + "'"
		}
		script.WriteString("COMP_LINE='" + c.line + "'; COMP_POINT=${#COMP_LINE}\n")
		script.WriteString("COMP_WORDS=(" + strings.Join(quoted, " ") + "); COMP_CWORD=$((${#COMP_WORDS[@]}-1))\n")
		script.WriteString("COMPREPLY=(); __start_blockexport 2>/dev/null; echo \"${COMPREPLY[*]}\"\n")
	}
	cmd := exec.Command("bash", "--norc", "--noprofile", "-c", script.String())
	cmd.Dir = work
	cmd.Env = append(os.Environ(), "PATH="+filepath.Dir(harness.Bin)+":"+os.Getenv("PATH"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("bash: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSuffix(string(out), "\n"), "\n")
	if len(lines) != len(cases) {
		t.Fatalf("bash printed %d lines for %d command lines:\n%s", len(lines), len(cases), out)
	}
	for i, c := range cases {
		got := strings.Fields(lines[i])
		slices.Sort(got)
		want := slices.Clone(c.want)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("%q completes to %q; want %q", c.line, got, want)
		}
	}
}

// TestCompletionScripts: zsh and fish get a script too, and all of them
// ask the binary itself (__complete), which answers from the same flags.
func TestCompletionScripts(t *testing.T) {
	for _, shell := range []string{"bash", "zsh", "fish", "powershell"} {
		code, out := harness.RunBlockexport(t, "completion", shell)
		if code != 0 || !strings.Contains(out, "__complete") || len(out) < 1000 {
			t.Errorf("completion %s: exit %d, %d bytes", shell, code, len(out))
		}
	}
	code, out := harness.RunBlockexport(t, "__complete", "fuse", "--allow-other", "")
	if code != 0 || !strings.HasPrefix(out, "auto\non\noff\n:4\n") {
		t.Errorf("__complete fuse --allow-other: exit %d, %q", code, out)
	}
	// IMAGE arguments complete to files (directive 0: the shell's own
	// file completion), flags with a fixed set of values do not (4).
	for _, c := range []struct {
		args      []string
		directive string
	}{
		{[]string{"info", "di"}, ":0\n"},
		{[]string{"fuse", "-w", "disk.img", ""}, ":0\n"},
		{[]string{"man", ""}, ":16\n"}, // directories only
		{[]string{"check", "-f", ""}, ":4\n"},
	} {
		code, out := harness.RunBlockexport(t, append([]string{"__complete"}, c.args...)...)
		if code != 0 || !strings.Contains(out, c.directive) {
			t.Errorf("__complete %q: exit %d, %q; want directive %q", c.args, code, out, c.directive)
		}
	}
}
