package remote

import (
	"bufio"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// Copy-on-read (fuse/nbd --copy-on-read) and `blockexport stream`.

// backingBase makes a raw image of size random bytes with holes punched in
// it (every fifth MiB), and returns its path.
func backingBase(t *testing.T, dir string, size int64, seed uint64) string {
	t.Helper()
	sub := filepath.Join(dir, fmt.Sprintf("base%d", seed))
	os.MkdirAll(sub, 0o755)
	base := harness.RandomImage(t, sub, size, seed)
	for off := int64(2 << 20); off+(1<<20) <= size; off += 5 << 20 {
		harness.Run(t, "fallocate", "-p", "-o", fmt.Sprint(off), "-l", fmt.Sprint(1<<20), base)
	}
	return base
}

// overlayOf makes a qcow2 overlay of backing (format raw) in dir.
func overlayOf(t *testing.T, dir, backing string) string {
	t.Helper()
	over := filepath.Join(dir, "over.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", backing, "-F", "raw", over)
	return over
}

// mapEntry is one entry of qemu-img map --output=json.
type mapEntry struct {
	Start   int64 `json:"start"`
	Length  int64 `json:"length"`
	Depth   int   `json:"depth"`
	Present bool  `json:"present"`
}

// depthOf returns qemu-img's map of img as the depth at each MiB.
func depthOf(t *testing.T, img string) []int {
	t.Helper()
	var m []mapEntry
	if err := json.Unmarshal([]byte(harness.Run(t, "qemu-img", "map", "--output=json", img)), &m); err != nil {
		t.Fatal(err)
	}
	var depth []int
	for _, e := range m {
		for mib := (e.Start + 1<<20 - 1) >> 20; mib<<20 < e.Start+e.Length; mib++ {
			depth = append(depth, e.Depth)
		}
	}
	return depth
}

// mapEntryFull is a qemu-img map entry without its host offset.
type mapEntryFull struct {
	Start   int64 `json:"start"`
	Length  int64 `json:"length"`
	Depth   int   `json:"depth"`
	Present bool  `json:"present"`
	Zero    bool  `json:"zero"`
	Data    bool  `json:"data"`
}

// checkClean runs qemu-img check, which exits non-zero on leaks and on
// corruption alike.
func checkClean(t *testing.T, img string) {
	t.Helper()
	harness.Run(t, "qemu-img", "check", "-f", "qcow2", img)
}

// TestCopyOnReadCopiesReadsIntoTheOverlay: through `fuse -w --copy-on-read`, the
// MiBs read become the overlay's own (depth 0 in qemu-img map; the
// holes too, as zero clusters) and the rest stays the backing file's;
// once all is read, the overlay cut from its backing file (an unsafe
// rebase onto nothing) reads as the backing file did.
func TestCopyOnReadCopiesReadsIntoTheOverlay(t *testing.T) {
	dir := t.TempDir()
	const size = 24 << 20
	base := backingBase(t, dir, size, 1)
	want := harness.ReadAll(t, base)
	over := overlayOf(t, dir, base)
	mnt := filepath.Join(dir, "mnt")

	d := harness.StartExport(t, over, mnt, "-w", "--copy-on-read")
	f, err := os.Open(mnt)
	if err != nil {
		t.Fatal(err)
	}
	// MiBs 0-3 and 10-13 (a hole at 12), in odd-sized reads across
	// cluster boundaries.
	for _, r := range [][2]int64{{0, 4 << 20}, {10 << 20, 14 << 20}} {
		for off := r[0]; off < r[1]; {
			n := min(r[1]-off, 12345)
			buf := make([]byte, n)
			if _, err := f.ReadAt(buf, off); err != nil {
				t.Fatal(err)
			}
			harness.MustEqualBytes(t, fmt.Sprintf("read at %d", off), buf, want[off:off+n])
			off += n
		}
	}
	f.Close()
	d.StopClean()
	checkClean(t, over)
	depth := depthOf(t, over)
	for mib, dep := range depth {
		read := mib < 4 || mib >= 10 && mib < 14
		if read && dep != 0 || !read && dep != 1 {
			t.Fatalf("MiB %d is at depth %d after copy-on-read of MiBs 0-3 and 10-13: %v", mib, dep, depth)
		}
	}

	// Everything, read in one go (as cat would), then cut loose.
	d = harness.StartExport(t, over, mnt, "-w", "--copy-on-read")
	harness.MustEqualBytes(t, "the overlay through copy-on-read", harness.ReadAll(t, mnt), want)
	d.StopClean()
	checkClean(t, over)
	for mib, dep := range depthOf(t, over) {
		if dep != 0 {
			t.Fatalf("MiB %d still at depth %d after reading everything", mib, dep)
		}
	}
	harness.Run(t, "qemu-img", "rebase", "-u", "-b", "", over)
	gone := base + ".gone"
	if err := os.Rename(base, gone); err != nil {
		t.Fatal(err)
	}
	harness.Run(t, "qemu-img", "compare", "-f", "qcow2", "-F", "raw", over, gone)
}

// TestCopyOnReadRefusedWhereItCannotApply: --copy-on-read without --writable, on an image with no
// backing file, or on a raw image is refused with one line, exit 2.
func TestCopyOnReadRefusedWhereItCannotApply(t *testing.T) {
	dir := t.TempDir()
	base := harness.SparseImage(t, dir, "base.raw", 1<<20)
	over := overlayOf(t, dir, base)
	plain := filepath.Join(dir, "plain.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", plain, "1M")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"fuse", "--copy-on-read", over}, "needs --writable"},
		{[]string{"nbd", "--copy-on-read", over}, "needs --writable"},
		{[]string{"fuse", "-w", "--copy-on-read", plain}, "no backing file"},
		{[]string{"nbd", "-w", "--copy-on-read", plain}, "no backing file"},
		{[]string{"fuse", "-w", "-f", "raw", "--copy-on-read", base}, "needs a qcow2 overlay"},
	} {
		mnt := filepath.Join(dir, "mnt")
		os.WriteFile(mnt, nil, 0o644)
		args := c.args
		if args[0] == "fuse" {
			args = append(args, mnt)
		} else {
			args = append(args, "--listen", "unix:"+filepath.Join(dir, "s.sock"))
		}
		code, out := harness.RunBlockexport(t, args...)
		if code != 2 || !strings.Contains(out, c.want) || strings.Count(strings.TrimSpace(out), "\n") != 0 {
			t.Errorf("blockexport %v: exit %d, want 2 and one line with %q:\n%s", args, code, c.want, out)
		}
		if harness.IsFuseMount(mnt) {
			syscall.Unmount(mnt, syscall.MNT_DETACH)
			t.Fatal("a refused export mounted")
		}
	}
}

