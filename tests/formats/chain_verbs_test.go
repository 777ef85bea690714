package formats

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// A chain of images for rebase and commit, built by qemu-img and qemu-io
// in one directory, named relative to it: base (raw or qcow2), then mid
// when three levels, then top. The base is shorter than the layers above
// it; the layers hold sparse, overlapping, compressed and zero clusters.
type chain struct {
	baseFormat string
	levels     int      // 2 or 3
	size       int64    // of mid and top
	layers     []string // top first
	// other adds other.qcow2, an image apart from the chain whose data
	// differs from it almost everywhere, to rebase onto.
	other bool
	// bitmaps adds a persistent dirty bitmap to each qcow2 layer.
	bitmaps bool
}

func (c chain) formatOf(name string) string {
	if name == "base.raw" {
		return "raw"
	}
	return "qcow2"
}

// build makes the chain in dir.
func (c *chain) build(t *testing.T, dir string) {
	t.Helper()
	mb := func(n int64) string { return fmt.Sprint(n << 20) }
	base := "base." + c.baseFormat
	run := func(args ...string) {
		t.Helper()
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out)
		}
	}
	baseSize := c.size * 3 / 4
	run("qemu-img", "create", "-q", "-f", c.baseFormat, base, fmt.Sprint(baseSize))
	run("qemu-io", "-f", c.baseFormat, "-c", "write -P 0x11 0 "+mb(c.size>>21), "-c", "write -P 0x12 "+fmt.Sprint(baseSize-(64<<10))+" 64k", base)
	below, belowFormat := base, c.baseFormat
	c.layers = []string{base}
	if c.levels == 3 {
		run("qemu-img", "create", "-q", "-f", "qcow2", "-b", below, "-F", belowFormat, "mid.qcow2", fmt.Sprint(c.size))
		run("qemu-io", "-f", "qcow2", "-c", "write -P 0x22 1M 3M", "-c", "write -c -P 0x23 "+mb(c.size>>21+1)+" 128k",
			"-c", "write -z 6M 1M", "-c", "write -P 0x24 "+fmt.Sprint(c.size-100<<10)+" 100k", "mid.qcow2")
		below, belowFormat = "mid.qcow2", "qcow2"
		c.layers = append([]string{"mid.qcow2"}, c.layers...)
	}
	run("qemu-img", "create", "-q", "-f", "qcow2", "-b", below, "-F", belowFormat, "top.qcow2", fmt.Sprint(c.size))
	run("qemu-io", "-f", "qcow2", "-c", "write -P 0x33 2560k 2M", "-c", "write -c -P 0x34 "+fmt.Sprint(c.size/2+1<<20)+" 192k", "-c", "write -z 300k 200k",
		"-c", "write -P 0x35 "+fmt.Sprint(c.size-(1<<20)+4096)+" 100k", "-c", "write -P 0x36 "+mb(c.size>>21)+" 40k", "top.qcow2")
	c.layers = append([]string{"top.qcow2"}, c.layers...)
	// Clusters scattered over the rest, so that a job takes a while.
	rng := rand.New(rand.NewPCG(uint64(c.size), uint64(c.levels)))
	var cmds []string
	for range c.size >> 21 {
		cmds = append(cmds, "-c", fmt.Sprintf("write -P %#x %d 64k", 0x40+rng.IntN(64), rng.Int64N(c.size>>16)<<16))
	}
	run(append(append([]string{"qemu-io", "-f", "qcow2"}, cmds...), "top.qcow2")...)
	if c.bitmaps {
		for _, l := range c.layers {
			if c.formatOf(l) == "qcow2" {
				run("qemu-img", "bitmap", "--add", "-g", "128k", l, "backup-"+strings.TrimSuffix(l, ".qcow2"))
			}
		}
	}
	if c.other {
		run("qemu-img", "create", "-q", "-f", "qcow2", "other.qcow2", fmt.Sprint(baseSize))
		run("qemu-io", "-f", "qcow2", "-c", "write -P 0x77 0 5M", "-c", "write -P 0x11 0 1M", "other.qcow2")
		c.layers = append(c.layers, "other.qcow2")
	}
}

