package qsd

import (
	"encoding/json"
	"regexp"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestBlockstatsHasQSDShape runs query-blockstats against
// qemu-storage-daemon and the daemon after I/O through a FUSE export
// and wants the same rows: every node oldest first, a format node's
// file child as "parent", a file node's "driver-specific", QEMU's field
// names, and the counters QSD shows (zero: QEMU accounts on the
// export's unnamed BlockBackend, not on the node). wr_highest_offset
// and the file driver's discard counts are left out of the comparison:
// they follow each implementation's own metadata writes.
func TestBlockstatsHasQSDShape(t *testing.T) {
	qsd := runBlockstatsScript(t, "qemu-storage-daemon")
	ours := runBlockstatsScript(t, harness.Bin)
	if strings.Join(qsd, "\n") != strings.Join(ours, "\n") {
		t.Fatalf("query-blockstats differs:\nQSD:\n%s\nours:\n%s", strings.Join(qsd, "\n"), strings.Join(ours, "\n"))
	}
	if !strings.Contains(ours[0], `"rd_total_time_ns":0`) || !strings.Contains(ours[0], `"parent":{`) {
		t.Fatalf("query-blockstats lacks QEMU's fields: %s", ours[0])
	}
}

var implicitNode = regexp.MustCompile(`#block[0-9]+`)

func runBlockstatsScript(t *testing.T, prog string) []string {
	t.Helper()
	dir := t.TempDir()
	img := qcow2Image(t, dir, "disk.qcow2", "8M")
	mnt := mountFile(t, dir, "disk.mnt")
	d := startDaemon(t, prog, []string{mnt})
	c := dialRaw(t, d.sock, true)
	for _, cmd := range []string{
		`{"execute": "blockdev-add", "arguments": {"driver": "file", "node-name": "disk-file", "filename": "` + img + `"}}`,
		`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "disk", "file": "disk-file"}}`,
		`{"execute": "blockdev-add", "arguments": {"driver": "raw", "node-name": "inline", "read-only": true, "file": {"driver": "file", "filename": "` + img + `"}}}`,
		`{"execute": "blockdev-add", "arguments": {"driver": "null-co", "node-name": "nothing"}}`,
		`{"execute": "block-export-add", "arguments": {"type": "fuse", "id": "disk-fuse", "node-name": "disk", "mountpoint": "` + mnt + `", "writable": true}}`,
	} {
		if r := c.call(cmd); r["return"] == nil {
			t.Fatalf("%s: %v", cmd, r)
		}
	}
	writeThroughFUSE(t, mnt)
	var out []string
	for _, cmd := range []string{
		`{"execute": "query-blockstats", "arguments": {"query-nodes": true}}`,
		`{"execute": "query-blockstats"}`,
		`{"execute": "query-blockstats", "arguments": {"query-nodes": false}}`,
		`{"execute": "query-blockstats", "arguments": {"query-nodes": 1}}`,
		`{"execute": "query-blockstats", "arguments": {"bogus": true}}`,
	} {
		r := c.call(cmd)
		forgetOwnCounts(r)
		b, _ := json.Marshal(r)
		out = append(out, implicitNode.ReplaceAllString(string(b), "#block"))
	}
	c.call(`{"execute": "quit"}`)
	if code := d.wait(t); code != 0 {
		t.Fatalf("%s exited %d after quit\n%s", prog, code, d.log)
	}
	return out
}

// forgetOwnCounts zeroes, at any depth, the members that count an
// implementation's own metadata writes.
func forgetOwnCounts(v any) {
	switch v := v.(type) {
	case map[string]any:
		for k, x := range v {
			switch k {
			case "wr_highest_offset", "discard-nb-ok", "discard-bytes-ok":
				v[k] = 0
			default:
				forgetOwnCounts(x)
			}
		}
	case []any:
		for _, x := range v {
			forgetOwnCounts(x)
		}
	}
}
