package remote

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// Attacks on copy-on-read and `blockexport stream`, as an outsider would
// try them: qemu-img is the oracle throughout.

// streamLines runs a stream to its end and returns its JSON lines and
// exit error.
func streamLines(t *testing.T, over string) ([]streamStep, error, string) {
	t.Helper()
	cmd, lines, stderr := startStream(t, over)
	var steps []streamStep
	for lines.Scan() {
		var s streamStep
		if err := json.Unmarshal(lines.Bytes(), &s); err != nil {
			t.Fatalf("a progress line that is no JSON: %q", lines.Text())
		}
		steps = append(steps, s)
	}
	err := cmd.Wait()
	return steps, err, stderr.String()
}

// copyOf copies the raw file path next to it and returns the copy's path
// (mustBeStandalone renames the backing file away to compare without it).
func copyOf(t *testing.T, path string) string {
	t.Helper()
	want := path + ".want"
	harness.Run(t, "cp", "--sparse=always", path, want)
	return want
}

// TestStreamProgressNeverOverstatesDurable: no step says more is durable than is
// done, and the completed line says all of it is durable (it said 0).
func TestStreamProgressNeverOverstatesDurable(t *testing.T) {
	dir := t.TempDir()
	base := backingBase(t, dir, 48<<20, 21)
	over := overlayOf(t, dir, base)
	steps, err, stderr := streamLines(t, over)
	if err != nil {
		t.Fatalf("stream: %v\n%s", err, stderr)
	}
	last := steps[len(steps)-1]
	if last.Event != "completed" || last.Done != last.Total || last.Durable != last.Done {
		t.Fatalf("the completed line: %+v", last)
	}
	for _, s := range steps {
		if s.Durable > s.Done || s.Done > s.Total {
			t.Fatalf("a step says more durable than done: %+v", s)
		}
	}
	mustBeStandalone(t, over, copyOf(t, base), base)
}

// TestStreamRefusesOverlayWithInternalSnapshots: the overlay's internal snapshot
// reads the backing file through its unallocated clusters too; a stream
// that dropped the backing file (QEMU's block-stream does) would make
// the snapshot read zeroes there. Refused in one line before copying.
func TestStreamRefusesOverlayWithInternalSnapshots(t *testing.T) {
	dir := t.TempDir()
	base := backingBase(t, dir, 8<<20, 22)
	over := overlayOf(t, dir, base)
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x44 0 64k", over)
	harness.Run(t, "qemu-img", "snapshot", "-c", "s1", over)
	snap := filepath.Join(dir, "snap.raw")
	harness.Run(t, "qemu-img", "convert", "-l", "snapshot.name=s1", "-O", "raw", over, snap)
	code, out := harness.RunBlockexport(t, "stream", "--progress", "none", over)
	if code == 0 || !strings.Contains(out, "snapshot") || strings.Count(strings.TrimSpace(out), "\n") != 0 {
		t.Fatalf("stream of an overlay with a snapshot: exit %d\n%s", code, out)
	}
	var info map[string]any
	json.Unmarshal([]byte(harness.Run(t, "qemu-img", "info", "--output=json", over)), &info)
	if info["backing-filename"] == nil {
		t.Fatal("the refused stream dropped the backing file")
	}
	got := filepath.Join(dir, "snap-after.raw")
	harness.Run(t, "qemu-img", "convert", "-l", "snapshot.name=s1", "-O", "raw", over, got)
	harness.Run(t, "qemu-img", "compare", "-q", "-f", "raw", "-F", "raw", snap, got)
	checkClean(t, over)
}

// TestStreamKilledRepeatedlyResumesConsistently: one overlay, its stream killed
// (SIGKILL and SIGINT in turn) at steps early and late, and resumed each
// time: after every interruption the overlay reads as its backing file
// (qemu-img compare), qemu-img finds no corruption, and the backing file
// is still named; the last run completes standalone.
func TestStreamKilledRepeatedlyResumesConsistently(t *testing.T) {
	dir := t.TempDir()
	base := backingBase(t, dir, 64<<20, 23)
	over := overlayOf(t, dir, base)
	sigs := []syscall.Signal{syscall.SIGKILL, syscall.SIGINT}
	finished := false
	for round, at := range []int{1, 3, 0, 7, 2, 12, 5} {
		sig := sigs[round%2]
		cmd, lines, stderr := startStream(t, over)
		n := 0
		for lines.Scan() {
			if n >= at {
				break
			}
			n++
		}
		cmd.Process.Signal(sig)
		go func() {
			for lines.Scan() {
			}
		}()
		err := cmd.Wait()
		if err == nil {
			finished = true
			break // it finished before the signal: the rest is checked below
		}
		out, _ := exec.Command("qemu-img", "check", "--output=json", over).Output()
		var check struct {
			Corruptions int `json:"corruptions"`
			Leaks       int `json:"leaks"`
		}
		if jerr := json.Unmarshal(out, &check); jerr != nil || check.Corruptions != 0 || sig == syscall.SIGINT && check.Leaks != 0 {
			t.Fatalf("round %d (%v at line %d): qemu-img check: %v\n%s\n%s", round, sig, at, jerr, out, stderr)
		}
		var info map[string]any
		json.Unmarshal([]byte(harness.Run(t, "qemu-img", "info", "--output=json", over)), &info)
		if info["backing-filename"] == nil {
			t.Fatalf("round %d: an interrupted stream dropped the backing file", round)
		}
		harness.Run(t, "qemu-img", "compare", "-q", "-F", "raw", over, base)
	}
	if !finished {
		streamToEnd(t, over)
	}
	mustBeStandalone(t, over, copyOf(t, base), base)
}