// fileTree writes a tree of files of random sizes and contents under dir
// and returns each file's SHA-256 by its path relative to dir.
func fileTree(t *testing.T, dir string, files int, seed uint64) map[string][32]byte {
	t.Helper()
	r := rand.New(rand.NewPCG(seed, 3))
	sums := map[string][32]byte{}
	for i := range files {
		rel := filepath.Join(fmt.Sprintf("d%d", i%7), fmt.Sprintf("f%d", i))
		p := filepath.Join(dir, rel)
		os.MkdirAll(filepath.Dir(p), 0o755)
		data := make([]byte, r.IntN(1<<20))
		for j := range data {
			data[j] = byte(r.Uint32())
		}
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
		sums[rel] = sha256.Sum256(data)
	}
	return sums
}

// fileTreeHashes loop-mounts file read-only, hashes every file under it,
// and unmounts it and detaches the loop device again.
func fileTreeHashes(t *testing.T, file, at string) map[string][32]byte {
	t.Helper()
	loop := strings.TrimSpace(harness.Run(t, "losetup", "--find", "--show", "--read-only", file))
	attached := true
	t.Cleanup(func() {
		if attached {
			exec.Command("losetup", "-d", loop).Run()
		}
	})
	os.MkdirAll(at, 0o755)
	harness.Run(t, "mount", "-o", "ro,noload", loop, at)
	mounted := true
	t.Cleanup(func() {
		if mounted {
			exec.Command("umount", at).Run()
		}
	})
	sums := map[string][32]byte{}
	err := filepath.WalkDir(at, func(p string, e fs.DirEntry, err error) error {
		if err != nil || !e.Type().IsRegular() {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(at, p)
		sums[rel] = sha256.Sum256(b)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	harness.Run(t, "umount", at)
	mounted = false
	harness.Run(t, "losetup", "-d", loop)
	attached = false
	return sums
}

// TestCopyOnReadLoopMountSurvivesTheBackingServer: an ext4 image served by
// qemu-nbd is the backing file of a local overlay exported with
// --copy-on-read; a tree read through a loop mount is read again, the
// same, after the NBD server is gone: every block read crossed once and
// stayed in the overlay.
func TestCopyOnReadLoopMountSurvivesTheBackingServer(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	want := fileTree(t, src, 60, 5)
	base := filepath.Join(dir, "fs.raw")
	harness.Run(t, "mkfs.ext4", "-q", "-d", src, base, "96M")
	sock := filepath.Join(dir, "nbd.sock")
	srv := harness.StartServerProc(t, sock, "qemu-nbd", "-f", "raw", "-r", "--shared=8", "--persistent", "-x", "base", "-k", sock, base)
	over := filepath.Join(dir, "over.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", harness.NBDURI("base", sock), "-F", "raw", over)
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, over, mnt, "-w", "--copy-on-read", "--kernel-cache", "off", "--reconnect-timeout", "1s")

	first := fileTreeHashes(t, mnt, filepath.Join(dir, "fs1"))
	for name, sum := range want {
		if first[name] != sum {
			t.Fatalf("%s differs through the export (first read)", name)
		}
	}
	if len(first) < len(want) {
		t.Fatalf("%d files through the export, %d made", len(first), len(want))
	}
	srv.Kill()
	second := fileTreeHashes(t, mnt, filepath.Join(dir, "fs2"))
	for name, sum := range first {
		if second[name] != sum {
			t.Fatalf("%s differs once the backing server is gone", name)
		}
	}
	d.StopClean()
}

// startStream runs `blockexport stream --progress json ARGS...` and returns
// its command, with its JSON lines coming on lines. Its stdout is a pipe
// of one page, so that the stream waits for the reader a few lines ahead.
func startStream(t *testing.T, args ...string) (*exec.Cmd, *bufio.Scanner, *strings.Builder) {
	t.Helper()
	cmd := exec.Command(harness.Bin, append([]string{"stream", "--progress", "json"}, args...)...)
	stdout, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stdout.Close() })
	if _, err := unix.FcntlInt(w.Fd(), unix.F_SETPIPE_SZ, 4096); err != nil {
		t.Fatal(err)
	}
	cmd.Stdout = w
	var stderr strings.Builder
	cmd.Stderr = &stderr
	err = cmd.Start()
	w.Close()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	return cmd, bufio.NewScanner(stdout), &stderr
}

