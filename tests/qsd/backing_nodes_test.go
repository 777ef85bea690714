package qsd

import (
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// sameAsQSD runs script against qemu-storage-daemon and the daemon and
// wants the same lines from both.
func sameAsQSD(t *testing.T, script func(t *testing.T, prog string) []string) {
	t.Helper()
	qsd := script(t, "qemu-storage-daemon")
	ours := script(t, harness.Bin)
	if len(qsd) != len(ours) {
		t.Fatalf("QSD gave %d lines, we gave %d:\nQSD:\n%s\nours:\n%s", len(qsd), len(ours),
			strings.Join(qsd, "\n"), strings.Join(ours, "\n"))
	}
	for i := range qsd {
		if qsd[i] != ours[i] {
			t.Errorf("line %d:\n QSD: %s\nours: %s", i, qsd[i], ours[i])
		}
	}
}

var actualSize = regexp.MustCompile(`"actual-size":[1-9][0-9]*`)

// namedNodes is query-named-block-nodes's answer, one line a node with
// its keys sorted, and the name of each node by its driver and file
// ("qcow2 mid.qcow2", "file mid.qcow2"; the base name of the file), for
// a script to name a backing layer whose name QEMU made up.
func namedNodes(t *testing.T, c *jobClient) (rows []string, names map[string]string) {
	t.Helper()
	r := c.call(`{"execute": "query-named-block-nodes"}`)
	list, ok := r["return"].([]any)
	if !ok {
		t.Fatalf("query-named-block-nodes: %v", r)
	}
	names = map[string]string{}
	for _, n := range list {
		n := n.(map[string]any)
		b, _ := json.Marshal(n)
		row := implicitNode.ReplaceAllString(string(b), "#block")
		// Host allocation is the file system's, run to run: that it is
		// there is compared.
		rows = append(rows, actualSize.ReplaceAllString(row, `"actual-size":"some"`))
		names[fmt.Sprintf("%s %s", n["drv"], filepath.Base(n["file"].(string)))] = n["node-name"].(string)
	}
	return rows, names
}

// TestBackingLayersAreNamedNodesAsQSD: a qcow2 node's backing chain
// opens as nodes of its own, each over a file node, listed by
// query-named-block-nodes in QSD's order with QSD's fields (read-only,
// backing_file_depth, backing_file, the image with its backing-image),
// for a node over an inline file child and one over a file node, and
// the 512-byte-rounded length of a file node as QEMU gives it.
func TestBackingLayersAreNamedNodesAsQSD(t *testing.T) {
	sameAsQSD(t, func(t *testing.T, prog string) []string {
		dir := t.TempDir()
		a, b := filepath.Join(dir, "a"), filepath.Join(dir, "b")
		deepChain(t, a)
		jobChain(t, b)
		d := startDaemon(t, prog, nil)
		c := &jobClient{rawClient: dialRaw(t, d.sock, true)}
		c.send(`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "a", "file": {"driver": "file", "filename": "` + filepath.Join(a, "top.qcow2") + `"}}}`)
		c.send(`{"execute": "blockdev-add", "arguments": {"driver": "file", "node-name": "b-file", "filename": "` + filepath.Join(b, "top.qcow2") + `"}}`)
		c.send(`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "b", "read-only": true, "file": "b-file"}}`)
		rows, _ := namedNodes(t, c)
		c.send(`{"execute": "blockdev-del", "arguments": {"node-name": "a"}}`)
		after, _ := namedNodes(t, c)
		c.send(`{"execute": "quit"}`)
		if code := d.wait(t); code != 0 {
			t.Fatalf("%s exited %d after quit\n%s", prog, code, d.log)
		}
		out := append(append(c.replies, rows...), "after a's blockdev-del:")
		out = append(append(out, after...), c.events...)
		if len(rows) != 2+2*3+2+2*2 {
			t.Errorf("%s lists %d nodes, want 14 (each layer and its file)", prog, len(rows))
		}
		for i := range out {
			out[i] = strings.ReplaceAll(out[i], dir, "$DIR")
		}
		return out
	})
}

// TestJobsTakeBackingLayersByNodeNameAsQSD: block-commit's top-node and
// base-node and block-stream's base-node and bottom name backing layers
// by the names QEMU gave them, refused in QSD's words for a node outside
// the chain (another node's layer, a layer's file node, the node itself
// as a stream's base), a base above the top and a name no node has; a
// stream to a bottom layer, a commit between two named layers and a
// stream to a named base do what QSD does to the images, and the layers
// they take out of a chain leave query-named-block-nodes with them.
func TestJobsTakeBackingLayersByNodeNameAsQSD(t *testing.T) {
	sameAsQSD(t, func(t *testing.T, prog string) []string {
		dir := t.TempDir()
		a, b := filepath.Join(dir, "a"), filepath.Join(dir, "b")
		deepChain(t, a)
		deepChain(t, b)
		d := startDaemon(t, prog, nil)
		c := &jobClient{rawClient: dialRaw(t, d.sock, true)}
		c.send(`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "a", "file": {"driver": "file", "filename": "` + filepath.Join(a, "top.qcow2") + `"}}}`)
		c.send(`{"execute": "blockdev-add", "arguments": {"driver": "file", "node-name": "b-file", "filename": "` + filepath.Join(b, "top.qcow2") + `"}}`)
		c.send(`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "b", "file": "b-file"}}`)
		_, names := namedNodes(t, c)
		// a's and b's layers have the same base names; the listing is
		// newest first, so a's, listed after b's, are the ones kept.
		aLayer := func(file string) string { return names["qcow2 "+file] }
		job := func(verb, args string) {
			c.send(`{"execute": "` + verb + `", "arguments": {"job-id": "x", "device": "a", ` + args + `}}`)
		}
		for _, args := range []string{
			`"top-node": "nope"`,
			`"top-node": "` + names["file mid.qcow2"] + `"`,
			`"top-node": "b"`,
			`"top-node": "` + aLayer("mid.qcow2") + `", "top": "` + filepath.Join(a, "mid.qcow2") + `"`,
			`"top-node": "` + aLayer("mid.qcow2") + `", "base-node": "` + aLayer("mid2.qcow2") + `"`,
			`"top-node": "` + aLayer("mid.qcow2") + `", "base-node": "` + aLayer("mid.qcow2") + `"`,
			`"top-node": "` + aLayer("mid.qcow2") + `", "base-node": "nope"`,
			`"top": "` + filepath.Join(a, "mid2.qcow2") + `", "base-node": "a"`,
		} {
			job("block-commit", args)
		}
		for _, args := range []string{
			`"base-node": "a"`,
			`"base-node": "b"`,
			`"base-node": "nope"`,
			`"base-node": "` + names["file base.qcow2"] + `"`,
			`"bottom": "b"`,
			`"bottom": "` + names["file mid2.qcow2"] + `"`,
			`"bottom": "nope"`,
		} {
			job("block-stream", args)
		}
		// chain is node's layers by file, from its own directory.
		chain := func(node string) map[string]string {
			r := c.call(`{"execute": "query-named-block-nodes"}`)
			own := map[string]string{}
			for _, n := range r["return"].([]any) {
				n := n.(map[string]any)
				if f := n["file"].(string); strings.HasPrefix(f, filepath.Join(dir, node)+"/") && n["drv"] == "qcow2" {
					own[filepath.Base(f)] = n["node-name"].(string)
				}
			}
			return own
		}
		var chains []string
		note := func(what, text string) { chains = append(chains, what+": "+text) }

		// a: stream with mid2 as the bottom: mid2 is copied into top,
		// which then names mid.
		la := chain("a")
		c.send(`{"execute": "block-stream", "arguments": {"job-id": "s1", "device": "a", "bottom": "` + la["mid2.qcow2"] + `"}}`)
		c.until("s1", "null")
		note("a streamed to its bottom", chainNow(t, filepath.Join(a, "top.qcow2")))
		rows, _ := namedNodes(t, c)
		chains = append(chains, rows...)

		// b: commit mid into base by node names, b's own image naming
		// mid2 as it was; then mid2 into base with base given by node.
		lb := chain("b")
		c.send(`{"execute": "block-commit", "arguments": {"job-id": "c1", "device": "b", "top-node": "` + lb["mid.qcow2"] + `", "base-node": "` + lb["base.qcow2"] + `"}}`)
		c.until("c1", "null")
		note("b committed mid", chainNow(t, filepath.Join(b, "top.qcow2")))
		c.send(`{"execute": "block-stream", "arguments": {"job-id": "s2", "device": "b", "base-node": "` + lb["base.qcow2"] + `"}}`)
		c.until("s2", "null")
		note("b streamed to base", chainNow(t, filepath.Join(b, "top.qcow2")))
		rows, _ = namedNodes(t, c)
		chains = append(chains, rows...)

		c.send(`{"execute": "quit"}`)
		if code := d.wait(t); code != 0 {
			t.Fatalf("%s exited %d after quit\n%s", prog, code, d.log)
		}
		out := append(append(c.replies, c.events...), chains...)
		for _, img := range []string{"a/top.qcow2", "b/top.qcow2"} {
			p := filepath.Join(dir, img)
			check, _, _ := strings.Cut(harness.Run(t, "qemu-img", "check", p), "\n")
			pristine := filepath.Join(dir, filepath.Dir(img), "pristine", filepath.Base(img))
			out = append(out, img+" check: "+check, img+" compare: "+harness.Run(t, "qemu-img", "compare", pristine, p))
		}
		for i := range out {
			out[i] = implicitNode.ReplaceAllString(strings.ReplaceAll(out[i], dir, "$DIR"), "#block")
		}
		return out
	})
}

// TestBlockdevAddBackingAsQSD: blockdev-add's backing: null opens an
// overlay alone (what its backing file holds reads as zeroes, its header
// still naming it, a stream of it changing nothing), and backing: "NODE"
// puts an existing node under a new overlay, which then holds it
// (blockdev-del of it busy until the overlay goes); both show QEMU's
// json: filename, and a name no node has, an inline-less wrong type,
// are refused in QSD's words. Reads through NBD exports of the overlays
// see the same bytes from both daemons.
func TestBlockdevAddBackingAsQSD(t *testing.T) {
	sameAsQSD(t, func(t *testing.T, prog string) []string {
		dir := t.TempDir()
		deepChain(t, dir)
		d := startDaemon(t, prog, nil)
		c := &jobClient{rawClient: dialRaw(t, d.sock, true)}
		qcow2 := func(node, file, more string) string {
			return `{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "` + node + `", ` + more + `"file": {"driver": "file", "filename": "` + filepath.Join(dir, file) + `"}}}`
		}
		nbdSock := filepath.Join(dir, "nbd.sock")
		for _, cmd := range []string{
			qcow2("mid2", "mid2.qcow2", `"read-only": true, `),
			qcow2("over", "top.qcow2", `"backing": "mid2", `),
			qcow2("lost", "pristine/mid.qcow2", `"backing": "nope", `),
			qcow2("odd", "pristine/mid.qcow2", `"backing": 5, `),
			qcow2("alone", "pristine/top.qcow2", `"backing": null, `),
			`{"execute": "blockdev-del", "arguments": {"node-name": "mid2"}}`,
			`{"execute": "nbd-server-start", "arguments": {"addr": {"type": "unix", "data": {"path": "` + nbdSock + `"}}}}`,
			`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "e1", "node-name": "over"}}`,
			`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "e2", "node-name": "alone"}}`,
		} {
			c.send(cmd)
		}
		rows, _ := namedNodes(t, c)
		var reads []string
		read := func(export, cmd string) {
			out, err := exec.Command("qemu-io", "-r", "-f", "raw", "-c", cmd, "nbd+unix:///"+export+"?socket="+nbdSock).CombinedOutput()
			got := "reads as expected"
			if err != nil || strings.Contains(string(out), "verification failed") || strings.Contains(string(out), "error") {
				got = "reads otherwise: " + firstLine(string(out))
			}
			if err != nil || got != "reads as expected" {
				t.Errorf("%s: export %s, %s: %s", prog, export, cmd, out)
			}
			reads = append(reads, export+" "+cmd+": "+got)
		}
		read("over", "read -P 5 1M 512k") // mid2's, through the given node
		read("over", "read -P 3 1536k 1M")
		read("over", "read -P 1 0 512k")   // base's, below mid2
		read("alone", "read -P 0 0 1536k") // the backing files' is not read
		read("alone", "read -P 3 1536k 1M")
		c.send(`{"execute": "block-export-del", "arguments": {"id": "e1"}}`)
		c.send(`{"execute": "block-export-del", "arguments": {"id": "e2"}}`)
		c.send(`{"execute": "block-stream", "arguments": {"job-id": "s", "device": "alone"}}`)
		c.until("s", "null")
		reads = append(reads, "alone after its stream: "+chainNow(t, filepath.Join(dir, "pristine", "top.qcow2")))
		c.send(`{"execute": "blockdev-del", "arguments": {"node-name": "over"}}`)
		c.send(`{"execute": "blockdev-del", "arguments": {"node-name": "mid2"}}`)
		after, _ := namedNodes(t, c)
		c.send(`{"execute": "quit"}`)
		if code := d.wait(t); code != 0 {
			t.Fatalf("%s exited %d after quit\n%s", prog, code, d.log)
		}
		out := append(append(append(append(c.replies, c.events...), rows...), reads...), "after the deletes:")
		out = append(out, after...)
		for i := range out {
			out[i] = implicitNode.ReplaceAllString(strings.ReplaceAll(out[i], dir, "$DIR"), "#block")
		}
		return out
	})
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}

// TestJobsOnAGivenBackingNodeAreRefused: a node given as an overlay's
// backing takes no job while the overlay is there (the overlay reads its
// files through an open of its own, which a job writing them would
// leave stale), nor does the overlay take a commit into that node's
// chain; once the overlay goes, the node's jobs run again. Here QSD
// differs (one graph, it runs them): the refusal is ours.
func TestJobsOnAGivenBackingNodeAreRefused(t *testing.T) {
	dir := t.TempDir()
	deepChain(t, dir)
	d := startDaemon(t, harness.Bin, nil)
	c := dialRaw(t, d.sock, true)
	for _, cmd := range []string{
		`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "mid2", "read-only": true, "file": {"driver": "file", "filename": "` + filepath.Join(dir, "mid2.qcow2") + `"}}}`,
		`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "over", "backing": "mid2", "file": {"driver": "file", "filename": "` + filepath.Join(dir, "top.qcow2") + `"}}}`,
	} {
		if r := c.call(cmd); r["return"] == nil {
			t.Fatalf("%s: %v", cmd, r)
		}
	}
	wantError(t, "block-stream of the given node", c.call(`{"execute": "block-stream", "arguments": {"job-id": "s", "device": "mid2"}}`),
		"GenericError", "Node 'mid2' is given as the backing of node 'over': a job on it is not taken here while that node is there")
	wantError(t, "block-commit of the given node", c.call(`{"execute": "block-commit", "arguments": {"job-id": "c", "device": "mid2"}}`),
		"GenericError", "Node 'mid2' is given as the backing of node 'over': a job on it is not taken here while that node is there")
	wantError(t, "block-commit into the given node", c.call(`{"execute": "block-commit", "arguments": {"job-id": "c", "device": "over", "top-node": "mid2"}}`),
		"GenericError", "Node 'over' stands on node 'mid2' given as its backing: a commit into that node's chain is not taken here")
	wantError(t, "a writable node as the backing", c.call(`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "o2", "backing": "over", "file": {"driver": "file", "filename": "`+filepath.Join(dir, "pristine", "top.qcow2")+`"}}}`),
		"GenericError", "Backing node 'over' is writable: only a read-only node is taken as a backing file here")
	if r := c.call(`{"execute": "blockdev-del", "arguments": {"node-name": "over"}}`); r["return"] == nil {
		t.Fatalf("blockdev-del over: %v", r)
	}
	// mid2 is read-only: the stream is refused for that now, not for
	// the overlay that was there.
	r := c.call(`{"execute": "block-stream", "arguments": {"job-id": "s", "device": "mid2"}}`)
	if e, _ := r["error"].(map[string]any); e == nil || strings.Contains(e["desc"].(string), "given as the backing") {
		t.Fatalf("block-stream of mid2 after the overlay went: %v", r)
	}
}