// TestStreamOutOfSpaceFailsAndResumes: the overlay's file system fills up mid-stream:
// the stream fails (exit 1, one line), the overlay still reads as its
// backing file with no corruption, and once there is room a rerun
// completes standalone and clean.
func TestStreamOutOfSpaceFailsAndResumes(t *testing.T) {
	dir := t.TempDir()
	base := backingBase(t, dir, 32<<20, 24)
	small := harness.SmallHost(t, dir, "12m")
	over := overlayOf(t, small, base)
	steps, err, stderr := streamLines(t, over)
	if err == nil {
		t.Fatal("a 32 MiB stream into a 12 MiB file system succeeded")
	}
	if !strings.Contains(stderr, "no space left") {
		t.Fatalf("stream out of space said: %q", stderr)
	}
	for _, s := range steps {
		if s.Event == "completed" {
			t.Fatal("an out-of-space stream said it completed")
		}
	}
	out, _ := exec.Command("qemu-img", "check", "--output=json", over).Output()
	var check struct {
		Corruptions int `json:"corruptions"`
	}
	if jerr := json.Unmarshal(out, &check); jerr != nil || check.Corruptions != 0 {
		t.Fatalf("qemu-img check after ENOSPC: %v\n%s", jerr, out)
	}
	harness.Run(t, "qemu-img", "compare", "-q", "-F", "raw", over, base)
	harness.Run(t, "mount", "-o", "remount,size=64m", small)
	streamToEnd(t, over)
	mustBeStandalone(t, over, copyOf(t, base), base)
}

// TestStreamOfHTTPObjectReplacedMidStreamKeepsOldBytes: the backing object on nginx
// is replaced (same size, new bytes) while a stream pulls it in: the
// stream fails (If-Match), or completes from what it had cached; either
// way every cluster the overlay holds has the old object's bytes (the
// overlay rebased unsafely onto a local copy of the old object equals
// it), no corruption, and a failed stream leaves the backing file named.
func TestStreamOfHTTPObjectReplacedMidStreamKeepsOldBytes(t *testing.T) {
	n := harness.StartNginx(t)
	dir := t.TempDir()
	v1 := harness.RandomImage(t, dir, 64<<20, 2501)
	n.Put(t, "disk.img", v1)
	over := filepath.Join(dir, "over.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", n.URL("http", "disk.img"), "-F", "raw", over, "64M")
	cmd, lines, stderr := startStream(t, "--parallel", "1", "--cache-size", "1M", over)
	for i := 0; i < 3 && lines.Scan(); i++ {
	}
	v2 := harness.RandomImage(t, t.TempDir(), 64<<20, 2502)
	n.Put(t, "disk.img", v2)
	completed := false
	for lines.Scan() {
		completed = completed || strings.Contains(lines.Text(), `"completed"`)
	}
	err := cmd.Wait()
	if err == nil != completed {
		t.Fatalf("stream: exit %v, completed line %v\n%s", err, completed, stderr)
	}
	t.Logf("stream: exit %v: %s", err, stderr)
	if err != nil && !strings.Contains(stderr.String(), "changed") {
		t.Fatalf("stream over a replaced object said: %s", stderr)
	}
	out, _ := exec.Command("qemu-img", "check", "--output=json", over).Output()
	var check struct {
		Corruptions int `json:"corruptions"`
		Leaks       int `json:"leaks"`
	}
	if jerr := json.Unmarshal(out, &check); jerr != nil || check.Corruptions != 0 || check.Leaks != 0 {
		t.Fatalf("qemu-img check after the stream: %v\n%s", jerr, out)
	}
	if err != nil {
		var info map[string]any
		json.Unmarshal([]byte(harness.Run(t, "qemu-img", "info", "--output=json", over)), &info)
		if info["backing-filename"] == nil {
			t.Fatal("a failed stream dropped the backing file")
		}
	}
	harness.Run(t, "qemu-img", "rebase", "-u", "-b", v1, "-F", "raw", over)
	harness.Run(t, "qemu-img", "compare", "-q", "-F", "raw", over, v1)
}