// streamStep is a progress line of stream --progress json.
type streamStep struct {
	Event   string `json:"event"`
	Done    int64  `json:"done"`
	Durable int64  `json:"durable"`
	Total   int64  `json:"total"`
}

// streamToEnd runs a stream to completion and returns its planned
// total.
func streamToEnd(t *testing.T, over string, args ...string) int64 {
	t.Helper()
	cmd, lines, stderr := startStream(t, append(args, over)...)
	var planned int64 = -1
	var last streamStep
	for lines.Scan() {
		if err := json.Unmarshal(lines.Bytes(), &last); err != nil {
			t.Fatalf("stream: a progress line that is no JSON: %q", lines.Text())
		}
		if last.Event == "planned" {
			planned = last.Total
		}
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("stream %s: %v\n%s", over, err, stderr)
	}
	if last.Event != "completed" || last.Done != planned {
		t.Fatalf("stream's last line: %+v, planned %d", last, planned)
	}
	return planned
}

// mustBeStandalone checks that over has no backing file and reads as want
// (a raw file), even with the old backing file renamed away.
func mustBeStandalone(t *testing.T, over, want, oldBacking string) {
	t.Helper()
	var info map[string]any
	if err := json.Unmarshal([]byte(harness.Run(t, "qemu-img", "info", "--output=json", over)), &info); err != nil {
		t.Fatal(err)
	}
	if b, ok := info["backing-filename"]; ok {
		t.Fatalf("qemu-img info still shows a backing file: %v", b)
	}
	checkClean(t, over)
	if oldBacking != "" {
		if err := os.Rename(oldBacking, oldBacking+".away"); err != nil {
			t.Fatal(err)
		}
		defer os.Rename(oldBacking+".away", oldBacking)
	}
	harness.Run(t, "qemu-img", "compare", "-f", "qcow2", "-F", "raw", over, want)
}

