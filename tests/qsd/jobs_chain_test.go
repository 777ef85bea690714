package qsd

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// deepChain makes base.qcow2 <- mid.qcow2 <- mid2.qcow2 <- top.qcow2 in
// dir, each layer with data of its own, partly over the layers below,
// and a copy of each under pristine/ for reference.
func deepChain(t *testing.T, dir string) {
	t.Helper()
	for _, d := range []string{dir, filepath.Join(dir, "pristine")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		img := func(name, backing, write string) {
			p := filepath.Join(d, name)
			if backing == "" {
				harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", p, "4M")
			} else {
				harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", backing, "-F", "qcow2", p)
			}
			harness.Run(t, "qemu-io", "-c", write, p)
		}
		img("base.qcow2", "", "write -P 1 0 2M")
		img("mid.qcow2", "base.qcow2", "write -P 2 512k 1M")
		img("mid2.qcow2", "mid.qcow2", "write -P 5 1M 1M")
		img("top.qcow2", "mid2.qcow2", "write -P 3 1536k 1M")
	}
}

// chainNow is path's backing chain, each image with the backing file
// name its header records, read while a daemon holds the image (-U).
func chainNow(t *testing.T, path string) string {
	t.Helper()
	var out []string
	for _, line := range strings.Split(harness.Run(t, "qemu-img", "info", "-U", "--backing-chain", path), "\n") {
		if name, ok := strings.CutPrefix(line, "image: "); ok {
			out = append(out, filepath.Base(name))
		}
		if name, ok := strings.CutPrefix(line, "backing file: "); ok {
			out[len(out)-1] += " (names " + name + ")"
		}
	}
	return strings.Join(out, " <- ")
}

// TestStreamToABaseAndCommitOfADeepLayerAsQSD streams a node's chain
// down to a named base and commits a layer two below a node's image,
// each with auto-finalize off (the latter node exported over NBD),
// against qemu-storage-daemon and the daemon: the same replies and
// events, the same backing files named
// while the job is pending (the old ones: the change is made at
// finalize) and after it, and the images afterwards clean, reading as
// they did before.
func TestStreamToABaseAndCommitOfADeepLayerAsQSD(t *testing.T) {
	qsd := runChainJobScript(t, "qemu-storage-daemon")
	ours := runChainJobScript(t, harness.Bin)
	sameMessages(t, qsd, ours)
}

