package qsd

import (
	"encoding/json"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestActiveCommitAsQSD commits a node's own image (top omitted) into
// the bottom of its chain while an NBD export of the node is written,
// against qemu-storage-daemon and the daemon: refused while a writable
// FUSE export holds the node (QEMU 7.2's permission conflict), then
// ready (new exports refused, as QEMU's permissions refuse them), a
// write through the export while ready, job-complete and job-finalize,
// a write after the pivot (into the base now); and on a second chain a cancel
// once ready, after which writes go to the top again. The same replies,
// the same events, the images afterwards clean, reading what was
// written, and allocated alike.
func TestActiveCommitAsQSD(t *testing.T) {
	qsd := runActiveCommitScript(t, "qemu-storage-daemon")
	ours := runActiveCommitScript(t, harness.Bin)
	sameMessages(t, qsd, ours)
}

func runActiveCommitScript(t *testing.T, prog string) []string {
	t.Helper()
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	jobChain(t, a)
	jobChain(t, b)
	mnt := mountFile(t, dir, "mnt")
	nbdSock := filepath.Join(dir, "nbd.sock")
	d := startDaemon(t, prog, []string{mnt})
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("%s's output:\n%s", prog, d.log)
		}
	})
	c := &jobClient{rawClient: dialRaw(t, d.sock, true)}
	var out []string
	// nbdIO runs qemu-io commands on node's NBD export and notes what
	// they said, timings aside.
	nbdIO := func(node string, cmds ...string) {
		args := []string{"-f", "raw"}
		for _, cmd := range cmds {
			args = append(args, "-c", cmd)
		}
		said := harness.Run(t, "qemu-io", append(args, "nbd+unix:///"+node+"?socket="+nbdSock)...)
		for _, line := range strings.Split(said, "\n") {
			if line != "" && !strings.Contains(line, "ops/sec") {
				out = append(out, node+": "+line)
			}
		}
	}
	for _, node := range []string{"a", "b"} {
		c.send(`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "` + node + `", "file": {"driver": "file", "filename": "` + filepath.Join(dir, node, "top.qcow2") + `"}}}`)
	}
	c.send(`{"execute": "nbd-server-start", "arguments": {"addr": {"type": "unix", "data": {"path": "` + nbdSock + `"}}}}`)
	c.send(`{"execute": "block-export-add", "arguments": {"type": "fuse", "id": "f", "node-name": "a", "mountpoint": "` + mnt + `", "writable": true}}`)
	c.send(`{"execute": "block-commit", "arguments": {"job-id": "x", "device": "a"}}`)
	c.send(`{"execute": "block-export-del", "arguments": {"id": "f"}}`)
	c.send(`{"execute": "block-commit", "arguments": {"job-id": "x", "device": "a", "backing-file": "base.qcow2"}}`)
	for _, node := range []string{"a", "b"} {
		c.send(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "e` + node + `", "node-name": "` + node + `", "writable": true}}`)
	}

	// a: complete, finalized by hand. No export may be added meanwhile:
	// the job unshares consistent read on mid, which a new user of a
	// takes again.
	c.send(`{"execute": "block-commit", "arguments": {"job-id": "c", "device": "a", "auto-finalize": false}}`)
	c.until("c", "ready")
	c.send(`{"execute": "query-jobs"}`)
	c.send(`{"execute": "block-export-add", "arguments": {"type": "fuse", "id": "f", "node-name": "a", "mountpoint": "` + mnt + `", "writable": true}}`)
	c.send(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "n2", "node-name": "a", "name": "again"}}`)
	for _, cmd := range []string{
		`{"execute": "job-complete", "arguments": {"id": "x"}}`,
		`{"execute": "block-commit", "arguments": {"job-id": "c2", "device": "a"}}`,
		`{"execute": "block-commit", "arguments": {"job-id": "c2", "device": "a", "top": "` + filepath.Join(a, "mid.qcow2") + `"}}`,
		`{"execute": "block-stream", "arguments": {"job-id": "s", "device": "a"}}`,
		`{"execute": "block_resize", "arguments": {"node-name": "a", "size": 8388608}}`,
		`{"execute": "blockdev-del", "arguments": {"node-name": "a"}}`,
		`{"execute": "job-finalize", "arguments": {"id": "c"}}`,
		`{"execute": "job-dismiss", "arguments": {"id": "c"}}`,
	} {
		c.send(cmd)
	}
	nbdIO("a", "write -P 7 2M 64k")
	c.send(`{"execute": "job-complete", "arguments": {"id": "c"}}`)
	c.until("c", "pending")
	c.send(`{"execute": "query-jobs"}`)
	c.send(`{"execute": "job-finalize", "arguments": {"id": "c"}}`)
	c.until("c", "null")
	nbdIO("a", "write -P 8 3M 64k", "read -P 7 2M 64k", "read -P 3 1M 512k", "read -P 8 3M 64k")

	// b: cancelled once ready, the write while ready mirrored or not.
	c.send(`{"execute": "block-commit", "arguments": {"job-id": "c2", "device": "b", "base": "` + filepath.Join(b, "base.qcow2") + `"}}`)
	c.until("c2", "ready")
	nbdIO("b", "write -P 7 2M 64k")
	// Cancelled once the job counts the write (its length grown by it):
	// when a mirror looks again is each daemon's own.
	c.waitProgress("c2", 1114112)
	c.send(`{"execute": "job-cancel", "arguments": {"id": "c2"}}`)
	c.until("c2", "null")
	nbdIO("b", "write -P 8 3M 64k", "read -P 7 2M 64k", "read -P 8 3M 64k")

	for _, node := range []string{"a", "b"} {
		c.send(`{"execute": "block-export-del", "arguments": {"id": "e` + node + `"}}`)
	}
	c.send(`{"execute": "quit"}`)
	if code := d.wait(t); code != 0 {
		t.Fatalf("%s exited %d after quit\n%s", prog, code, d.log)
	}
	out = append(append(c.replies, c.events...), out...)

	// What each image should read: the pristine chain and the writes.
	want := func(name string, writes ...string) string {
		p := filepath.Join(dir, name+".raw")
		harness.Run(t, "qemu-img", "convert", "-O", "raw", filepath.Join(a, "pristine", "top.qcow2"), p)
		for _, w := range writes {
			harness.Run(t, "qemu-io", "-f", "raw", "-c", w, p)
		}
		return p
	}
	both := want("both", "write -P 7 2M 64k", "write -P 8 3M 64k")
	for _, c := range []struct{ img, want string }{
		{"a/base.qcow2", both}, // the node after the pivot
		{"a/top.qcow2", both},  // reading through the base, which has both
		{"b/top.qcow2", both},  // the node, still
	} {
		p := filepath.Join(dir, c.img)
		check, _, _ := strings.Cut(harness.Run(t, "qemu-img", "check", p), "\n")
		out = append(out, c.img+" check: "+check, c.img+" compare: "+harness.Run(t, "qemu-img", "compare", c.want, p))
	}
	for _, img := range []string{"a/top.qcow2", "a/base.qcow2", "b/top.qcow2"} {
		out = append(out, img+" map: "+mapWithoutOffsets(t, filepath.Join(dir, img)))
	}
	check, _, _ := strings.Cut(harness.Run(t, "qemu-img", "check", filepath.Join(b, "base.qcow2")), "\n")
	out = append(out, "b/base.qcow2 check: "+check, "a chain: "+backingChain(t, filepath.Join(a, "top.qcow2")))
	implicit := regexp.MustCompile(`#block[0-9]+`)
	for i := range out {
		out[i] = implicit.ReplaceAllString(strings.ReplaceAll(out[i], dir, "$DIR"), "#blockN")
	}
	return out
}

// mapWithoutOffsets is qemu-img map's JSON of path without the host
// offsets, which are where each daemon happened to allocate.
func mapWithoutOffsets(t *testing.T, path string) string {
	t.Helper()
	var extents []map[string]any
	if err := json.Unmarshal([]byte(harness.Run(t, "qemu-img", "map", "--output=json", path)), &extents); err != nil {
		t.Fatal(err)
	}
	for _, e := range extents {
		delete(e, "offset")
	}
	b, _ := json.Marshal(extents)
	return string(b)
}

// waitProgress asks query-jobs until job id's total-progress is total,
// recording the events that come meanwhile but not the replies (how many
// it takes is each daemon's own).
func (c *jobClient) waitProgress(id string, total float64) {
	c.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := c.c.Write([]byte(`{"execute": "query-jobs"}` + "\n")); err != nil {
			c.t.Fatal(err)
		}
		m := c.read()
		for m["event"] != nil {
			c.record(m, &c.events)
			m = c.read()
		}
		jobs, _ := m["return"].([]any)
		for _, j := range jobs {
			if j, _ := j.(map[string]any); j["id"] == id && j["total-progress"] == total {
				return
			}
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("job %s never reached a total progress of %v: %v", id, total, m)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