// TestStreamMakesTheOverlayStandalone: the overlay (with writes of its own) of a raw backing
// file with holes streams to completion: no backing file in qemu-img
// info, the same bytes with the backing file gone, check clean; a second
// stream has nothing to do.
func TestStreamMakesTheOverlayStandalone(t *testing.T) {
	dir := t.TempDir()
	const size = 40<<20 + 12345 // not a whole number of clusters
	base := backingBase(t, dir, size, 2)
	over := overlayOf(t, dir, base)
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 3M 100k", "-c", "write -z 20M 2M", over)
	want := filepath.Join(dir, "want.raw")
	harness.Run(t, "qemu-img", "convert", "-O", "raw", over, want)

	planned := streamToEnd(t, over)
	if planned <= 0 || planned > size {
		t.Fatalf("stream planned %d bytes of %d", planned, size)
	}
	mustBeStandalone(t, over, want, base)
	if code, out := harness.RunBlockexport(t, "stream", over); code != 0 || !strings.Contains(out, "nothing to stream") {
		t.Fatalf("a second stream: exit %d\n%s", code, out)
	}
}

// TestStreamFromAnNBDBackingFile: the backing file is on an NBD server; once the
// stream is done the server is gone and the overlay reads the same.
func TestStreamFromAnNBDBackingFile(t *testing.T) {
	dir := t.TempDir()
	base := backingBase(t, dir, 16<<20, 3)
	sock := filepath.Join(dir, "nbd.sock")
	srv := harness.StartServerProc(t, sock, "qemu-nbd", "-f", "raw", "-r", "--shared=8", "--persistent", "-x", "base", "-k", sock, base)
	over := filepath.Join(dir, "over.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", harness.NBDURI("base", sock), "-F", "raw", over)
	streamToEnd(t, over)
	srv.Kill()
	mustBeStandalone(t, over, base, "")
}

