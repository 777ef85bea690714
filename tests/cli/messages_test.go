package cli

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestNotQcow2SaysSoWithQemuImgExitStatus: `-f qcow2` on a file that is no qcow2 image said
// "corrupt image", which sends a user looking for damage (and `check -r`)
// in a healthy raw file. It says "not a qcow2 image", with qemu-img's exit
// status (1; qemu-img: "Image is not in qcow2 format"), for a raw image
// and for a file too short to hold a header.
func TestNotQcow2SaysSoWithQemuImgExitStatus(t *testing.T) {
	dir := t.TempDir()
	rawImg := filepath.Join(dir, "disk.raw")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "raw", rawImg, "1M")
	tiny := filepath.Join(dir, "tiny")
	if err := os.WriteFile(tiny, []byte("hello"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, img := range []string{rawImg, tiny} {
		for _, cmd := range [][]string{{"info", "-f", "qcow2", img}, {"map", "-f", "qcow2", img}, {"check", "-f", "qcow2", img}} {
			code, out := harness.RunBlockexport(t, cmd...)
			if code != 1 || !strings.Contains(out, "not a qcow2 image") || strings.Contains(out, "corrupt") {
				t.Errorf("%v: exit %d, want 1 and \"not a qcow2 image\" (not \"corrupt\"):\n%s", cmd, code, out)
			}
		}
		mnt := filepath.Join(t.TempDir(), "export")
		if code, out := harness.TryExport(t, mnt, "-f", "qcow2", img); code != 1 || !strings.Contains(out, "not a qcow2 image") {
			t.Errorf("fuse -f qcow2 %s: exit %d:\n%s", filepath.Base(img), code, out)
		}
	}
}

// TestHelpTextNamesNBDImagesAndBooleanFlags: nbd --help (and info's, map's) says that IMAGE may be an
// NBD URI; every boolean flag reads as the flag alone in --help and in the
// man pages alike, a true default said in words (the pages said
// --writable[=false], as if the flag's value were false, and
// --null-read-zeroes[=true]).
func TestHelpTextNamesNBDImagesAndBooleanFlags(t *testing.T) {
	for _, name := range []string{"nbd", "fuse", "info", "map"} {
		_, out := harness.RunBlockexport(t, name, "--help")
		for _, form := range []string{"nbd://", "nbds://", "nbd+unix://"} {
			if !strings.Contains(out, form) {
				t.Errorf("%s --help does not say IMAGE may be %s...:\n%s", name, form, out)
			}
		}
	}
	dir := filepath.Join(t.TempDir(), "man1")
	if code, out := harness.RunBlockexport(t, "man", dir); code != 0 {
		t.Fatalf("man: exit %d, %s", code, out)
	}
	pages, _ := filepath.Glob(filepath.Join(dir, "*.1"))
	// A boolean flag in --help is the flag and its usage, with no value.
	boolInHelp := regexp.MustCompile(`(?m)^\s+(?:-\w, )?--([a-z0-9-]+) {2,}(.*?)( \(default true\))?$`)
	for _, name := range commandNames {
		_, help := harness.RunBlockexport(t, name, "--help")
		page, err := os.ReadFile(filepath.Join(dir, "blockexport-"+name+".1"))
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, m := range boolInHelp.FindAllStringSubmatch(help, -1) {
			want := `\fB--` + m[1] + "\\fP\n\t" + m[2] + m[3] + "\n"
			if !strings.Contains(string(page), want) {
				t.Errorf("blockexport-%s.1: --%s is boolean in --help but not %q in the page", name, m[1], want)
			}
			n++
		}
		if name == "fuse" && n < 11 { // -w, --copy-on-read, --null-read-zeroes, --daemonize, --allow-redirects, --s3-path-style, --growable, --mapped-reads, --adaptive-poll, --partitions, -h
			t.Errorf("fuse --help shows %d boolean flags, want 11 or more:\n%s", n, help)
		}
	}
	for _, p := range pages {
		b, _ := os.ReadFile(p)
		if m := regexp.MustCompile(`\\fP\[=(true|false)\]`).Find(b); m != nil {
			t.Errorf("%s: a boolean flag shows its default as its value: %s", filepath.Base(p), m)
		}
	}
}

// TestUsageErrorsInPlainWords: the usage errors about IMAGE and --format
// said "bad image spec: ..."; they say what is wrong in plain words, and
// still exit 2.
func TestUsageErrorsInPlainWords(t *testing.T) {
	dir := t.TempDir()
	rawImg := filepath.Join(dir, "disk.raw")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "raw", rawImg, "1M")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"info", "-f", "vmdx", rawImg}, `unknown format "vmdx"`},
		{[]string{"info", "-f", "qed", rawImg}, "qed images are not supported yet"},
		{[]string{"info", "null:lots"}, `null device "null:lots"`},
		{[]string{"info", "-f", "null", rawImg}, "a null device is given as null:SIZE"},
		{[]string{"info", "-f", "qcow2", "nbd://localhost/disk"}, "is an NBD export, which is raw bytes"},
		{[]string{"info", "nbd://localhost/disk?bogus=1"}, `unknown query parameter "bogus"`},
		// The formats a message asks for are the ones read here.
		{[]string{"info", "-f", "vmdx", rawImg}, "want auto, null, qcow2, raw, vmdk, vhdx, vpc or vdi"},
		{[]string{"create", "-f", "qcow2", "-b", rawImg, "-F", "null", filepath.Join(dir, "o.qcow2"), "1M"}, "want qcow2, raw, vmdk, vhdx, vpc or vdi"},
		{[]string{"convert", "-O", "qcow2", "-B", rawImg, "-F", "null", rawImg, filepath.Join(dir, "c.qcow2")}, "want qcow2, raw, vmdk, vhdx, vpc or vdi"},
	} {
		code, out := harness.RunBlockexport(t, c.args...)
		if code != 2 || !strings.Contains(out, c.want) || strings.Contains(out, "spec") {
			t.Errorf("%v: exit %d, want 2 and %q in plain words:\n%s", c.args, code, c.want, out)
		}
	}
}

