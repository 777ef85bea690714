package qsd

import (
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestFUSEExportsAsQEMUIotest308 runs the QMP sequence of QEMU's iotest
// 308 (FUSE exports, up to its tear down) against the daemon on a qcow2
// image and checks what its reference output (308.out) expects: the
// refused mount points in QEMU's words, an export over the image file
// itself, a double export on one mount point refused, the file empty
// again once its export is removed, writes through a writable export,
// and the protocol node's export refusing to grow, resized by fallocate,
// grown when growable and shrunk by truncate.
func TestFUSEExportsAsQEMUIotest308(t *testing.T) {
	dir := t.TempDir()
	img := qcow2Image(t, dir, "t.qcow2", "64M")
	harness.Run(t, "qemu-io", "-c", "write -s /dev/urandom 0 64M", img)
	mp, copied := img+".fuse", img+".copy"
	d := startDaemon(t, harness.Bin, []string{mp, img})
	c := dialRaw(t, d.sock, true)
	ok := func(cmd string) {
		t.Helper()
		if r := c.call(cmd); r["return"] == nil {
			t.Fatalf("%s: %v", cmd, r)
		}
	}
	export := func(id, node, more string) string {
		return `{"execute": "block-export-add", "arguments": {"type": "fuse", "id": "` + id + `", "node-name": "` + node + `", "mountpoint": "` + more + `}}`
	}
	// 308.out (a QEMU newer than 7.2) has the deletion event after the
	// reply; QSD 7.2 sends it before, and so does the daemon.
	del := func(id string) {
		t.Helper()
		if _, err := c.c.Write([]byte(`{"execute": "block-export-del", "arguments": {"id": "` + id + `"}}` + "\n")); err != nil {
			t.Fatal(err)
		}
		if e := c.read(); e["event"] != "BLOCK_EXPORT_DELETED" || e["data"].(map[string]any)["id"] != id {
			t.Fatalf("after block-export-del %s: %v, want its BLOCK_EXPORT_DELETED", id, e)
		}
		if r := c.read(); r["return"] == nil {
			t.Fatalf("block-export-del %s: %v", id, r)
		}
	}
	ok(`{"execute": "blockdev-add", "arguments": {"driver": "file", "node-name": "node-protocol", "filename": "` + img + `"}}`)
	ok(`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "node-format", "file": "node-protocol"}}`)

	// Mount point missing, then a directory.
	wantError(t, "missing mount point", c.call(export("export-err", "node-format", mp+`"`)), "GenericError",
		"Failed to stat '"+mp+"': No such file or directory")
	if err := os.Mkdir(mp, 0o700); err != nil {
		t.Fatal(err)
	}
	wantError(t, "directory mount point", c.call(export("export-err", "node-format", mp+`"`)), "GenericError", "'"+mp+"' is not a regular file")
	os.Remove(mp)

	// A regular file: the image as raw, mode 0400, chmod refused.
	if err := os.WriteFile(mp, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	ok(export("export-mp", "node-format", mp+`"`))
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "qcow2", "-U", mp, img)
	if st, err := os.Stat(mp); err != nil || st.Mode().Perm() != 0o400 {
		t.Fatalf("export's mode: %v %v, want 0400", st, err)
	}
	for _, mode := range []os.FileMode{0o600, 0o500} {
		if err := os.Chmod(mp, mode); !errors.Is(err, syscall.EROFS) {
			t.Fatalf("chmod %o of a read-only export: %v, want Read-only file system", mode, err)
		}
	}

	// Over the image itself, both exports read at once; a copy for later.
	ok(export("export-img", "node-format", img+`"`))
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", "-U", mp, img)
	harness.Run(t, "cp", img, copied)
	os.Chmod(copied, 0o600)

	wantError(t, "double export", c.call(export("export-err", "node-format", mp+`"`)), "GenericError",
		"There already is a FUSE export on '"+mp+"'")

	if out := harness.Run(t, "qemu-img", "info", "-f", "raw", mp); !strings.Contains(out, "virtual size: 64 MiB (67108864 bytes)") {
		t.Fatalf("qemu-img info of the export:\n%s", out)
	}
	del("export-mp")
	if out := harness.Run(t, "qemu-img", "info", "-f", "raw", mp); !strings.Contains(out, "virtual size: 0 B (0 bytes)") {
		t.Fatalf("qemu-img info after the export's removal:\n%s", out)
	}

	// Writable: the read-only export over the image refuses, this one not.
	ok(export("export-mp", "node-format", mp+`", "writable": true`))
	if os.Geteuid() != 0 {
		if out, err := exec.Command("qemu-io", "-f", "raw", "-c", "write -P 42 1M 64k", img).CombinedOutput(); err == nil ||
			!strings.Contains(string(out), "Permission denied") {
			t.Fatalf("writing to the read-only export: %v\n%s", err, out)
		}
	}
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 42 1M 64k", mp)
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 42 1M 64k", copied)

	resizeThroughProtocolNode(t, c, ok, del, export, img, mp)

	// 308.out: the export's deletion event comes before quit's reply
	// (QSD 7.2 sends no SHUTDOWN event; 308.out's newer QEMU does).
	if _, err := c.c.Write([]byte(`{"execute": "quit"}` + "\n")); err != nil {
		t.Fatal(err)
	}
	if e := c.read(); e["event"] != "BLOCK_EXPORT_DELETED" || e["data"].(map[string]any)["id"] != "export-mp" {
		t.Fatalf("first message after quit: %v, want export-mp's BLOCK_EXPORT_DELETED", e)
	}
	if r := c.read(); r["return"] == nil {
		t.Fatalf("quit's reply: %v", r)
	}
	if code := d.wait(t); code != 0 {
		t.Fatalf("exit status after quit: %d\n%s", code, d.log)
	}
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "qcow2", copied, img)
}