// TestStreamInterruptedLeavesConsistentImageAndResumes: a stream killed (SIGKILL) or interrupted
// (SIGINT) at a random step leaves an image qemu-img finds no corruption
// in (SIGINT: none at all, leaks included), still over its backing file;
// the next run plans only what is missing and completes.
func TestStreamInterruptedLeavesConsistentImageAndResumes(t *testing.T) {
	dir := t.TempDir()
	const size = 128 << 20
	base := backingBase(t, dir, size, 4)
	r := rand.New(rand.NewPCG(4, 4))
	for _, sig := range []syscall.Signal{syscall.SIGKILL, syscall.SIGINT} {
		t.Run(sig.String(), func(t *testing.T) {
			over := filepath.Join(t.TempDir(), "over.qcow2")
			harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "raw", over)
			// The stream waits on its stdout: stop reading at step k (of
			// 128), or later, once a flush has made some copies durable
			// (other workers report steps while a flush runs: under load
			// step 20 could come before the first flush returned), and
			// signal it there.
			k := 20 + r.IntN(80)
			cmd, lines, stderr := startStream(t, "--parallel", "4", over)
			var full int64
			for i := 0; lines.Scan(); i++ {
				var s streamStep
				json.Unmarshal(lines.Bytes(), &s)
				if s.Event == "planned" {
					full = s.Total
				}
				if i >= k && s.Durable > 0 {
					break
				}
			}
			cmd.Process.Signal(sig)
			go func() {
				for lines.Scan() {
				}
			}()
			err := cmd.Wait()
			if err == nil {
				t.Fatalf("stream ended 0 after %v at step %d", sig, k)
			}
			if sig == syscall.SIGINT {
				if !strings.Contains(stderr.String(), "interrupted") || strings.Count(strings.TrimSpace(stderr.String()), "\n") != 0 {
					t.Fatalf("stream's message on SIGINT: %q", stderr.String())
				}
				checkClean(t, over)
			} else {
				var check struct {
					Corruptions int `json:"corruptions"`
				}
				out, _ := exec.Command("qemu-img", "check", "--output=json", over).Output()
				if err := json.Unmarshal(out, &check); err != nil || check.Corruptions != 0 {
					t.Fatalf("qemu-img check after SIGKILL: %v\n%s", err, out)
				}
			}
			var info map[string]any
			json.Unmarshal([]byte(harness.Run(t, "qemu-img", "info", "--output=json", over)), &info)
			if info["backing-filename"] == nil {
				t.Fatal("an interrupted stream dropped the backing file")
			}
			rest := streamToEnd(t, over)
			if full <= 0 || rest >= full {
				t.Fatalf("the resumed stream planned %d bytes of %d: it copies again what was copied", rest, full)
			}
			mustBeStandalone(t, over, base, "")
		})
	}
}

// TestStreamShowsProgressBarOnATerminal: on a terminal the stream shows a bar with a
// rate and an ETA (script(1) gives it one).
func TestStreamShowsProgressBarOnATerminal(t *testing.T) {
	dir := t.TempDir()
	base := backingBase(t, dir, 8<<20, 6)
	over := overlayOf(t, dir, base)
	out, err := exec.Command("script", "-qec", harness.Bin+" stream -p "+over, "/dev/null").CombinedOutput()
	if err != nil {
		t.Fatalf("stream under script: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "stream") || !strings.Contains(string(out), "100%") || !strings.Contains(string(out), "/s") {
		t.Fatalf("no progress bar with a rate:\n%q", out)
	}
	mustBeStandalone(t, over, base, "")
}

// TestCopyOnReadOverNBDExport: `nbd -w --copy-on-read` copies what a client reads
// (qemu-io, every byte) into the overlay; stopped cleanly,
// the overlay holds it all (depth 0, check clean) and compares equal to
// the backing file.
func TestCopyOnReadOverNBDExport(t *testing.T) {
	dir := t.TempDir()
	base := backingBase(t, dir, 12<<20, 7)
	over := overlayOf(t, dir, base)
	sock := filepath.Join(dir, "export.sock")
	srv := harness.StartServerProc(t, sock, harness.Bin, "nbd", "-w", "--copy-on-read", "--listen", "unix:"+sock, over)
	// qemu-io reads every byte (qemu-img convert would skip the holes
	// block status shows, and copy-on-read copies only what is read).
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "read 0 12M", harness.NBDURI("", sock))
	got := filepath.Join(dir, "got.raw")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "raw", harness.NBDURI("", sock), got)
	harness.MustEqualBytes(t, "read over NBD", harness.ReadAll(t, got), harness.ReadAll(t, base))
	srv.Cmd.Process.Signal(syscall.SIGTERM)
	<-srv.Done
	if code := srv.Cmd.ProcessState.ExitCode(); code != 0 {
		b, _ := os.ReadFile(srv.LogFile)
		t.Fatalf("nbd export exit %d\n%s", code, b)
	}
	checkClean(t, over)
	for mib, dep := range depthOf(t, over) {
		if dep != 0 {
			t.Fatalf("MiB %d at depth %d after a full read over NBD", mib, dep)
		}
	}
	harness.Run(t, "qemu-img", "rebase", "-u", "-b", "", over)
	harness.Run(t, "qemu-img", "compare", "-f", "qcow2", "-F", "raw", over, base)
}

