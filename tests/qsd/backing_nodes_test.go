package qsd

import (
	"encoding/json"
	"fmt"
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
