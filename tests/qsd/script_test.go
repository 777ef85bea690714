package qsd

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestQSDScriptRunsUnchangedOnBoth runs one script written for
// qemu-storage-daemon (a qcow2 node over a file node, exported over FUSE
// and written through the mount, then over NBD and written with qemu-io,
// each export deleted, the nodes deleted, quit; with a few mistakes a
// script makes on the way) against QSD and against our daemon, and wants
// the same messages back, events included, and the same image after.
// (The FUSE and NBD exports come one after the other: QSD 7.2 refuses a
// writable FUSE export beside an NBD export of one node, whose
// permissions conflict on resize.)
func TestQSDScriptRunsUnchangedOnBoth(t *testing.T) {
	qsdMsgs, qsdImg := runQSDScript(t, "qemu-storage-daemon")
	ourMsgs, ourImg := runQSDScript(t, harness.Bin)
	if len(qsdMsgs) != len(ourMsgs) {
		t.Fatalf("QSD sent %d messages, we sent %d:\nQSD:\n%s\nours:\n%s", len(qsdMsgs), len(ourMsgs),
			strings.Join(qsdMsgs, "\n"), strings.Join(ourMsgs, "\n"))
	}
	for i := range qsdMsgs {
		if qsdMsgs[i] != ourMsgs[i] {
			t.Errorf("message %d:\n QSD: %s\nours: %s", i, qsdMsgs[i], ourMsgs[i])
		}
	}
	harness.Run(t, "qemu-img", "compare", "-f", "qcow2", "-F", "qcow2", qsdImg, ourImg)
	harness.Run(t, "qemu-img", "check", ourImg)
}

// runQSDScript runs the script against prog and returns every message
// after the greeting, normalised (no timestamps), and the image.
func runQSDScript(t *testing.T, prog string) ([]string, string) {
	t.Helper()
	dir := t.TempDir()
	img := qcow2Image(t, dir, "disk.qcow2", "8M")
	mnt := mountFile(t, dir, "disk.raw")
	nbdSock := filepath.Join(dir, "nbd.sock")
	d := startDaemon(t, prog, []string{mnt})
	c := dialRaw(t, d.sock, false)
	var msgs []string
	send := func(cmd string) {
		t.Helper()
		msgs = append(msgs, c.exchange(cmd)...)
	}
	send(`{"execute": "qmp_capabilities", "id": "caps"}`)
	send(`{"execute": "blockdev-add", "arguments": {"driver": "file", "node-name": "disk-file", "filename": "` + img + `"}}`)
	send(`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "disk", "file": "disk-file"}, "id": 2}`)
	send(`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "disk", "file": "disk-file"}}`)
	send(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "too-soon", "node-name": "disk"}}`)
	send(`{"execute": "block-export-add", "arguments": {"type": "fuse", "id": "disk-fuse", "node-name": "disk", "mountpoint": "` + mnt + `", "writable": true}}`)
	send(`{"execute": "query-block-exports"}`)
	writeThroughFUSE(t, mnt)
	send(`{"execute": "block-export-del", "arguments": {"id": "disk-fuse"}}`)
	send(`{"execute": "nbd-server-start", "arguments": {"addr": {"type": "unix", "data": {"path": "` + nbdSock + `"}}}}`)
	send(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "disk-nbd", "node-name": "disk", "name": "disk", "writable": true}}`)
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "read -P 0x11 0 64k", "-c", "write -P 0x22 2M 64k", "nbd+unix:///disk?socket="+nbdSock)
	send(`{"execute": "blockdev-del", "arguments": {"node-name": "disk"}}`)
	send(`{"execute": "block-export-del", "arguments": {"id": "disk-nbd", "mode": "safe"}}`)
	send(`{"execute": "block-export-del", "arguments": {"id": "disk-nbd"}}`)
	send(`{"execute": "nbd-server-stop"}`)
	send(`{"execute": "query-cpus-fast"}`) // a command neither has
	send(`{"execute": "blockdev-del", "arguments": {"node-name": "disk-file"}}`)
	send(`{"execute": "blockdev-del", "arguments": {"node-name": "disk"}}`)
	send(`{"execute": "blockdev-del", "arguments": {"node-name": "disk-file"}}`)
	send(`{"execute": "query-named-block-nodes"}`)
	send(`{"execute": "quit", "id": "bye"}`)
	if code := d.wait(t); code != 0 {
		t.Fatalf("%s exited %d after quit\n%s", prog, code, d.log)
	}
	for i := range msgs {
		msgs[i] = strings.ReplaceAll(msgs[i], dir, "$DIR")
	}
	return msgs, img
}

// writeThroughFUSE writes 64 KiB of 0x11 at 0 and "hello" at 1 MiB with
// plain file writes on the mount.
func writeThroughFUSE(t *testing.T, mnt string) {
	t.Helper()
	f, err := os.OpenFile(mnt, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(bytes.Repeat([]byte{0x11}, 64<<10), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("hello"), 1<<20); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

// exchange sends cmd and returns the messages up to its reply, each
// re-encoded with its keys sorted and without timestamps.
func (rc *rawClient) exchange(cmd string) []string {
	rc.t.Helper()
	if _, err := rc.c.Write([]byte(cmd + "\n")); err != nil {
		rc.t.Fatal(err)
	}
	var out []string
	for {
		m := rc.read()
		delete(m, "timestamp")
		b, _ := json.Marshal(m)
		out = append(out, fmt.Sprintf("%s -> %s", cmd, b))
		if m["event"] == nil {
			return out
		}
	}
}