// TestCopyOnReadSurvivesKill9: the export is killed (SIGKILL) while clients
// copy-on-read and write; qemu-img check finds no corruption (leaks
// allowed: copies not yet flushed), and the overlay still reads as the
// backing file with the writes acknowledged by fsync.
func TestCopyOnReadSurvivesKill9(t *testing.T) {
	dir := t.TempDir()
	const size = 32 << 20
	base := backingBase(t, dir, size, 8)
	want := harness.ReadAll(t, base)
	over := overlayOf(t, dir, base)
	r := rand.New(rand.NewPCG(8, 8))
	for round := range 3 {
		mnt := filepath.Join(dir, fmt.Sprintf("mnt%d", round))
		d := harness.StartExport(t, over, mnt, "-w", "--copy-on-read")
		f, err := os.OpenFile(mnt, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		// One synced write a round, then readers until the kill.
		blk := make([]byte, 4096)
		for i := range blk {
			blk[i] = byte(round + 1)
		}
		at := int64(r.IntN(size/4096)) * 4096
		if _, err := f.WriteAt(blk, at); err != nil {
			t.Fatal(err)
		}
		if err := f.Sync(); err != nil {
			t.Fatal(err)
		}
		copy(want[at:], blk)
		done := make(chan struct{})
		for g := range 3 {
			go func() {
				defer func() { done <- struct{}{} }()
				rr := rand.New(rand.NewPCG(uint64(round), uint64(g)))
				buf := make([]byte, 256<<10)
				for {
					if _, err := f.ReadAt(buf, rr.Int64N(size-int64(len(buf)))); err != nil {
						return
					}
				}
			}()
		}
		time.Sleep(time.Duration(30+r.IntN(300)) * time.Millisecond)
		d.Cmd.Process.Signal(syscall.SIGKILL)
		for range 3 {
			<-done
		}
		f.Close()
		d.Wait(10 * time.Second)
		syscall.Unmount(mnt, syscall.MNT_DETACH)
		var check struct {
			Corruptions int `json:"corruptions"`
		}
		var out []byte
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			out, err = exec.Command("qemu-img", "check", "--output=json", over).Output()
			if json.Unmarshal(out, &check) == nil || time.Now().After(deadline) {
				break // a lock the killed daemon's ring still holds: asked again
			}
		}
		if err := json.Unmarshal(out, &check); err != nil || check.Corruptions != 0 {
			t.Fatalf("round %d: qemu-img check after SIGKILL: %v\n%s", round, err, out)
		}
		wantFile := filepath.Join(dir, "want.raw")
		if err := os.WriteFile(wantFile, want, 0o644); err != nil {
			t.Fatal(err)
		}
		harness.Run(t, "qemu-img", "compare", "-f", "qcow2", "-F", "raw", over, wantFile)
	}
}