// resizeThroughProtocolNode is 308's "Resizing exports": the format
// node gone, the file node exported writable and then growable.
func resizeThroughProtocolNode(t *testing.T, c *rawClient, ok func(string), del func(string),
	export func(id, node, more string) string, img, mp string) {
	t.Helper()
	del("export-mp")
	del("export-img")
	ok(`{"execute": "blockdev-del", "arguments": {"node-name": "node-format"}}`)
	ok(export("export-mp", "node-protocol", mp+`", "writable": true`))
	orig := sameLength(t, mp, img)
	var st syscall.Stat_t
	syscall.Stat(img, &st)
	origBlocks := st.Blocks

	out, err := exec.Command("dd", "if=/dev/zero", "of="+mp, "bs=1", "count=64k", "seek="+strconv.FormatInt(orig, 10)).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "No space left on device") {
		t.Fatalf("dd past the end of a non-growable export: %v\n%s", err, out)
	}
	harness.Run(t, "fallocate", "-o", strconv.FormatInt(orig, 10), "-l", "64k", mp)
	if n := sameLength(t, mp, img); n != orig+65536 {
		t.Fatalf("size after fallocate: %d, want %d", n, orig+65536)
	}
	syscall.Stat(img, &st)
	if st.Blocks <= origBlocks {
		t.Fatalf("disk usage did not grow with fallocate: %d => %d blocks", origBlocks, st.Blocks)
	}

	del("export-mp")
	ok(export("export-mp", "node-protocol", mp+`", "writable": true, "growable": true`))
	harness.Run(t, "dd", "if=/dev/zero", "of="+mp, "bs=1", "count=64k", "seek="+strconv.FormatInt(orig+65536, 10))
	if n := sameLength(t, mp, img); n != orig+131072 {
		t.Fatalf("size after growing: %d, want %d", n, orig+131072)
	}
	harness.Run(t, "truncate", "-s", strconv.FormatInt(orig, 10), mp)
	if n := sameLength(t, mp, img); n != orig {
		t.Fatalf("size after truncate: %d, want %d", n, orig)
	}
}

// sameLength is 308's get_proto_len: the export's length, which must be
// the image file's.
func sameLength(t *testing.T, mp, img string) int64 {
	t.Helper()
	a, b := fileSize(t, mp), fileSize(t, img)
	if a != b {
		t.Fatalf("lengths of export and original differ: %d != %d", a, b)
	}
	return a
}