// copyTo copies the chain's files from dir into a new directory.
func (c chain) copyTo(t *testing.T, dir string) string {
	t.Helper()
	to, err := os.MkdirTemp(filepath.Dir(dir), "copy-")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range c.layers {
		harness.Run(t, "cp", "--sparse=always", filepath.Join(dir, l), filepath.Join(to, l))
	}
	return to
}

// runIn runs a command in dir and returns its exit status and output.
func runIn(t *testing.T, dir string, args ...string) (int, string) {
	t.Helper()
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode(), string(out)
	}
	if err != nil {
		t.Fatalf("%v: %v", args, err)
	}
	return 0, string(out)
}

// guestView is what a layer reads as (its backing chain included), raw.
func guestView(t *testing.T, dir, layer, format string) []byte {
	t.Helper()
	out := filepath.Join(t.TempDir(), "view.raw")
	if code, msg := runIn(t, dir, "qemu-img", "convert", "-U", "-f", format, "-O", "raw", layer, out); code != 0 {
		t.Fatalf("qemu-img convert %s/%s: exit %d\n%s", dir, layer, code, msg)
	}
	return harness.ReadAll(t, out)
}

// chainInfo is what qemu-img info --backing-chain says of each layer's
// name, format, size and backing file.
func chainInfo(t *testing.T, dir string) string {
	t.Helper()
	code, out := runIn(t, dir, "qemu-img", "info", "-U", "--backing-chain", "--output", "json", "top.qcow2")
	if code != 0 {
		t.Fatalf("qemu-img info: exit %d\n%s", code, out)
	}
	var layers []map[string]any
	if err := json.Unmarshal([]byte(out), &layers); err != nil {
		t.Fatalf("qemu-img info: %v\n%s", err, out)
	}
	var b strings.Builder
	for _, l := range layers {
		var bitmaps any
		if fs, ok := l["format-specific"].(map[string]any); ok {
			if d, ok := fs["data"].(map[string]any); ok {
				bitmaps = d["bitmaps"] // names, granularity and flags (in-use, auto)
			}
		}
		fmt.Fprintf(&b, "%v %v %v %v %v %v %v\n", l["filename"], l["format"], l["virtual-size"], l["backing-filename"],
			l["backing-filename-format"], l["full-backing-filename"] != nil, bitmaps)
	}
	return b.String()
}

// checkClean fails unless qemu-img check finds no corruption in each
// qcow2 layer (leaks: only when leaksAllowed).
func checkClean(t *testing.T, c chain, dir string, leaksAllowed bool) {
	t.Helper()
	for _, l := range c.layers {
		if c.formatOf(l) != "qcow2" {
			continue
		}
		code, out := runIn(t, dir, "qemu-img", "check", "-U", "-f", "qcow2", l)
		if code != 0 && !(leaksAllowed && code == 3) {
			t.Fatalf("qemu-img check %s: exit %d\n%s", l, code, out)
		}
	}
}

// differential runs the verb through qemu-img on one copy of the chain
// and through blockexport on another, and compares the exit status, every
// layer's content, the chain's info and the checks.
func differential(t *testing.T, c chain, args ...string) {
	t.Helper()
	dir := t.TempDir()
	c.build(t, dir)
	theirs, ours := c.copyTo(t, dir), c.copyTo(t, dir)
	qcode, qout := runIn(t, theirs, append([]string{"qemu-img"}, args...)...)
	bcode, bout := runIn(t, ours, append([]string{harness.Bin}, args...)...)
	if qcode != bcode {
		t.Fatalf("%v: exit %d, qemu-img's %d\nours: %s\nqemu-img's: %s", args, bcode, qcode, bout, qout)
	}
	if qcode != 0 {
		t.Fatalf("%v failed: %s", args, qout)
	}
	if strings.Contains(qout, "Image committed.") != strings.Contains(bout, "Image committed.") {
		t.Errorf("%v: output %q, qemu-img's %q", args, bout, qout)
	}
	for _, l := range c.layers {
		got, want := guestView(t, ours, l, c.formatOf(l)), guestView(t, theirs, l, c.formatOf(l))
		if !bytes.Equal(got, want) {
			t.Errorf("%v: %s reads differently from qemu-img's (%d and %d bytes)", args, l, len(got), len(want))
		}
	}
	if got, want := chainInfo(t, ours), chainInfo(t, theirs); got != want {
		t.Errorf("%v: the chain is\n%s\nqemu-img's is\n%s", args, got, want)
	}
	checkClean(t, c, ours, false)
}