func runChainJobScript(t *testing.T, prog string) []string {
	t.Helper()
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	deepChain(t, a)
	deepChain(t, b)
	d := startDaemon(t, prog, nil)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("%s's output:\n%s", prog, d.log)
		}
	})
	c := &jobClient{rawClient: dialRaw(t, d.sock, true)}
	var chains []string
	noteChain := func(what, text string) { chains = append(chains, what+": "+text) }
	c.send(`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "a", "file": {"driver": "file", "filename": "` + filepath.Join(a, "top.qcow2") + `"}}}`)
	c.send(`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "b", "file": {"driver": "file", "filename": "` + filepath.Join(b, "top.qcow2") + `"}}}`)
	for _, cmd := range []string{
		// A backing file name with nothing to name: the whole chain.
		`{"execute": "block-stream", "arguments": {"job-id": "x", "device": "a", "backing-file": "base.qcow2"}}`,
		// A base above top, and a base not in the chain.
		`{"execute": "block-commit", "arguments": {"job-id": "x", "device": "a", "top": "` + filepath.Join(a, "mid.qcow2") + `", "base": "` + filepath.Join(a, "mid2.qcow2") + `"}}`,
		`{"execute": "block-stream", "arguments": {"job-id": "x", "device": "a", "base": "` + filepath.Join(b, "mid.qcow2") + `"}}`,
		// block-stream's own words for its conflicts; a bottom not there.
		`{"execute": "block-stream", "arguments": {"job-id": "x", "device": "a", "base": "` + filepath.Join(a, "base.qcow2") + `", "base-node": "a"}}`,
		`{"execute": "block-stream", "arguments": {"job-id": "x", "device": "a", "base": "` + filepath.Join(a, "base.qcow2") + `", "bottom": "a"}}`,
		`{"execute": "block-stream", "arguments": {"job-id": "x", "device": "a", "bottom": "a", "base-node": "a"}}`,
		`{"execute": "block-stream", "arguments": {"job-id": "x", "device": "a", "bottom": "nope"}}`,
	} {
		c.send(cmd)
	}

	// a: a stream whose bottom is the node itself streams nothing.
	c.send(`{"execute": "block-stream", "arguments": {"job-id": "s0", "device": "a", "bottom": "a", "filter-node-name": "f0"}}`)
	c.until("s0", "null")
	noteChain("a after a stream of nothing", chainNow(t, filepath.Join(a, "top.qcow2")))

	// a: stream down to mid (mid2 copied into top), finalized by hand.
	c.send(`{"execute": "block-stream", "arguments": {"job-id": "s1", "device": "a", "base": "` + filepath.Join(a, "mid.qcow2") + `", "auto-finalize": false}}`)
	c.until("s1", "pending")
	noteChain("a pending", chainNow(t, filepath.Join(a, "top.qcow2")))
	c.send(`{"execute": "query-jobs"}`)
	c.send(`{"execute": "job-finalize", "arguments": {"id": "s1"}}`)
	c.until("s1", "null")
	noteChain("a streamed", chainNow(t, filepath.Join(a, "top.qcow2")))

	// b: commit mid (below mid2, the node's backing file) into base,
	// the node exported over NBD meanwhile; mid is held till then.
	nbdSock := filepath.Join(dir, "nbd.sock")
	c.send(`{"execute": "nbd-server-start", "arguments": {"addr": {"type": "unix", "data": {"path": "` + nbdSock + `"}}}}`)
	c.send(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "eb", "node-name": "b"}}`)
	noteChain("b's middle layer, written", writeTakesLock(t, filepath.Join(b, "mid.qcow2")))
	c.send(`{"execute": "block-commit", "arguments": {"job-id": "c1", "device": "b", "top": "` + filepath.Join(b, "mid.qcow2") + `", "base": "` + filepath.Join(b, "base.qcow2") + `", "auto-finalize": false, "filter-node-name": "f1", "backing-file": "base.qcow2"}}`)
	c.until("c1", "pending")
	noteChain("b pending", chainNow(t, filepath.Join(b, "top.qcow2")))
	c.send(`{"execute": "job-finalize", "arguments": {"id": "c1"}}`)
	c.until("c1", "null")
	noteChain("b committed", chainNow(t, filepath.Join(b, "top.qcow2")))

	// mid is out of b's chain: the daemon lets it go (its write lock
	// free, a write into it harmless to b), and reads b through the new
	// chain, which the stream below shows (it would copy mid's clusters
	// too, from a chain that still held it).
	noteChain("b's dropped layer, written", writeTakesLock(t, filepath.Join(b, "mid.qcow2")))
	if err := os.Remove(filepath.Join(b, "mid.qcow2")); err != nil {
		t.Fatal(err)
	}
	noteChain("b's export after the commit", harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "qcow2",
		"nbd+unix:///b?socket="+nbdSock, filepath.Join(b, "pristine", "top.qcow2")))
	c.send(`{"execute": "block-export-del", "arguments": {"id": "eb"}}`)

	// b again: stream mid2 into top, naming base as given.
	c.send(`{"execute": "block-stream", "arguments": {"job-id": "s2", "device": "b", "base": "` + filepath.Join(b, "base.qcow2") + `", "backing-file": "base.qcow2"}}`)
	c.until("s2", "null")
	noteChain("b streamed to base", chainNow(t, filepath.Join(b, "top.qcow2")))

	c.send(`{"execute": "quit"}`)
	if code := d.wait(t); code != 0 {
		t.Fatalf("%s exited %d after quit\n%s", prog, code, d.log)
	}
	out := append(append(c.replies, c.events...), chains...)
	for _, img := range []string{"a/top.qcow2", "b/top.qcow2", "b/mid2.qcow2"} {
		p := filepath.Join(dir, img)
		check, _, _ := strings.Cut(harness.Run(t, "qemu-img", "check", p), "\n")
		pristine := filepath.Join(dir, filepath.Dir(img), "pristine", filepath.Base(img))
		out = append(out, img+" check: "+check, img+" compare: "+harness.Run(t, "qemu-img", "compare", pristine, p))
	}
	// Only what the layers above the base held was copied: what the base
	// (and a's mid) hold still comes from them. (Read after quit: QSD
	// keeps its metadata in memory until then.)
	for _, img := range []string{"a/top.qcow2", "b/top.qcow2"} {
		out = append(out, img+" map: "+harness.Run(t, "qemu-img", "map", "--output=json", filepath.Join(dir, img)))
	}
	for i := range out {
		out[i] = strings.ReplaceAll(out[i], dir, "$DIR")
	}
	return out
}

// writeTakesLock writes a cluster of pattern 9 into the image at path
// with qemu-io, which takes its write lock first: what it said, the lock
// refused or the write done.
func writeTakesLock(t *testing.T, path string) string {
	t.Helper()
	out, err := exec.Command("qemu-io", "-c", "write -P 9 0 64k", path).CombinedOutput()
	switch {
	case err == nil:
		return "written"
	case strings.Contains(string(out), `Failed to get "write" lock`):
		return "write lock refused"
	}
	t.Fatalf("qemu-io write %s: %v\n%s", path, err, out)
	return ""
}
