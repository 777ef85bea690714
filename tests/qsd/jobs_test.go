package qsd

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// jobClient is a raw QMP client that keeps replies and events apart:
// when a job's events come relative to the replies is each daemon's
// own, the order of the events is not.
type jobClient struct {
	*rawClient
	replies, events []string
}

func (c *jobClient) record(m map[string]any, into *[]string) {
	delete(m, "timestamp")
	if d, ok := m["data"].(map[string]any); ok && m["event"] == "BLOCK_JOB_CANCELLED" {
		delete(d, "offset") // how far a cancelled job got is each one's own
	}
	b, _ := json.Marshal(m)
	*into = append(*into, string(b))
}

// send sends cmd and records its reply, and the events before it.
func (c *jobClient) send(cmd string) {
	c.t.Helper()
	if _, err := c.c.Write([]byte(cmd + "\n")); err != nil {
		c.t.Fatal(err)
	}
	for {
		m := c.read()
		if m["event"] != nil {
			c.record(m, &c.events)
			continue
		}
		c.record(m, &c.replies)
		c.replies[len(c.replies)-1] = cmd + " -> " + c.replies[len(c.replies)-1]
		return
	}
}

// until records events until JOB_STATUS_CHANGE of job id to status has
// been seen (recorded already, or read now).
func (c *jobClient) until(id, status string) {
	c.t.Helper()
	want := fmt.Sprintf(`{"data":{"id":%q,"status":%q},"event":"JOB_STATUS_CHANGE"}`, id, status)
	for _, e := range c.events {
		if e == want {
			return
		}
	}
	for {
		m := c.read()
		if m["event"] == nil {
			c.t.Fatalf("a reply with no command: %v", m)
		}
		c.record(m, &c.events)
		if c.events[len(c.events)-1] == want {
			return
		}
	}
}

// jobChain makes base.qcow2 <- mid.qcow2 <- top.qcow2 in dir, each layer
// with data of its own, and a copy of each under pristine/ for reference.
func jobChain(t *testing.T, dir string) {
	t.Helper()
	for _, d := range []string{dir, filepath.Join(dir, "pristine")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", filepath.Join(d, "base.qcow2"), "4M")
		harness.Run(t, "qemu-io", "-c", "write -P 1 0 1M", "-c", "write -P 4 3M 64k", filepath.Join(d, "base.qcow2"))
		harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", filepath.Join(d, "mid.qcow2"))
		harness.Run(t, "qemu-io", "-c", "write -P 2 512k 1M", filepath.Join(d, "mid.qcow2"))
		harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", "mid.qcow2", "-F", "qcow2", filepath.Join(d, "top.qcow2"))
		harness.Run(t, "qemu-io", "-c", "write -P 3 1M 512k", filepath.Join(d, "top.qcow2"))
	}
}

// TestBlockJobsAnswerAsQSD runs block-commit of a middle layer and
// block-stream, with auto-finalize and auto-dismiss off and on, and the
// job commands' refusals, against qemu-storage-daemon and the daemon: the
// same replies, the same events in the same order, and the images after
// check clean and read as they did before.
func TestBlockJobsAnswerAsQSD(t *testing.T) {
	qsd := runJobScript(t, "qemu-storage-daemon")
	ours := runJobScript(t, harness.Bin)
	sameMessages(t, qsd, ours)
}