func TestCommitMatchesQemuImg(t *testing.T) {
	for _, tc := range []struct {
		name  string
		c     chain
		extra []string
	}{
		{"into a raw backing file", chain{baseFormat: "raw", levels: 2, size: 16 << 20}, nil},
		{"into a qcow2 backing file", chain{baseFormat: "qcow2", levels: 2, size: 16 << 20}, nil},
		{"three levels into the middle", chain{baseFormat: "qcow2", levels: 3, size: 16 << 20}, nil},
		{"kept with -d", chain{baseFormat: "raw", levels: 3, size: 16 << 20}, []string{"-d"}},
		{"into a raw base with -b", chain{baseFormat: "raw", levels: 3, size: 16 << 20}, []string{"-b", "base.raw"}},
		{"into a qcow2 base with -b", chain{baseFormat: "qcow2", levels: 3, size: 16 << 20}, []string{"-b", "base.qcow2"}},
		{"with a rate limit and progress", chain{baseFormat: "qcow2", levels: 2, size: 8 << 20}, []string{"-p", "-r", "64M"}},
		{"keeping the bitmaps", chain{baseFormat: "qcow2", levels: 3, size: 16 << 20, bitmaps: true}, nil},
		{"growing a base that has bitmaps", chain{baseFormat: "qcow2", levels: 2, size: 16 << 20, bitmaps: true}, nil},
		{"growing a base that has bitmaps with -b", chain{baseFormat: "qcow2", levels: 3, size: 16 << 20, bitmaps: true}, []string{"-b", "base.qcow2"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel() // each case builds its chain in a directory of its own
			differential(t, tc.c, append(append([]string{"commit"}, tc.extra...), "top.qcow2")...)
		})
	}
}

func TestRebaseMatchesQemuImg(t *testing.T) {
	for _, tc := range []struct {
		name string
		c    chain
		args []string
	}{
		{"onto the base below the middle", chain{baseFormat: "raw", levels: 3, size: 16 << 20}, []string{"-b", "base.raw", "-F", "raw"}},
		{"onto a qcow2 base with progress", chain{baseFormat: "qcow2", levels: 3, size: 16 << 20}, []string{"-p", "-b", "base.qcow2", "-F", "qcow2"}},
		{"flattened", chain{baseFormat: "qcow2", levels: 3, size: 16 << 20}, []string{"-b", ""}},
		{"flattened over a raw base", chain{baseFormat: "raw", levels: 2, size: 16 << 20}, []string{"-b", ""}},
		{"unsafe onto the base", chain{baseFormat: "qcow2", levels: 3, size: 16 << 20}, []string{"-u", "-b", "base.qcow2", "-F", "qcow2"}},
		{"unsafe, the format changed", chain{baseFormat: "qcow2", levels: 3, size: 16 << 20}, []string{"-u", "-b", "base.qcow2", "-F", "raw"}},
		{"unsafe without a backing file", chain{baseFormat: "raw", levels: 2, size: 8 << 20}, []string{"-u"}},
		{"keeping the bitmaps", chain{baseFormat: "qcow2", levels: 3, size: 16 << 20, bitmaps: true}, []string{"-b", "base.qcow2", "-F", "qcow2"}},
		{"flattened keeping the bitmaps", chain{baseFormat: "raw", levels: 2, size: 16 << 20, bitmaps: true}, []string{"-b", ""}},
		{"unsafe keeping the bitmaps", chain{baseFormat: "qcow2", levels: 3, size: 16 << 20, bitmaps: true}, []string{"-u", "-b", "base.qcow2", "-F", "raw"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel() // each case builds its chain in a directory of its own
			differential(t, tc.c, append(append([]string{"rebase"}, tc.args...), "top.qcow2")...)
		})
	}
}

// TestRebaseOntoAnUnrelatedImageKeepsTheContent rebases onto an image the
// chain never held, whose data differs almost everywhere.
func TestRebaseOntoAnUnrelatedImageKeepsTheContent(t *testing.T) {
	c := chain{baseFormat: "raw", levels: 3, size: 16 << 20, other: true}
	differential(t, c, "rebase", "-b", "other.qcow2", "-F", "qcow2", "top.qcow2")
}