// TestStreamRefusedWhileImageInUse: a stream of an overlay exported with
// copy-on-read, exported read-only, or whose backing file is exported
// writable is refused (exit 1, "in use"), as QEMU's locks refuse it, and
// leaves the overlay as it was.
func TestStreamRefusedWhileImageInUse(t *testing.T) {
	dir := t.TempDir()
	base := backingBase(t, dir, 8<<20, 25)
	over := overlayOf(t, dir, base)
	mnt := filepath.Join(dir, "mnt")
	for _, c := range []struct {
		img  string
		args []string
	}{{over, []string{"-w", "--copy-on-read"}}, {over, nil}, {base, []string{"-w"}}} {
		d := harness.StartExport(t, c.img, mnt, c.args...)
		code, out := harness.RunBlockexport(t, "stream", "--progress", "none", over)
		d.StopClean()
		if code != 1 || !strings.Contains(out, "in use") {
			t.Fatalf("stream while %s is exported %v: exit %d\n%s", filepath.Base(c.img), c.args, code, out)
		}
		if depth := depthOf(t, over); len(depth) == 0 || depth[len(depth)-1] == 0 {
			t.Fatalf("the refused stream copied: %v", depth)
		}
	}
	checkClean(t, over)
}

// TestCopyOnReadTwoLevelChainEqualsQemu: copy-on-read over a chain of
// two backing levels (a qcow2 of its own writes, zeroes and discards,
// shorter than the raw file under it; the top longer than both): the same
// random reads by qemu-io -C on one top and through our export on
// another leave the same qemu-img map and bytes, for v3 and v2 tops.
func TestCopyOnReadTwoLevelChainEqualsQemu(t *testing.T) {
	dir := t.TempDir()
	const size, midSize, baseSize = 28 << 20, 20<<20 + 1536, 24<<20 + 5000
	base := backingBase(t, dir, baseSize, 26)
	mid := filepath.Join(dir, "mid.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "raw", mid, fmt.Sprint(midSize))
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x61 1M 200k", "-c", "write -z 4M 1M", "-c", "discard 8M 512k",
		"-c", "write -P 0x62 20M 1536", mid)
	r := rand.New(rand.NewPCG(26, 26))
	var cmds []string
	for range 30 {
		n := 1 + r.Int64N(600<<10)
		cmds = append(cmds, "-c", fmt.Sprintf("read %d %d", r.Int64N(size-n), n))
	}
	cmds = append(cmds, "-c", fmt.Sprintf("read %d 9000", midSize-4000), "-c", fmt.Sprintf("read %d 9000", baseSize-4000),
		"-c", "read 4M 64k", "-c", "read 8M 64k")
	for _, compat := range []string{"1.1", "0.10"} {
		t.Run(compat, func(t *testing.T) {
			sub := t.TempDir()
			mk := func(name string) string {
				img := filepath.Join(sub, name)
				harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "compat="+compat, "-b", mid, "-F", "qcow2", img, fmt.Sprint(size))
				return img
			}
			theirs, ours := mk("theirs.qcow2"), mk("ours.qcow2")
			harness.Run(t, "qemu-io", append(append([]string{"-C", "-f", "qcow2"}, cmds...), theirs)...)
			mnt := filepath.Join(sub, "mnt")
			d := harness.StartExport(t, ours, mnt, "-w", "--copy-on-read", "--kernel-cache", "off")
			harness.Run(t, "qemu-io", append(append([]string{"-f", "raw"}, cmds...), mnt)...)
			d.StopClean()
			checkClean(t, ours)
			mapOf := func(img string) string {
				var m []map[string]any
				if err := json.Unmarshal([]byte(harness.Run(t, "qemu-img", "map", "--output=json", img)), &m); err != nil {
					t.Fatal(err)
				}
				for _, e := range m {
					delete(e, "offset")
				}
				return fmt.Sprint(m)
			}
			if got, want := mapOf(ours), mapOf(theirs); got != want {
				t.Errorf("qemu-img map after the same reads:\nours   %v\nqemu's %v", got, want)
			}
			harness.Run(t, "qemu-img", "compare", "-q", theirs, ours)
			// And cut from the chain, what was copied is the same.
			for _, img := range []string{theirs, ours} {
				harness.Run(t, "qemu-img", "rebase", "-u", "-b", "", img)
			}
			harness.Run(t, "qemu-img", "compare", "-q", theirs, ours)
		})
	}
}

