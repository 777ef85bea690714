package qsd

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestBlockResizeAnswersAsQSD runs one block_resize sequence against
// qemu-storage-daemon and the daemon and wants the same replies and the
// same sizes seen through the exports: a qcow2 node under a writable
// FUSE export and a raw node under a read-only one grown and shrunk,
// the FUSE files' sizes following once the kernel's attribute timeout
// (one second in both) has passed, an NBD export added after showing
// the new size, and each refusal (a node an NBD export holds, a file
// node under a format node, a read-only node, null-co, qcow2's 512-byte
// multiple, a negative size, device names, a missing size).
func TestBlockResizeAnswersAsQSD(t *testing.T) {
	qsd := runResizeScript(t, "qemu-storage-daemon")
	ours := runResizeScript(t, harness.Bin)
	sameMessages(t, qsd, ours)
}

func runResizeScript(t *testing.T, prog string) []string {
	t.Helper()
	dir := t.TempDir()
	qcow := qcow2Image(t, dir, "disk.qcow2", "1M")
	raw := filepath.Join(dir, "disk.raw")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "raw", raw, "1M")
	ro := filepath.Join(dir, "ro.raw")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "raw", ro, "1M")
	mq, mr := mountFile(t, dir, "qcow.mnt"), mountFile(t, dir, "raw.mnt")
	nbdSock := filepath.Join(dir, "nbd.sock")
	d := startDaemon(t, prog, []string{mq, mr})
	c := dialRaw(t, d.sock, true)
	var out []string
	send := func(cmd string) { t.Helper(); out = append(out, c.exchange(cmd)...) }
	sizes := func(what string) {
		t.Helper()
		time.Sleep(1200 * time.Millisecond) // past both FUSE exports' attribute timeout
		out = append(out, fmt.Sprintf("%s: FUSE sizes %d %d", what, fileSize(t, mq), fileSize(t, mr)))
	}
	send(`{"execute": "blockdev-add", "arguments": {"driver": "file", "node-name": "qf", "filename": "` + qcow + `"}}`)
	send(`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "q", "file": "qf"}}`)
	send(`{"execute": "blockdev-add", "arguments": {"driver": "raw", "node-name": "r", "file": {"driver": "file", "filename": "` + raw + `"}}}`)
	send(`{"execute": "blockdev-add", "arguments": {"driver": "raw", "node-name": "ro", "read-only": true, "file": {"driver": "file", "filename": "` + ro + `"}}}`)
	send(`{"execute": "blockdev-add", "arguments": {"driver": "null-co", "node-name": "n"}}`)
	send(`{"execute": "block-export-add", "arguments": {"type": "fuse", "id": "qe", "node-name": "q", "mountpoint": "` + mq + `", "writable": true}}`)
	send(`{"execute": "block-export-add", "arguments": {"type": "fuse", "id": "re", "node-name": "r", "mountpoint": "` + mr + `"}}`)
	sizes("before")
	send(`{"execute": "block_resize", "arguments": {"node-name": "q", "size": 4194304}}`)
	send(`{"execute": "block_resize", "arguments": {"node-name": "r", "size": 3145728}, "id": 7}`)
	sizes("grown")
	send(`{"execute": "block_resize", "arguments": {"node-name": "q", "size": 524288}}`)
	send(`{"execute": "block_resize", "arguments": {"node-name": "r", "size": 66048}}`) // QEMU rounds a length short of a sector differently over NBD and FUSE
	sizes("shrunk")
	send(`{"execute": "nbd-server-start", "arguments": {"addr": {"type": "unix", "data": {"path": "` + nbdSock + `"}}}}`)
	send(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "rn", "node-name": "r"}}`)
	out = append(out, "NBD size "+strings.TrimSpace(harness.Run(t, "nbdinfo", "--size", "nbd+unix:///r?socket="+nbdSock)))
	for _, args := range []string{
		`{"node-name": "r", "size": 4194304}`, `{"node-name": "qf", "size": 8388608}`, `{"node-name": "ro", "size": 2097152}`,
		`{"node-name": "n", "size": 2097152}`, `{"node-name": "q", "size": 1000}`, `{"node-name": "q", "size": -1}`,
		`{"device": "q", "size": 1048576}`, `{"node-name": "nope", "size": 1048576}`, `{"node-name": "q"}`,
		`{"size": 512}`, `{"node-name": "q", "size": 512, "shrink": true}`,
	} {
		send(`{"execute": "block_resize", "arguments": ` + args + `}`)
	}
	send(`{"execute": "quit"}`)
	if code := d.wait(t); code != 0 {
		t.Fatalf("%s exited %d after quit\n%s", prog, code, d.log)
	}
	// qemu-img check's first line only: where a shrunk image ends is
	// each implementation's own.
	check, _, _ := strings.Cut(harness.Run(t, "qemu-img", "check", qcow), "\n")
	out = append(out, "qcow2 check: "+check, fmt.Sprintf("raw file %d", fileSize(t, raw)))
	for i := range out {
		out[i] = strings.ReplaceAll(out[i], dir, "$DIR")
	}
	return out
}

func fileSize(t *testing.T, path string) int64 {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Size()
}