// killAtRandom starts blockexport args in dir, SIGKILLs it after a random
// delay below max, and says whether it had finished.
func killAtRandom(t *testing.T, rng *rand.Rand, dir string, maxDelay time.Duration, args ...string) bool {
	t.Helper()
	cmd := exec.Command(harness.Bin, args...)
	cmd.Dir = dir
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() { cmd.Process.Kill() })
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out.String())
		}
		return true
	case <-time.After(time.Duration(rng.Int64N(int64(maxDelay)))):
		cmd.Process.Signal(syscall.SIGKILL)
		<-done
		return false
	}
}

// sameOrEither fails unless each block of got is that of before or of after.
func sameOrEither(t *testing.T, what string, got, before, after []byte) {
	t.Helper()
	const block = 64 << 10
	if len(got) != len(before) && len(got) != len(after) {
		t.Fatalf("%s: %d bytes, before %d, after %d", what, len(got), len(before), len(after))
	}
	pad := func(b []byte) []byte { return append(b, make([]byte, max(0, len(got)-len(b)))...) }
	before, after = pad(bytes.Clone(before)), pad(bytes.Clone(after))
	for off := 0; off < len(got); off += block {
		end := min(off+block, len(got))
		if !bytes.Equal(got[off:end], before[off:end]) && !bytes.Equal(got[off:end], after[off:end]) {
			t.Fatalf("%s: the block at %d reads neither as before nor as after", what, off)
		}
	}
}

// crashTest kills the verb at random moments on fresh copies of the chain
// and checks every layer reads as before or as after, and checks clean
// but for leaks. wholeLayers are the layers that must read entirely as
// before (the top of a commit, every layer of a rebase).
func crashTest(t *testing.T, c chain, iterations int, args ...string) {
	dir := t.TempDir()
	c.build(t, dir)
	views := func(d string) map[string][]byte {
		m := map[string][]byte{}
		for _, l := range c.layers {
			m[l] = guestView(t, d, l, c.formatOf(l))
		}
		return m
	}
	before := views(dir)
	finished := c.copyTo(t, dir)
	start := time.Now()
	if code, out := runIn(t, finished, append([]string{harness.Bin}, args...)...); code != 0 {
		t.Fatalf("%v: exit %d\n%s", args, code, out)
	}
	// Kills spread over the whole run, and a little past it.
	maxDelay := max(time.Since(start)*5/4, 20*time.Millisecond)
	after := views(finished)
	infoBefore, infoAfter := chainInfo(t, dir), chainInfo(t, finished)
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 46))
	killed, switched := 0, 0
	for i := range iterations {
		work := c.copyTo(t, dir)
		if !killAtRandom(t, rng, work, maxDelay, args...) {
			killed++
		}
		switch info := chainInfo(t, work); info {
		case infoBefore:
		case infoAfter:
			switched++
		default:
			t.Fatalf("iteration %d: the chain is\n%s\nneither as before\n%s\nnor as after\n%s", i, info, infoBefore, infoAfter)
		}
		checkClean(t, c, work, true)
		got := views(work)
		for _, l := range c.layers {
			sameOrEither(t, fmt.Sprintf("iteration %d: %s", i, l), got[l], before[l], after[l])
		}
		if !bytes.Equal(got["top.qcow2"], before["top.qcow2"]) {
			t.Fatalf("iteration %d: the top reads differently after a kill", i)
		}
		os.RemoveAll(work)
	}
	if killed == 0 {
		t.Fatalf("%v finished before every kill: no crash was tested", args)
	}
	t.Logf("%d of %d runs killed (each of up to %v); %d ended with the chain as after", killed, iterations, maxDelay, switched)
}

func TestCommitKilledAtRandomLeavesEveryLayerReadable(t *testing.T) {
	crashTest(t, chain{baseFormat: "qcow2", levels: 3, size: 32 << 20}, 8, "commit", "--parallel", "2", "top.qcow2")
}

func TestCommitIntoTheBaseKilledAtRandomLeavesTheTopReadable(t *testing.T) {
	crashTest(t, chain{baseFormat: "raw", levels: 3, size: 32 << 20}, 8, "commit", "--parallel", "2", "-b", "base.raw", "top.qcow2")
}