func runJobScript(t *testing.T, prog string) []string {
	t.Helper()
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	jobChain(t, a)
	jobChain(t, b)
	d := startDaemon(t, prog, nil)
	c := &jobClient{rawClient: dialRaw(t, d.sock, true)}
	add := func(node, path string) {
		c.send(`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "` + node + `", "file": {"driver": "file", "filename": "` + path + `"}}}`)
	}
	add("a", filepath.Join(a, "top.qcow2"))
	add("b", filepath.Join(b, "top.qcow2"))
	// Commit of a, middle layer into base, all automatic.
	c.send(`{"execute": "block-commit", "arguments": {"job-id": "c1", "device": "a", "top": "` + filepath.Join(a, "mid.qcow2") + `"}, "id": 1}`)
	c.until("c1", "null")
	c.send(`{"execute": "query-jobs"}`)
	// Then a stream of a, which now stands on base alone, kept until dismissed.
	c.send(`{"execute": "block-stream", "arguments": {"job-id": "s1", "device": "a", "auto-dismiss": false}}`)
	c.until("s1", "concluded")
	c.send(`{"execute": "query-jobs"}`)
	c.send(`{"execute": "job-finalize", "arguments": {"id": "s1"}}`)
	c.send(`{"execute": "job-dismiss", "arguments": {"id": "s1"}}`)
	c.send(`{"execute": "query-jobs"}`)
	for _, cmd := range []string{
		`{"execute": "job-dismiss", "arguments": {"id": "nope"}}`,
		`{"execute": "job-cancel", "arguments": {"id": "nope"}}`,
		`{"execute": "job-complete", "arguments": {"id": "nope"}}`,
		`{"execute": "job-finalize", "arguments": {"id": "nope"}}`,
		`{"execute": "block-commit", "arguments": {"job-id": "x", "device": "nope", "top": "x"}}`,
		`{"execute": "block-stream", "arguments": {"job-id": "x", "device": "nope"}}`,
		`{"execute": "block-commit", "arguments": {"job-id": "x", "device": "b", "top": "` + filepath.Join(b, "nothere") + `"}}`,
		`{"execute": "block-commit", "arguments": {"job-id": "x", "device": "b", "top": "` + filepath.Join(b, "base.qcow2") + `"}}`,
		`{"execute": "block-stream", "arguments": {"job-id": "x", "device": "b", "base": "` + filepath.Join(b, "nothere") + `"}}`,
		`{"execute": "block-commit", "arguments": {"job-id": "x", "device": "b", "top-node": "nope"}}`,
		`{"execute": "block-commit", "arguments": {"job-id": "x", "device": "b", "top": "` + filepath.Join(b, "mid.qcow2") + `", "base-node": "nope"}}`,
		`{"execute": "block-stream", "arguments": {"job-id": "x", "device": "b", "base-node": "nope"}}`,
		`{"execute": "block-commit", "arguments": {"job-id": "x", "device": "b", "top": "` + filepath.Join(b, "mid.qcow2") + `", "top-node": "b"}}`,
		`{"execute": "block-stream", "arguments": {"job-id": "1x", "device": "b"}}`,
		`{"execute": "block-stream", "arguments": {"job-id": "x"}}`,
		`{"execute": "query-jobs", "arguments": {"x": 1}}`,
	} {
		c.send(cmd)
	}
	// Commit of b's middle layer, finalized by hand.
	c.send(`{"execute": "block-commit", "arguments": {"job-id": "c2", "device": "b", "top": "` + filepath.Join(b, "mid.qcow2") + `", "base": "` + filepath.Join(b, "base.qcow2") + `", "auto-finalize": false}}`)
	c.until("c2", "pending")
	c.send(`{"execute": "query-jobs"}`)
	c.send(`{"execute": "job-dismiss", "arguments": {"id": "c2"}}`)
	c.send(`{"execute": "job-complete", "arguments": {"id": "c2"}}`)
	c.send(`{"execute": "job-finalize", "arguments": {"id": "c2"}}`)
	c.until("c2", "null")
	c.send(`{"execute": "quit"}`)
	if code := d.wait(t); code != 0 {
		t.Fatalf("%s exited %d after quit\n%s", prog, code, d.log)
	}
	out := append(c.replies, c.events...)
	for _, chain := range []string{a, b} {
		top := filepath.Join(chain, "top.qcow2")
		check, _, _ := strings.Cut(harness.Run(t, "qemu-img", "check", top), "\n")
		out = append(out, "check: "+check, "compare: "+harness.Run(t, "qemu-img", "compare", filepath.Join(chain, "pristine", "top.qcow2"), top))
		out = append(out, "chain: "+backingChain(t, top))
	}
	for i := range out {
		out[i] = strings.ReplaceAll(out[i], dir, "$DIR")
	}
	return out
}

// backingChain is the images of path's chain, as qemu-img info names them.
func backingChain(t *testing.T, path string) string {
	t.Helper()
	var names []string
	for _, line := range strings.Split(harness.Run(t, "qemu-img", "info", "--backing-chain", path), "\n") {
		if name, ok := strings.CutPrefix(line, "image: "); ok {
			names = append(names, filepath.Base(name))
		}
	}
	return strings.Join(names, " <- ")
}

// TestCancelledJobsLeaveTheChainAsQSD starts a block-stream held to one
// byte a second, refuses what QSD refuses while it runs (the node's
// deletion and resize, a second job on it, the job verbs of a running
// job), cancels it, then cancels a middle-layer block-commit so held, and
// wants QSD's replies and events (offsets aside) from the daemon, and the
// chain afterwards as it was, clean and reading as before.
func TestCancelledJobsLeaveTheChainAsQSD(t *testing.T) {
	qsd := runCancelScript(t, "qemu-storage-daemon")
	ours := runCancelScript(t, harness.Bin)
	if strings.Join(qsd, "\n") != strings.Join(ours, "\n") {
		t.Fatalf("QSD:\n%s\nours:\n%s", strings.Join(qsd, "\n"), strings.Join(ours, "\n"))
	}
}

