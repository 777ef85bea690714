package qsd

import (
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestEveryCommandThroughGoQMPClient drives each QMP command the daemon
// serves with go-qemu's client: nodes of every kind added, one node
// exported over FUSE and NBD at once and written through both, the
// listings, the deletion event, and quit ending the process.
func TestEveryCommandThroughGoQMPClient(t *testing.T) {
	dir := t.TempDir()
	img := qcow2Image(t, dir, "disk.qcow2", "16M")
	other := qcow2Image(t, dir, "other.qcow2", "8M")
	mnt := mountFile(t, dir, "disk.raw")
	nbdSock := filepath.Join(dir, "nbd.sock")
	d := startDaemon(t, harness.Bin, []string{mnt})
	m, events := d.monitor(t)

	v := run(t, m, "query-version", nil).(map[string]any)
	if _, ok := v["qemu"].(map[string]any)["major"]; !ok || !strings.HasPrefix(v["package"].(string), "blockexport") {
		t.Fatalf("query-version: %v", v)
	}
	var names []string
	for _, c := range run(t, m, "query-commands", nil).([]any) {
		names = append(names, c.(map[string]any)["name"].(string))
	}
	for _, want := range []string{"qmp_capabilities", "query-version", "query-commands", "blockdev-add", "blockdev-del", "block-export-add",
		"block-export-del", "query-block-exports", "query-named-block-nodes", "nbd-server-start", "nbd-server-stop", "block_resize",
		"query-blockstats", "object-add", "object-del", "block-stream", "block-commit", "query-jobs", "job-cancel", "job-complete",
		"job-finalize", "job-dismiss", "quit"} {
		if !slices.Contains(names, want) {
			t.Errorf("query-commands lacks %s: %v", want, names)
		}
	}

	run(t, m, "blockdev-add", map[string]any{"driver": "file", "node-name": "disk-file", "filename": img})
	run(t, m, "blockdev-add", map[string]any{"driver": "qcow2", "node-name": "disk", "file": "disk-file"})
	run(t, m, "blockdev-add", map[string]any{"driver": "qcow2", "node-name": "other", "read-only": true,
		"file": map[string]any{"driver": "file", "filename": other}})
	run(t, m, "blockdev-add", map[string]any{"driver": "null-co", "node-name": "nothing", "size": 1 << 20, "read-zeroes": true})
	nodes := map[string]map[string]any{}
	for _, n := range run(t, m, "query-named-block-nodes", nil).([]any) {
		n := n.(map[string]any)
		nodes[n["node-name"].(string)] = n
	}
	if len(nodes) != 5 { // other's inline file child is a node too
		t.Fatalf("query-named-block-nodes: %d nodes, want 5: %v", len(nodes), nodes)
	}
	if n := nodes["disk"]; n["drv"] != "qcow2" || n["file"] != img || n["image"].(map[string]any)["virtual-size"] != float64(16<<20) || n["ro"] != false {
		t.Fatalf("node disk: %v", n)
	}
	if fs, _ := nodes["disk"]["image"].(map[string]any)["format-specific"].(map[string]any); fs["type"] != "qcow2" || fs["data"].(map[string]any)["compat"] != "1.1" {
		t.Fatalf("node disk's format-specific: %v", fs)
	}
	if n := nodes["other"]; n["ro"] != true || nodes["nothing"]["drv"] != "null-co" {
		t.Fatalf("nodes other and nothing: %v", nodes)
	}

	run(t, m, "nbd-server-start", map[string]any{"addr": map[string]any{"type": "unix", "data": map[string]any{"path": nbdSock}}})
	run(t, m, "block-export-add", map[string]any{"type": "nbd", "id": "disk-nbd", "node-name": "disk", "name": "disk", "description": "a disk", "writable": true})
	run(t, m, "block-export-add", map[string]any{"type": "fuse", "id": "disk-fuse", "node-name": "disk", "mountpoint": mnt, "writable": true})
	run(t, m, "block-export-add", map[string]any{"type": "nbd", "id": "other-nbd", "node-name": "other"})
	if !harness.IsFuseMount(mnt) {
		t.Fatalf("%s is not mounted after block-export-add", mnt)
	}
	exports := run(t, m, "query-block-exports", nil).([]any)
	if len(exports) != 3 || exports[0].(map[string]any)["id"] != "other-nbd" || exports[1].(map[string]any)["type"] != "fuse" {
		t.Fatalf("query-block-exports: %v", exports)
	}
	if out := harness.Run(t, "nbdinfo", "--list", "nbd+unix:///?socket="+nbdSock); !strings.Contains(out, "a disk") || !strings.Contains(out, "other") {
		t.Fatalf("nbdinfo --list: the exports or the description are missing:\n%s", out)
	}

	// Write through NBD, read through FUSE; and the other way round.
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x5a 0 64k", "nbd+unix:///disk?socket="+nbdSock)
	f, err := os.OpenFile(mnt, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 64<<10)
	if _, err := f.ReadAt(got, 0); err != nil || !bytes.Equal(got, bytes.Repeat([]byte{0x5a}, 64<<10)) {
		t.Fatalf("FUSE read of what NBD wrote: %v, bytes %x...", err, got[:8])
	}
	if _, err := f.WriteAt(bytes.Repeat([]byte{0xc3}, 4096), 1<<20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "read -P 0xc3 1M 4k", "nbd+unix:///disk?socket="+nbdSock)

	run(t, m, "block-export-del", map[string]any{"id": "disk-fuse"})
	waitEvent(t, events, "disk-fuse")
	if harness.IsFuseMount(mnt) {
		t.Fatal("the FUSE export is still mounted after block-export-del")
	}
	run(t, m, "block-export-del", map[string]any{"id": "disk-nbd", "mode": "hard"})
	waitEvent(t, events, "disk-nbd")
	// nbd-server-stop takes the NBD exports left with it, each with its
	// event, as QEMU does.
	run(t, m, "nbd-server-stop", nil)
	waitEvent(t, events, "other-nbd")
	if got := run(t, m, "query-block-exports", nil).([]any); len(got) != 0 {
		t.Fatalf("exports left after nbd-server-stop: %v", got)
	}
	if _, err := runErr(m, "blockdev-del", map[string]any{"node-name": "disk-file"}); err == nil || err.Error() != "Block device disk-file is in use" {
		t.Fatalf("blockdev-del of a node a qcow2 node sits on: %v", err)
	}
	for _, n := range []string{"disk", "disk-file", "other", "nothing"} {
		run(t, m, "blockdev-del", map[string]any{"node-name": n})
	}
	// TLS credentials (tests/qsd/tls_test.go serves with them).
	run(t, m, "object-add", map[string]any{"qom-type": "tls-creds-x509", "id": "tls0", "dir": makeCertificateDir(t), "endpoint": "server"})
	run(t, m, "object-del", map[string]any{"id": "tls0"})
	if _, err := runErr(m, "object-del", map[string]any{"id": "tls0"}); err == nil || err.Error() != "object 'tls0' not found" {
		t.Fatalf("object-del of a deleted object: %v", err)
	}
	if got := run(t, m, "query-named-block-nodes", nil).([]any); len(got) != 0 {
		t.Fatalf("nodes left after blockdev-del of all (an inline child must go with its parent): %v", got)
	}
	run(t, m, "quit", nil)
	if code := d.wait(t); code != 0 {
		t.Fatalf("exit status after quit: %d\n%s", code, d.log)
	}
	harness.Run(t, "qemu-img", "check", img)
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "read -P 0x5a 0 64k", "-c", "read -P 0xc3 1M 4k", img)
}

// waitEvent waits for BLOCK_EXPORT_DELETED of export id.
func waitEvent(t *testing.T, events <-chan qmpEvent, id string) {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case e := <-events:
			if e.Event == "BLOCK_EXPORT_DELETED" && e.Data["id"] == id {
				return
			}
		case <-timeout:
			t.Fatalf("no BLOCK_EXPORT_DELETED for %s", id)
		}
	}
}