func TestRebaseKilledAtRandomLeavesEveryLayerReadable(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"onto the base", []string{"rebase", "--parallel", "2", "-b", "base.qcow2", "-F", "qcow2", "top.qcow2"}},
		{"flattened", []string{"rebase", "--parallel", "2", "-b", "", "top.qcow2"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			crashTest(t, chain{baseFormat: "qcow2", levels: 3, size: 32 << 20}, 8, tc.args...)
		})
	}
}

// TestCommitRefusedWhileAnotherProcessHoldsALayer: while qemu-io holds a
// layer of the chain (the base, a layer between, or the top; for writing
// or, where commit would write it, for reading), commit is refused as
// qemu-img refuses it: the same words and exit status, and every layer
// reads as before. The layers it only reads are locked as qemu-img locks
// them, so a writer of the base refuses it before anything is written.
func TestCommitRefusedWhileAnotherProcessHoldsALayer(t *testing.T) {
	c := chain{baseFormat: "qcow2", levels: 3, size: 8 << 20}
	for _, tc := range []struct {
		held string
		args []string
	}{
		{"base.qcow2", []string{"commit", "top.qcow2"}},
		{"base.qcow2", []string{"commit", "-b", "base.qcow2", "top.qcow2"}},
		{"mid.qcow2", []string{"commit", "-b", "base.qcow2", "top.qcow2"}},
		{"mid.qcow2", []string{"commit", "top.qcow2"}},
		{"top.qcow2", []string{"commit", "-d", "top.qcow2"}},
	} {
		dir := t.TempDir()
		c.build(t, dir)
		theirs, ours := c.copyTo(t, dir), c.copyTo(t, dir)
		views := map[string][]byte{}
		for _, l := range c.layers {
			views[l] = guestView(t, ours, l, c.formatOf(l))
		}
		harness.HoldImage(t, filepath.Join(theirs, tc.held))
		harness.HoldImage(t, filepath.Join(ours, tc.held))
		qcode, qout := runIn(t, theirs, append([]string{"qemu-img"}, tc.args...)...)
		bcode, bout := runIn(t, ours, append([]string{harness.Bin}, tc.args...)...)
		if qcode == 0 || bcode != qcode || bout != strings.ReplaceAll(qout, "qemu-img:", "blockexport:") {
			t.Errorf("%v with %s held: exit %d, qemu-img's %d\nours: %s\nqemu-img's: %s", tc.args, tc.held, bcode, qcode, bout, qout)
		}
		for _, l := range c.layers {
			if !bytes.Equal(guestView(t, ours, l, c.formatOf(l)), views[l]) {
				t.Errorf("%v with %s held: %s changed", tc.args, tc.held, l)
			}
		}
	}
}

// TestChainVerbsRefuseWhatQemuImgRefuses: a missing backing file, a loop
// in the chain, a base not in the chain, no backing file: the same exit
// status as qemu-img, one line, no panic.
func TestChainVerbsRefuseWhatQemuImgRefuses(t *testing.T) {
	dir := t.TempDir()
	mk := func(args ...string) {
		t.Helper()
		if code, out := runIn(t, dir, args...); code != 0 {
			t.Fatalf("%v: %s", args, out)
		}
	}
	mk("qemu-img", "create", "-q", "-f", "qcow2", "alone.qcow2", "1M")
	mk("qemu-img", "create", "-q", "-f", "qcow2", "gone.qcow2", "1M")
	mk("qemu-img", "create", "-q", "-f", "qcow2", "-b", "gone.qcow2", "-F", "qcow2", "orphan.qcow2")
	os.Remove(filepath.Join(dir, "gone.qcow2"))
	mk("qemu-img", "create", "-q", "-f", "qcow2", "loop-a.qcow2", "1M")
	mk("qemu-img", "create", "-q", "-f", "qcow2", "-b", "loop-a.qcow2", "-F", "qcow2", "loop-b.qcow2")
	mk("qemu-img", "rebase", "-u", "-b", "loop-b.qcow2", "-F", "qcow2", "loop-a.qcow2")
	mk("qemu-img", "create", "-q", "-f", "qcow2", "base.qcow2", "1M")
	mk("qemu-img", "create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", "top.qcow2")
	for _, args := range [][]string{
		{"commit", "alone.qcow2"},
		{"commit", "orphan.qcow2"},
		{"commit", "loop-b.qcow2"},
		{"commit", "-b", "alone.qcow2", "top.qcow2"},
		{"commit", "-b", "top.qcow2", "top.qcow2"},
		{"commit", "-r", "fast", "top.qcow2"},
		{"commit", "-t", "bogus", "top.qcow2"},
		{"commit"},
		{"rebase", "top.qcow2"},
		{"rebase", "-b", "gone.qcow2", "-F", "qcow2", "top.qcow2"},
		{"rebase", "-b", "base.qcow2", "top.qcow2"},
		{"rebase", "-u", "-b", "base.qcow2", "top.qcow2"},
		{"rebase", "-b", "", "orphan.qcow2"},
		{"rebase", "-b", "", "loop-b.qcow2"},
		{"rebase", "-b", "", "top.qcow2", "alone.qcow2"},
	} {
		qcode, qout := runIn(t, dir, append([]string{"qemu-img"}, args...)...)
		bcode, bout := runIn(t, dir, append([]string{harness.Bin}, args...)...)
		if bcode != qcode || strings.Contains(bout, "panic") || strings.Contains(bout, "goroutine") {
			t.Errorf("%v: exit %d, qemu-img's %d\nours: %s\nqemu-img's: %s", args, bcode, qcode, bout, qout)
		}
		if bcode != 0 && strings.Count(strings.TrimSpace(bout), "\n") != 0 {
			t.Errorf("%v: more than one line: %s", args, bout)
		}
	}
}

