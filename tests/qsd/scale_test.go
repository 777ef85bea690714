package qsd

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// scaleExports is how many exports one round adds and deletes.
const scaleExports = 20

// threadSlack is how many threads more than at the start the daemon may
// hold after a round: Go keeps the threads its runtime made for system
// calls that blocked at the same time (mount(2) and unmount(2) beside a
// QMP reply), 4 to 7 here from run to run. An export whose queue kept its
// thread (a loop sleeping in read(2) holds one) leaves scaleExports more.
const threadSlack = 10

// TestManyExportsAddedAndDeletedLeaveNoFdsMountsOrThreads adds
// scaleExports qcow2 nodes and FUSE exports of them to one daemon, reads
// each once, and deletes them all, three rounds over; after each round
// the daemon's open descriptors and our mounts must be where they were
// before the first, and its threads (/proc/PID/task) within threadSlack
// of it.
func TestManyExportsAddedAndDeletedLeaveNoFdsMountsOrThreads(t *testing.T) {
	dir := t.TempDir()
	base := qcow2Image(t, dir, "base.qcow2", "16M")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 0 1M", base)
	imgs := make([]string, scaleExports)
	mnts := make([]string, scaleExports)
	for i := range imgs {
		imgs[i] = filepath.Join(dir, fmt.Sprintf("disk%d.qcow2", i))
		harness.Run(t, "cp", base, imgs[i])
		mnts[i] = mountFile(t, dir, fmt.Sprintf("disk%d.raw", i))
	}
	d := startDaemon(t, harness.Bin, mnts)
	m, events := d.monitor(t)
	pid := d.cmd.Process.Pid

	round := func(r int) {
		t.Helper()
		before := processCounts(t, pid, dir)
		for i := range imgs {
			run(t, m, "blockdev-add", map[string]any{"driver": "qcow2", "node-name": fmt.Sprintf("n%d", i),
				"file": map[string]any{"driver": "file", "filename": imgs[i]}})
			run(t, m, "block-export-add", map[string]any{"type": "fuse", "id": fmt.Sprintf("e%d", i),
				"node-name": fmt.Sprintf("n%d", i), "mountpoint": mnts[i]})
		}
		for i, mnt := range mnts {
			readPattern(t, mnt, 0x5a, int64(i%4)*256<<10)
		}
		during := processCounts(t, pid, dir)
		if during.mounts != before.mounts+scaleExports || during.fds < before.fds+scaleExports {
			t.Fatalf("round %d with %d exports: %+v, before it %+v: the exports are not all up", r, scaleExports, during, before)
		}
		for i := range imgs {
			id := fmt.Sprintf("e%d", i)
			run(t, m, "block-export-del", map[string]any{"id": id})
			waitEvent(t, events, id)
			run(t, m, "blockdev-del", map[string]any{"node-name": fmt.Sprintf("n%d", i)})
		}
		if out, _ := runErr(m, "query-block-exports", nil); !isEmptyList(out) {
			t.Fatalf("round %d: exports left after deleting them all: %v", r, out)
		}
	}

	start := processCounts(t, pid, dir)
	for r := 0; r < 3; r++ {
		round(r)
		after := processCounts(t, pid, dir)
		if after.fds != start.fds || after.mounts != start.mounts || after.threads > start.threads+threadSlack {
			t.Fatalf("after round %d: %+v, at the start %+v: the deleted exports left something behind", r, after, start)
		}
	}
}

// counts are what a daemon holds: open descriptors, threads, and FUSE
// mounts under the test's directory.
type counts struct{ fds, threads, mounts int }

func processCounts(t *testing.T, pid int, dir string) counts {
	t.Helper()
	var c counts
	for _, p := range []struct {
		path string
		n    *int
	}{{fmt.Sprintf("/proc/%d/fd", pid), &c.fds}, {fmt.Sprintf("/proc/%d/task", pid), &c.threads}} {
		ents, err := os.ReadDir(p.path)
		if err != nil {
			t.Fatal(err)
		}
		*p.n = len(ents)
	}
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(mi), "\n") {
		f := strings.Fields(l)
		if len(f) > 4 && strings.HasPrefix(f[4], dir+"/") && strings.Contains(l, " - fuse") {
			c.mounts++
		}
	}
	return c
}

// readPattern reads 4 KiB of mnt at off and wants them all b.
func readPattern(t *testing.T, mnt string, b byte, off int64) {
	t.Helper()
	f, err := os.Open(mnt)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got := make([]byte, 4096)
	if _, err := f.ReadAt(got, off); err != nil {
		t.Fatalf("read %s at %d: %v", mnt, off, err)
	}
	if !bytes.Equal(got, bytes.Repeat([]byte{b}, len(got))) {
		t.Fatalf("%s at %d: not the image's bytes (%#x...)", mnt, off, got[:8])
	}
}

// isEmptyList says whether a command's return value is [].
func isEmptyList(v any) bool {
	l, ok := v.([]any)
	return ok && len(l) == 0
}
