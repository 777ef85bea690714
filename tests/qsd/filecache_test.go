package qsd

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestFileNodeAIOAndCacheDirectAsQSD: the file driver's aio (threads,
// io_uring, native) and cache.direct, given on the file node or on the
// format node above it, are taken as QSD 7.2 takes them: aio=native
// without cache.direct=on is refused in its words, query-named-block-nodes
// shows cache.direct, the host file is open with O_DIRECT exactly when it
// is asked for, and the data reads back over NBD.
func TestFileNodeAIOAndCacheDirectAsQSD(t *testing.T) {
	for _, prog := range []string{"qemu-storage-daemon", harness.Bin} {
		t.Run(filepath.Base(prog), func(t *testing.T) {
			dir := t.TempDir()
			img := qcow2Image(t, dir, "disk.qcow2", "4M")
			harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 1M 64k", img)
			d := startDaemon(t, prog, nil)
			c := dialRaw(t, d.sock, true)
			wantError(t, "aio=native without cache.direct", c.call(`{"execute": "blockdev-add", "arguments": {"driver": "file", "node-name": "f", "filename": "`+img+`", "aio": "native"}}`),
				"GenericError", "aio=native was specified, but it requires cache.direct=on, which was not specified.")
			wantError(t, "an unknown aio", c.call(`{"execute": "blockdev-add", "arguments": {"driver": "file", "node-name": "f", "filename": "`+img+`", "aio": "posix"}}`),
				"GenericError", "Parameter 'aio' does not accept value 'posix'")
			for _, tc := range []struct {
				name, file, format string
				// direct: the file node's cache.direct (inherited from
				// the format node) and so O_DIRECT; formatDirect: what
				// the format node shows, its own.
				direct, formatDirect bool
			}{
				{"threads", `"aio": "threads"`, ``, false, false},
				{"io_uring", `"aio": "io_uring"`, ``, false, false},
				{"native on the file node", `"aio": "native", "cache": {"direct": true}`, ``, true, false},
				{"direct from the format node", `"aio": "io_uring"`, `"cache": {"direct": true, "no-flush": false}, `, true, true},
			} {
				reply := c.call(`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "q", ` + tc.format + `"file": {"driver": "file", "node-name": "f", "filename": "` + img + `", ` + tc.file + `}}}`)
				if reply["return"] == nil {
					t.Fatalf("%s: blockdev-add: %v", tc.name, reply)
				}
				nodes, _ := c.call(`{"execute": "query-named-block-nodes"}`)["return"].([]any)
				got := map[string]bool{}
				for _, n := range nodes {
					n := n.(map[string]any)
					got[fmt.Sprint(n["node-name"])] = n["cache"].(map[string]any)["direct"] == true
				}
				if len(got) != 2 || got["q"] != tc.formatDirect || got["f"] != tc.direct {
					t.Errorf("%s: cache.direct of the nodes %v, want q %v, f %v", tc.name, got, tc.formatDirect, tc.direct)
				}
				if flags := openFlags(t, d.cmd.Process.Pid, img); flags&0o40000 != 0 != tc.direct {
					t.Errorf("%s: the image is open with flags %#o: O_DIRECT %v, want %v", tc.name, flags, flags&0o40000 != 0, tc.direct)
				}
				if r := c.call(`{"execute": "blockdev-del", "arguments": {"node-name": "q"}}`); r["return"] == nil {
					t.Fatalf("%s: blockdev-del q: %v", tc.name, r)
				}
				// The inline file node goes with its parent.
				wantError(t, tc.name+": blockdev-del f", c.call(`{"execute": "blockdev-del", "arguments": {"node-name": "f"}}`),
					"GenericError", "Failed to find node with node-name='f'")
			}
			// The data, through an O_DIRECT node exported over NBD.
			sock := filepath.Join(dir, "nbd.sock")
			for _, cmd := range []string{
				`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "q", "cache": {"direct": true}, "file": {"driver": "file", "filename": "` + img + `", "aio": "native"}}}`,
				`{"execute": "nbd-server-start", "arguments": {"addr": {"type": "unix", "data": {"path": "` + sock + `"}}}}`,
				`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "e", "node-name": "q"}}`,
			} {
				if r := c.call(cmd); r["return"] == nil {
					t.Fatalf("%s: %v", cmd, r)
				}
			}
			out := harness.Run(t, "qemu-io", "-r", "-f", "raw", "-c", "read -P 0x5a 1M 64k", "-c", "read -P 0 0 1M", harness.NBDURI("q", sock))
			if strings.Contains(out, "Pattern verification failed") {
				t.Errorf("read back through the O_DIRECT node: %s", out)
			}
			c.call(`{"execute": "quit"}`)
		})
	}
}

// openFlags returns the flags of process pid's descriptor of path (the
// first one found), from /proc/PID/fdinfo.
func openFlags(t *testing.T, pid int, path string) int64 {
	t.Helper()
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, fd := range fds {
		if target, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name())); target != path {
			continue
		}
		info, err := os.ReadFile(fmt.Sprintf("/proc/%d/fdinfo/%s", pid, fd.Name()))
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(info), "\n") {
			if v, ok := strings.CutPrefix(line, "flags:"); ok {
				flags, err := strconv.ParseInt(strings.TrimSpace(v), 8, 64)
				if err != nil {
					t.Fatal(err)
				}
				return flags
			}
		}
	}
	t.Fatalf("process %d has no descriptor of %s", pid, path)
	return 0
}