func runCancelScript(t *testing.T, prog string) []string {
	t.Helper()
	dir := t.TempDir()
	jobChain(t, dir)
	d := startDaemon(t, prog, nil)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("%s's output:\n%s", prog, d.log)
		}
	})
	c := &jobClient{rawClient: dialRaw(t, d.sock, true)}
	c.send(`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "a", "file": {"driver": "file", "filename": "` + filepath.Join(dir, "top.qcow2") + `"}}}`)
	c.send(`{"execute": "block-stream", "arguments": {"job-id": "neg", "device": "a", "speed": -1}}`)
	c.send(`{"execute": "block-stream", "arguments": {"job-id": "s", "device": "a", "speed": 1}}`)
	c.until("s", "running")
	for _, cmd := range []string{
		`{"execute": "blockdev-del", "arguments": {"node-name": "a"}}`,
		`{"execute": "block_resize", "arguments": {"node-name": "a", "size": 8388608}}`,
		`{"execute": "block-stream", "arguments": {"job-id": "s2", "device": "a"}}`,
		`{"execute": "block-commit", "arguments": {"job-id": "c", "device": "a", "top": "` + filepath.Join(dir, "mid.qcow2") + `"}}`,
		`{"execute": "job-complete", "arguments": {"id": "s"}}`,
		`{"execute": "job-dismiss", "arguments": {"id": "s"}}`,
		`{"execute": "job-finalize", "arguments": {"id": "s"}}`,
		`{"execute": "job-cancel", "arguments": {"id": "s"}}`,
	} {
		c.send(cmd)
	}
	c.until("s", "null")
	c.send(`{"execute": "block-commit", "arguments": {"job-id": "c", "device": "a", "top": "` + filepath.Join(dir, "mid.qcow2") + `", "speed": 1}}`)
	c.until("c", "running")
	c.send(`{"execute": "job-cancel", "arguments": {"id": "c"}}`)
	c.until("c", "null")
	c.send(`{"execute": "query-jobs"}`)
	c.send(`{"execute": "quit"}`)
	if code := d.wait(t); code != 0 {
		t.Fatalf("%s exited %d after quit\n%s", prog, code, d.log)
	}
	top := filepath.Join(dir, "top.qcow2")
	check, _, _ := strings.Cut(harness.Run(t, "qemu-img", "check", top), "\n")
	out := append(c.replies, c.events...)
	out = append(out, "check: "+check, "compare: "+harness.Run(t, "qemu-img", "compare", filepath.Join(dir, "pristine", "top.qcow2"), top),
		"chain: "+backingChain(t, top))
	for i := range out {
		out[i] = strings.ReplaceAll(out[i], dir, "$DIR")
	}
	return out
}

// TestBlockJobsThroughGoQMPClient drives the job commands with go-qemu,
// on both daemons: an active commit cancelled once ready, a middle-layer
// commit kept until dismissed, a stream finalized by hand, each waited
// for through go-qemu's events, and the refusals of an unknown job.
func TestBlockJobsThroughGoQMPClient(t *testing.T) {
	for _, prog := range []string{"qemu-storage-daemon", harness.Bin} {
		t.Run(filepath.Base(prog), func(t *testing.T) {
			dir := t.TempDir()
			jobChain(t, dir)
			d := startDaemon(t, prog, nil)
			m, events := d.monitor(t)
			top := filepath.Join(dir, "top.qcow2")
			run(t, m, "blockdev-add", map[string]any{"driver": "qcow2", "node-name": "a", "file": map[string]any{"driver": "file", "filename": top}})
			// An active commit, cancelled once ready: the top stays.
			run(t, m, "block-commit", map[string]any{"job-id": "act", "device": "a"})
			waitJob(t, events, "act", "ready")
			run(t, m, "job-cancel", map[string]any{"id": "act"})
			waitJob(t, events, "act", "null")
			run(t, m, "block-commit", map[string]any{"job-id": "c", "device": "a", "top": filepath.Join(dir, "mid.qcow2"), "auto-dismiss": false})
			waitJob(t, events, "c", "concluded")
			jobs := run(t, m, "query-jobs", nil).([]any)
			if len(jobs) != 1 || jobs[0].(map[string]any)["status"] != "concluded" || jobs[0].(map[string]any)["type"] != "commit" {
				t.Fatalf("query-jobs after the commit: %v", jobs)
			}
			run(t, m, "job-dismiss", map[string]any{"id": "c"})
			waitJob(t, events, "c", "null")
			run(t, m, "block-stream", map[string]any{"job-id": "s", "device": "a", "auto-finalize": false})
			waitJob(t, events, "s", "pending")
			run(t, m, "job-finalize", map[string]any{"id": "s"})
			waitJob(t, events, "s", "null")
			for _, verb := range []string{"job-cancel", "job-complete", "job-finalize", "job-dismiss"} {
				if _, err := runErr(m, verb, map[string]any{"id": "c"}); err == nil || err.Error() != "Job not found" {
					t.Fatalf("%s of a dismissed job: %v, want Job not found", verb, err)
				}
			}
			run(t, m, "quit", nil)
			if code := d.wait(t); code != 0 {
				t.Fatalf("exit status after quit: %d\n%s", code, d.log)
			}
			harness.Run(t, "qemu-img", "check", top)
			harness.Run(t, "qemu-img", "compare", filepath.Join(dir, "pristine", "top.qcow2"), top)
			if chain := backingChain(t, top); chain != "top.qcow2" {
				t.Fatalf("chain after commit and stream: %s, want top.qcow2 alone", chain)
			}
		})
	}
}

// waitJob waits for JOB_STATUS_CHANGE of job id to status.
func waitJob(t *testing.T, events <-chan qmpEvent, id, status string) {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case e := <-events:
			if e.Event == "JOB_STATUS_CHANGE" && e.Data["id"] == id && e.Data["status"] == status {
				return
			}
		case <-timeout:
			t.Fatalf("no JOB_STATUS_CHANGE of %s to %s", id, status)
		}
	}
}