// userExport runs `blockexport fuse ARGS null:64M MNT` as nobody in a
// private mount namespace where /dev/fuse is a node of the given mode (so
// that the machine's own /dev/fuse, which other tests change, is left
// alone). It returns the process and a channel of its output lines.
func userExport(t *testing.T, mode uint32, args ...string) (*exec.Cmd, <-chan string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "prb-devfuse-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	node := filepath.Join(dir, "fuse")
	if err := unix.Mknod(node, unix.S_IFCHR|mode, int(unix.Mkdev(10, 229))); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(node, os.FileMode(mode)); err != nil { // past the umask
		t.Fatal(err)
	}
	for _, d := range []string{dir, filepath.Dir(harness.Bin)} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	user := filepath.Join(dir, "user")
	if err := os.Mkdir(user, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(user, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	script := `mount --bind "$1" /dev/fuse && shift && exec setpriv --reuid=65534 --regid=65534 --clear-groups "$@"`
	argv := append([]string{"-m", "--propagation", "private", "sh", "-c", script, "sh", node, harness.Bin, "fuse"}, args...)
	cmd := exec.Command("unshare", append(argv, "null:64M", filepath.Join(user, "mnt"))...)
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = pw, pw
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pw.Close()
	lines := make(chan string, 100)
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
		pr.Close()
	}()
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	return cmd, lines
}

// TestDevFuseDeniedSaysWhatToDo: a user who may not open /dev/fuse (mode 0600, as
// this machine has it) was told "fusermount3: exit status 1: fusermount3:
// failed to open /dev/fuse: Permission denied"; the refusal says what to
// do. And the PR_SET_IO_FLUSHER line, which an unprivileged export printed
// on every start, is a debug line.
func TestDevFuseDeniedSaysWhatToDo(t *testing.T) {
	t.Run("permission denied", func(t *testing.T) {
		cmd, lines := userExport(t, 0o600)
		var out []string
		timeout := time.After(15 * time.Second)
	collect:
		for {
			select {
			case l, ok := <-lines:
				if !ok {
					break collect
				}
				out = append(out, l)
			case <-timeout:
				t.Fatalf("the export neither failed nor stopped:\n%s", strings.Join(out, "\n"))
			}
		}
		cmd.Wait()
		text := strings.Join(out, "\n")
		if cmd.ProcessState.ExitCode() != 1 || len(out) != 1 || !strings.Contains(text, "/dev/fuse") ||
			!strings.Contains(text, "run as root") || !strings.Contains(text, "0666") {
			t.Errorf("exit %d, want 1 and one line saying what to do about /dev/fuse:\n%s", cmd.ProcessState.ExitCode(), text)
		}
	})
	for _, level := range []string{"info", "debug"} {
		t.Run("io flusher at "+level, func(t *testing.T) {
			cmd, lines := userExport(t, 0o666, "--log-level", level)
			var out []string
			timeout := time.After(15 * time.Second)
			for up := false; !up; {
				select {
				case l, ok := <-lines:
					if !ok {
						t.Fatalf("the export ended:\n%s", strings.Join(out, "\n"))
					}
					out = append(out, l)
					up = strings.Contains(l, "msg=exporting")
				case <-timeout:
					t.Fatalf("the export did not come up:\n%s", strings.Join(out, "\n"))
				}
			}
			cmd.Process.Signal(syscall.SIGTERM)
			for l := range lines {
				out = append(out, l)
			}
			cmd.Wait()
			text := strings.Join(out, "\n")
			if got, want := strings.Contains(text, "PR_SET_IO_FLUSHER"), level == "debug"; got != want {
				t.Errorf("--log-level %s: the PR_SET_IO_FLUSHER line printed %t, want %t:\n%s", level, got, want, text)
			}
		})
	}
}