// TestCopyOnReadNeverCopiesOverGuestWrites: through the FUSE export with
// --copy-on-read, readers read random ranges (each a copy-on-read of
// what the overlay lacks) while writers write random 4 KiB blocks, each
// block one writer's, with O_DIRECT (so every read and write reaches the
// daemon at once, several in flight). The image ends as the backing
// data with every write over it: no copy of stale backing bytes landed
// over a write.
func TestCopyOnReadNeverCopiesOverGuestWrites(t *testing.T) {
	dir := t.TempDir()
	const size, blk, writers = 16 << 20, 4096, 3
	base := backingBase(t, dir, size, 10)
	want := harness.ReadAll(t, base)
	over := overlayOf(t, dir, base)
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, over, mnt, "-w", "--copy-on-read", "--kernel-cache", "off")
	fd, err := syscall.Open(mnt, syscall.O_RDWR|syscall.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(fd)
	aligned := func(n int) []byte {
		b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Munmap(b) })
		return b
	}
	errs := make(chan error, 2*writers)
	stop := make(chan struct{})
	wbufs := make([][]byte, writers)
	rbufs := make([][]byte, writers)
	for i := range writers {
		wbufs[i], rbufs[i] = aligned(blk), aligned(256<<10)
	}
	for w := range writers {
		go func() {
			r := rand.New(rand.NewPCG(uint64(w), 10))
			buf := wbufs[w]
			for range 400 {
				b := int64(w + writers*r.IntN(size/blk/writers))
				for i := range buf {
					buf[i] = byte(r.Uint32())
				}
				if _, err := syscall.Pwrite(fd, buf, b*blk); err != nil {
					errs <- err
					return
				}
				copy(want[b*blk:], buf)
			}
			errs <- nil
		}()
		go func() {
			r := rand.New(rand.NewPCG(uint64(w), 11))
			buf := rbufs[w]
			for {
				select {
				case <-stop:
					errs <- nil
					return
				default:
				}
				n := blk * (1 + r.IntN(len(buf)/blk))
				if _, err := syscall.Pread(fd, buf[:n], int64(blk*r.IntN((size-n)/blk))); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	for range writers {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	for range writers {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	d.StopClean()
	checkClean(t, over)
	wantFile := filepath.Join(dir, "want.raw")
	if err := os.WriteFile(wantFile, want, 0o644); err != nil {
		t.Fatal(err)
	}
	harness.Run(t, "qemu-img", "compare", "-f", "qcow2", "-F", "raw", over, wantFile)
}

// TestCopyOnReadMapEqualsQemuCopyOnRead: the same reads (random offsets and
// lengths, some in holes, some across and past the end of the shorter
// backing file) done by qemu-io -C (QEMU's copy-on-read) on one
// overlay and through our --copy-on-read export on another leave the same
// qemu-img map: the same clusters copied, zero clusters where QEMU makes
// them.
func TestCopyOnReadMapEqualsQemuCopyOnRead(t *testing.T) {
	dir := t.TempDir()
	// The overlay is larger than its backing file, which ends inside a
	// cluster: reads there and past it too.
	const size, baseSize = 28 << 20, 24<<20 + 5000
	base := backingBase(t, dir, baseSize, 11)
	r := rand.New(rand.NewPCG(11, 11))
	var cmds []string
	for range 25 {
		n := 1 + r.Int64N(400<<10)
		cmds = append(cmds, "-c", fmt.Sprintf("read %d %d", r.Int64N(size-n), n))
	}
	cmds = append(cmds, "-c", fmt.Sprintf("read %d 70000", baseSize-4000), "-c", "read 27M 4096")
	theirs := filepath.Join(dir, "theirs.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "raw", theirs, fmt.Sprint(size))
	harness.Run(t, "qemu-io", append(append([]string{"-C", "-f", "qcow2"}, cmds...), theirs)...)
	ours := filepath.Join(dir, "ours.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "raw", ours, fmt.Sprint(size))
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, ours, mnt, "-w", "--copy-on-read", "--kernel-cache", "off")
	harness.Run(t, "qemu-io", append(append([]string{"-f", "raw"}, cmds...), mnt)...)
	d.StopClean()
	checkClean(t, ours)
	mapOf := func(img string) []map[string]any {
		var m []map[string]any
		if err := json.Unmarshal([]byte(harness.Run(t, "qemu-img", "map", "--output=json", img)), &m); err != nil {
			t.Fatal(err)
		}
		for _, e := range m {
			delete(e, "offset") // where the copy lies in the file is each writer's own
		}
		return m
	}
	got, want := mapOf(ours), mapOf(theirs)
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("qemu-img map after the same reads:\nours   %v\nqemu's %v", got, want)
	}
}

// qemuBlockStream runs qemu-storage-daemon with img as node "top" and a QMP
// socket, and runs QEMU's block-stream on it to completion.
func qemuBlockStream(t *testing.T, img string) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "qmp.sock")
	node := fmt.Sprintf(`{"driver":"qcow2","node-name":"top","file":{"driver":"file","filename":%q}}`, img)
	cmd := exec.Command("qemu-storage-daemon", "--blockdev", node,
		"--chardev", "socket,id=m,path="+sock+",server=on,wait=off", "--monitor", "chardev=m")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	defer func() {
		select {
		case <-exited:
		default:
			cmd.Process.Kill()
			<-exited
		}
	}()
	var c net.Conn
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var err error
		if c, err = net.Dial("unix", sock); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("qemu-storage-daemon's QMP socket: %v\n%s", err, stderr.String())
		}
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(60 * time.Second))
	dec := json.NewDecoder(c)
	// wait reads QMP messages until one satisfies ok.
	wait := func(ok func(map[string]any) bool) {
		for {
			var m map[string]any
			if err := dec.Decode(&m); err != nil {
				t.Fatalf("QMP: %v\n%s", err, stderr.String())
			}
			if e, bad := m["error"]; bad {
				t.Fatalf("QMP error: %v", e)
			}
			if ok(m) {
				return
			}
		}
	}
	send := func(s string) {
		if _, err := c.Write([]byte(s + "\n")); err != nil {
			t.Fatal(err)
		}
	}
	wait(func(m map[string]any) bool { return m["QMP"] != nil })
	send(`{"execute":"qmp_capabilities"}`)
	wait(func(m map[string]any) bool { return m["return"] != nil })
	send(`{"execute":"block-stream","arguments":{"job-id":"s","device":"top"}}`)
	wait(func(m map[string]any) bool { return m["event"] == "BLOCK_JOB_COMPLETED" })
	send(`{"execute":"quit"}`)
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
		t.Fatal("qemu-storage-daemon did not quit")
	}
}