// TestStreamTwoLevelChainEqualsQemuBlockStream: the two-level chain above,
// with writes of the top's own, streamed by QEMU's block-stream and by
// ours: the same bytes, no backing file either way, check clean; and the
// result reads as the chain did.
func TestStreamTwoLevelChainEqualsQemuBlockStream(t *testing.T) {
	dir := t.TempDir()
	const size, midSize, baseSize = 28 << 20, 20<<20 + 1536, 24<<20 + 5000
	base := backingBase(t, dir, baseSize, 27)
	mid := filepath.Join(dir, "mid.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "raw", mid, fmt.Sprint(midSize))
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x61 1M 200k", "-c", "write -z 4M 1M", "-c", "discard 8M 512k", mid)
	for _, compat := range []string{"1.1", "0.10"} {
		t.Run(compat, func(t *testing.T) {
			sub := t.TempDir()
			var imgs []string
			for _, name := range []string{"theirs.qcow2", "ours.qcow2"} {
				img := filepath.Join(sub, name)
				harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "compat="+compat, "-b", mid, "-F", "qcow2", img, fmt.Sprint(size))
				harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 3M 100k", "-c", "write -z 6M 1M", "-c", "write -P 1 23M 4k", img)
				imgs = append(imgs, img)
			}
			want := filepath.Join(sub, "want.raw")
			harness.Run(t, "qemu-img", "convert", "-O", "raw", imgs[1], want)
			qemuBlockStream(t, imgs[0])
			streamToEnd(t, imgs[1])
			// Where each puts zero clusters differs (QEMU judges zeroes per
			// 512 KiB chunk of its block-status runs, we per run of a
			// step), not what reads back: bytes only.
			mustBeStandalone(t, imgs[1], want, "")
			harness.Run(t, "qemu-img", "compare", "-q", imgs[0], imgs[1])
		})
	}
}

// TestCopyOnReadOnAFullDiskStillReads: the overlay's file system (2 MiB) fills
// up while copy-on-read reads a 16 MiB backing file through the export:
// every read still returns the backing file's bytes (the copies are
// given up, not the reads: they failed with ENOSPC), and the overlay
// has no corruption and reads as its backing file afterwards.
func TestCopyOnReadOnAFullDiskStillReads(t *testing.T) {
	dir := t.TempDir()
	base := backingBase(t, dir, 16<<20, 28)
	small := harness.SmallHost(t, dir, "2m")
	over := overlayOf(t, small, base)
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, over, mnt, "-w", "--copy-on-read", "--kernel-cache", "off")
	got := harness.ReadAll(t, mnt)
	d.Stop()
	harness.MustEqualBytes(t, "the export over a full overlay", got, harness.ReadAll(t, base))
	out, _ := exec.Command("qemu-img", "check", "--output=json", over).Output()
	var check struct {
		Corruptions int `json:"corruptions"`
	}
	if jerr := json.Unmarshal(out, &check); jerr != nil || check.Corruptions != 0 {
		t.Fatalf("qemu-img check after the full disk: %v\n%s", jerr, out)
	}
	harness.Run(t, "qemu-img", "compare", "-q", "-F", "raw", over, base)
}

// TestStreamDurableStepsNotPlannedAgainAfterKill: what a progress line calls durable is not
// planned again by the run after a SIGKILL right after that line.
func TestStreamDurableStepsNotPlannedAgainAfterKill(t *testing.T) {
	dir := t.TempDir()
	base := backingBase(t, dir, 96<<20, 29)
	over := overlayOf(t, dir, base)
	for round := range 3 {
		cmd, lines, stderr := startStream(t, "--parallel", "4", over)
		var total, durable int64
		for i := 0; lines.Scan(); i++ {
			var s streamStep
			json.Unmarshal(lines.Bytes(), &s)
			if s.Event == "planned" {
				total = s.Total
			}
			durable = max(durable, s.Durable)
			if durable > 0 && i > 10*(round+1) {
				break
			}
		}
		cmd.Process.Kill()
		go func() {
			for lines.Scan() {
			}
		}()
		if cmd.Wait() == nil {
			harness.SkipLoudly(t, "round %d: the stream ended before the kill\n%s", round, stderr)
		}
		rest := streamPlan(t, over)
		if rest > total-durable {
			t.Fatalf("round %d: %d of %d bytes said durable, and the next run plans %d", round, durable, total, rest)
		}
	}
	streamToEnd(t, over)
	mustBeStandalone(t, over, copyOf(t, base), base)
}

// streamPlan starts a stream, reads its planned total and kills it
// (after at most a step or two: its stdout is a pipe nobody reads on).
func streamPlan(t *testing.T, over string) int64 {
	t.Helper()
	cmd, lines, _ := startStream(t, over)
	var planned streamStep
	for lines.Scan() {
		json.Unmarshal(lines.Bytes(), &planned)
		if planned.Event == "planned" {
			break
		}
	}
	cmd.Process.Kill()
	go func() {
		for lines.Scan() {
		}
	}()
	cmd.Wait()
	return planned.Total
}