// TestChainVerbsInterruptedExit130WithTheChainConsistent sends SIGINT
// during commit (slowed by -r) and rebase: exit 130, one line, every
// layer reads as before or as after, and checks clean.
func TestChainVerbsInterruptedExit130WithTheChainConsistent(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"commit", []string{"commit", "-r", "16M", "top.qcow2"}},
		{"rebase", []string{"rebase", "--parallel", "1", "-b", "", "top.qcow2"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := chain{baseFormat: "qcow2", levels: 3, size: 96 << 20}
			dir := t.TempDir()
			c.build(t, dir)
			before := map[string][]byte{}
			for _, l := range c.layers {
				before[l] = guestView(t, dir, l, c.formatOf(l))
			}
			// SIGINTs spread over an uninterrupted run's time: a fixed
			// 100 ms came after an idle machine's whole rebase.
			if code, out := runIn(t, c.copyTo(t, dir), append([]string{harness.Bin}, tc.args...)...); code != 0 {
				t.Fatalf("%v: exit %d\n%s", tc.args, code, out)
			}
			start := time.Now()
			if code, out := runIn(t, c.copyTo(t, dir), append([]string{harness.Bin}, tc.args...)...); code != 0 {
				t.Fatalf("%v: exit %d\n%s", tc.args, code, out)
			}
			full := time.Since(start)
			interrupted := false
			for try := 0; try < 8 && !interrupted; try++ {
				work := c.copyTo(t, dir)
				cmd := exec.Command(harness.Bin, tc.args...)
				cmd.Dir = work
				var out bytes.Buffer
				cmd.Stdout, cmd.Stderr = &out, &out
				if err := cmd.Start(); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { cmd.Process.Kill() })
				time.Sleep(full * time.Duration(try+2) / 10)
				cmd.Process.Signal(syscall.SIGINT)
				err := cmd.Wait()
				code := cmd.ProcessState.ExitCode()
				switch {
				case err == nil:
					continue // finished first
				case cmd.ProcessState.Sys().(syscall.WaitStatus).Signaled():
					continue // before its handler was set: too early; later tries wait longer
				case code != 130:
					t.Fatalf("%v interrupted: exit %d, want 130\n%s", tc.args, code, out.String())
				case strings.Count(strings.TrimSpace(out.String()), "\n") != 0 || !strings.Contains(out.String(), "interrupted"):
					t.Errorf("%v interrupted: want one line that says so, got %q", tc.args, out.String())
				}
				interrupted = true
				checkClean(t, c, work, false)
				top := guestView(t, work, "top.qcow2", "qcow2")
				if !bytes.Equal(top, before["top.qcow2"]) {
					t.Fatalf("%v interrupted: the top reads differently", tc.args)
				}
			}
			if !interrupted {
				t.Fatalf("%v finished before every SIGINT", tc.args)
			}
		})
	}
}