// TestStreamEqualsQemuBlockStream: the same overlay (writes of its
// own, zeroes, a raw backing file with holes, shorter than the overlay)
// streamed by QEMU's block-stream job (qemu-storage-daemon over QMP) and
// by blockexport stream: the same qemu-img map and info (no backing file
// either way) and the same bytes.
func TestStreamEqualsQemuBlockStream(t *testing.T) {
	dir := t.TempDir()
	base := backingBase(t, dir, 20<<20+7000, 12)
	var imgs []string
	for _, name := range []string{"theirs.qcow2", "ours.qcow2"} {
		img := filepath.Join(dir, name)
		harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "raw", img, "24M")
		harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 3M 100k", "-c", "write -z 6M 1M", "-c", "write -P 1 23M 4k", img)
		imgs = append(imgs, img)
	}
	qemuBlockStream(t, imgs[0])
	streamToEnd(t, imgs[1])
	// The maps, with where the data lies in each file left out (and the
	// runs that only the host offsets split merged).
	mapOf := func(img string) []mapEntryFull {
		var m, merged []mapEntryFull
		if err := json.Unmarshal([]byte(harness.Run(t, "qemu-img", "map", "--output=json", img)), &m); err != nil {
			t.Fatal(err)
		}
		for _, e := range m {
			if k := len(merged) - 1; k >= 0 && merged[k].Start+merged[k].Length == e.Start &&
				merged[k].Depth == e.Depth && merged[k].Present == e.Present && merged[k].Zero == e.Zero && merged[k].Data == e.Data {
				merged[k].Length += e.Length
				continue
			}
			merged = append(merged, e)
		}
		return merged
	}
	if theirs, ours := mapOf(imgs[0]), mapOf(imgs[1]); fmt.Sprint(theirs) != fmt.Sprint(ours) {
		t.Errorf("qemu-img map after block-stream and after ours:\n%v\n%v", theirs, ours)
	}
	infoOf := func(img string) string {
		var m map[string]any
		if err := json.Unmarshal([]byte(harness.Run(t, "qemu-img", "info", "--output=json", img)), &m); err != nil {
			t.Fatal(err)
		}
		delete(m, "actual-size")
		delete(m, "filename")
		return fmt.Sprint(m)
	}
	if theirs, ours := infoOf(imgs[0]), infoOf(imgs[1]); theirs != ours {
		t.Errorf("qemu-img info after block-stream and after ours:\n%s\n%s", theirs, ours)
	}
	checkClean(t, imgs[1])
	harness.Run(t, "qemu-img", "compare", imgs[0], imgs[1])
}
