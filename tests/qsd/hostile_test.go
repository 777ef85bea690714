package qsd

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestMalformedInputAnsweredAsQSDAnswersIt sends what a broken client
// sends (bad JSON, non-objects, wrong members, wrong argument types,
// unknown commands, commands before negotiation) to QSD and to our
// daemon; both must give QSD 7.2's reply, as recorded here.
func TestMalformedInputAnsweredAsQSDAnswersIt(t *testing.T) {
	cases := []struct{ send, class, desc string }{
		{`{"execute": "query-version", "id": 1}`, "CommandNotFound", "Expecting capabilities negotiation with 'qmp_capabilities'"},
		{`{"execute": "qmp_capabilities"}`, "", ""},
		{`{"execute": "qmp_capabilities"}`, "CommandNotFound", "Capabilities negotiation is already complete, command ignored"},
		{`[1, 2]`, "GenericError", "QMP input must be a JSON object"},
		{`"a string"`, "GenericError", "QMP input must be a JSON object"},
		{`{"execute": 3}`, "GenericError", "QMP input member 'execute' must be a string"},
		{`{"exec": "query-version"}`, "GenericError", "QMP input member 'exec' is unexpected"},
		{`{"execute": "query-version", "arguments": [1]}`, "GenericError", "QMP input member 'arguments' must be an object"},
		{`{"execute": "query-version", bad}`, "GenericError", "JSON parse error, invalid keyword 'bad'"},
		{`}`, "GenericError", "JSON parse error, expecting value"},
		{`{"execute": "query-version", "arguments": {"a": 1}}`, "GenericError", "Parameter 'a' is unexpected"},
		{`{"execute": "blockdev-del", "arguments": {}}`, "GenericError", "Parameter 'node-name' is missing"},
		{`{"execute": "blockdev-del", "arguments": {"node-name": 5}}`, "GenericError", "Invalid parameter type for 'node-name', expected: string"},
		{`{"execute": "blockdev-add", "arguments": {"driver": "null-co", "node-name": "n", "size": "big"}}`, "GenericError", "Invalid parameter type for 'size', expected: integer"},
		{`{"execute": "blockdev-add", "arguments": {"driver": "bogus", "node-name": "n"}}`, "GenericError", "Parameter 'driver' does not accept value 'bogus'"},
		{`{"execute": "blockdev-add", "arguments": {"driver": "null-co", "node-name": "n", "bogus": 1}}`, "GenericError", "Parameter 'bogus' is unexpected"},
		{`{"execute": "block-export-del", "arguments": {"id": "e", "mode": "gentle"}}`, "GenericError", "Parameter 'mode' does not accept value 'gentle'"},
		{`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "e", "node-name": "n", "unknown": 1}}`, "GenericError", "Parameter 'unknown' is unexpected"},
		{`{"execute": "no-such-command", "id": "x"}`, "CommandNotFound", "The command no-such-command has not been found"},
		{`{"execute": "query-version", "id": {"a": [1]}, "foo": 1}`, "GenericError", "QMP input member 'foo' is unexpected"},
	}
	for _, prog := range []string{"qemu-storage-daemon", harness.Bin} {
		t.Run(filepath.Base(prog), func(t *testing.T) {
			d := startDaemon(t, prog, nil)
			c := dialRaw(t, d.sock, false)
			for _, tc := range cases {
				r := c.call(tc.send)
				if tc.class == "" {
					if r["return"] == nil {
						t.Fatalf("%s: %v, want a return", tc.send, r)
					}
					continue
				}
				wantError(t, tc.send, r, tc.class, tc.desc)
			}
			// The id of a refused command still comes back.
			if r := c.call(`{"execute": "no-such-command", "id": [7]}`); fmt.Sprint(r["id"]) != "[7]" {
				t.Fatalf("id not echoed: %v", r)
			}
			// exec-oob is unexpected until oob is enabled; then no
			// command of either runs out of band.
			wantError(t, "exec-oob", c.call(`{"exec-oob": "query-version", "id": 1}`), "GenericError", "QMP input member 'exec-oob' is unexpected")
			c.c.Close() // a QEMU socket chardev serves one client at a time
			oob := dialRaw(t, d.sock, false)
			if r := oob.call(`{"execute": "qmp_capabilities", "arguments": {"enable": ["oob"]}}`); r["return"] == nil {
				t.Fatalf("qmp_capabilities with oob: %v", r)
			}
			wantError(t, "exec-oob of a command", oob.call(`{"exec-oob": "query-version"}`), "GenericError", "The command query-version does not support OOB")
			wantError(t, "exec-oob of no command", oob.call(`{"exec-oob": "migrate-recover"}`), "CommandNotFound", "The command migrate-recover has not been found")
			// A command split over lines is one command.
			if r := oob.call("{\"execute\":\n \"query-version\"\n}"); r["return"] == nil {
				t.Fatalf("a command over three lines: %v", r)
			}
		})
	}
}

// TestOversizedMessageIsRefusedAndTheMonitorGoesOn: a message past the
// limit is answered with QEMU's error and dropped whole; the monitor
// then serves the next command.
func TestOversizedMessageIsRefusedAndTheMonitorGoesOn(t *testing.T) {
	d := startDaemon(t, harness.Bin, nil)
	c := dialRaw(t, d.sock, true)
	huge := `{"execute": "blockdev-add", "arguments": {"driver": "null-co", "node-name": "big", "x": "` + strings.Repeat("a", 9<<20) + `"}}`
	wantError(t, "a 9 MiB message", c.call(huge), "GenericError", "JSON token size limit exceeded")
	deep := strings.Repeat("[", 2000) + strings.Repeat("]", 2000)
	wantError(t, "2000 nested arrays", c.call(deep), "GenericError", "JSON nesting depth limit exceeded")
	if r := c.call(`{"execute": "query-named-block-nodes"}`); fmt.Sprint(r["return"]) != "[]" {
		t.Fatalf("after the oversized message: %v", r)
	}
}

// TestClientHangingUpMidCommandLeavesNothing: a client that goes away
// in the middle of a command's text has run nothing; one that goes away
// before reading its reply has run the whole command. The daemon serves
// the next client either way.
func TestClientHangingUpMidCommandLeavesNothing(t *testing.T) {
	d := startDaemon(t, harness.Bin, nil)
	half := dialRaw(t, d.sock, true)
	half.c.Write([]byte(`{"execute": "blockdev-add", "arguments": {"driver": "null-co", "node-name": "half"`))
	half.c.Close()
	whole := dialRaw(t, d.sock, true)
	whole.c.Write([]byte(`{"execute": "blockdev-add", "arguments": {"driver": "null-co", "node-name": "whole"}}` + "\n"))
	whole.c.Close()
	c := dialRaw(t, d.sock, true)
	deadline := time.Now().Add(5 * time.Second)
	for {
		nodes := fmt.Sprint(c.call(`{"execute": "query-named-block-nodes"}`)["return"])
		if strings.Contains(nodes, "half") {
			t.Fatalf("a node from a command that never ended: %s", nodes)
		}
		if strings.Contains(nodes, "node-name:whole") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the command sent whole before hanging up did not run: %s", nodes)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestTwoClientsAtOnce: two monitors add nodes at the same time; each
// command runs whole, both see every node, and an event reaches both.
func TestTwoClientsAtOnce(t *testing.T) {
	d := startDaemon(t, harness.Bin, nil)
	clients := []*rawClient{dialRaw(t, d.sock, true), dialRaw(t, d.sock, true)}
	var wg sync.WaitGroup
	errs := make(chan string, 40)
	for i, c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range 20 {
				cmd := fmt.Sprintf(`{"execute": "blockdev-add", "arguments": {"driver": "null-co", "node-name": "c%d-n%d"}}`, i, j)
				c.c.Write([]byte(cmd + "\n"))
				if line, err := c.r.ReadString('\n'); err != nil || !strings.Contains(line, `"return"`) {
					errs <- fmt.Sprintf("client %d: %q %v", i, line, err)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Fatal(e)
	}
	for i, c := range clients {
		if n := len(c.call(`{"execute": "query-named-block-nodes"}`)["return"].([]any)); n != 40 {
			t.Fatalf("client %d sees %d nodes, want 40", i, n)
		}
	}
	nbdSock := filepath.Join(t.TempDir(), "nbd.sock")
	clients[0].call(`{"execute": "nbd-server-start", "arguments": {"addr": {"type": "unix", "data": {"path": "` + nbdSock + `"}}}}`)
	clients[0].call(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "e", "node-name": "c1-n3"}}`)
	if r := clients[0].call(`{"execute": "block-export-del", "arguments": {"id": "e"}}`); r["return"] == nil {
		t.Fatalf("block-export-del: %v", r)
	}
	if e := clients[1].read(); e["event"] != "BLOCK_EXPORT_DELETED" {
		t.Fatalf("the other client got %v, want the deletion event", e)
	}
}

// TestFailedAddsLeaveNothingBehind: each add that fails part way (an
// inline child made before its parent failed, an export refused after
// its node was found) leaves no node, no export and no node in use.
func TestFailedAddsLeaveNothingBehind(t *testing.T) {
	dir := t.TempDir()
	notQcow2 := filepath.Join(dir, "text")
	if err := os.WriteFile(notQcow2, []byte("not an image"), 0o600); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, harness.Bin, nil)
	c := dialRaw(t, d.sock, true)
	for _, tc := range []struct{ cmd, desc string }{
		{`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "q", "file": {"driver": "file", "filename": "` + notQcow2 + `"}}}`,
			"Image is not in qcow2 format"},
		{`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "q", "file": {"driver": "file", "filename": "` + dir + `/missing"}}}`,
			"Could not open '" + dir + "/missing': No such file or directory"},
		{`{"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "q", "file": {"driver": "file", "filename": 7}}}`,
			"Invalid parameter type for 'file.filename', expected: string"},
	} {
		wantError(t, tc.cmd, c.call(tc.cmd), "GenericError", tc.desc)
	}
	if r := c.call(`{"execute": "query-named-block-nodes"}`); fmt.Sprint(r["return"]) != "[]" {
		t.Fatalf("nodes left by failed adds: %v", r)
	}
	c.call(`{"execute": "blockdev-add", "arguments": {"driver": "null-co", "node-name": "n"}}`)
	wantError(t, "an export onto a missing mountpoint", c.call(`{"execute": "block-export-add", "arguments": {"type": "fuse", "id": "e", "node-name": "n", "mountpoint": "`+dir+`/missing"}}`),
		"GenericError", "Failed to stat '"+dir+"/missing': No such file or directory")
	wantError(t, "an export onto a directory", c.call(`{"execute": "block-export-add", "arguments": {"type": "fuse", "id": "e", "node-name": "n", "mountpoint": "`+dir+`"}}`),
		"GenericError", "'"+dir+"' is not a regular file")
	wantError(t, "an NBD export without a server", c.call(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "e", "node-name": "n"}}`),
		"GenericError", "NBD server not running")
	if r := c.call(`{"execute": "query-block-exports"}`); fmt.Sprint(r["return"]) != "[]" {
		t.Fatalf("exports left by failed adds: %v", r)
	}
	if r := c.call(`{"execute": "blockdev-del", "arguments": {"node-name": "n"}}`); r["return"] == nil {
		t.Fatalf("the node of the refused exports is still held: %v", r)
	}
}

// TestMonitorSocketIsOwnerOnly: whoever reaches the monitor can export
// any file the daemon can open, so only its owner may.
func TestMonitorSocketIsOwnerOnly(t *testing.T) {
	d := startDaemon(t, harness.Bin, nil)
	st, err := os.Stat(d.sock)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode()&os.ModeSocket == 0 || st.Mode().Perm() != 0o600 {
		t.Fatalf("monitor socket mode %v, want a socket 0600", st.Mode())
	}
}

// TestExportDeletionWithAConnectedClient: an NBD export a client is
// connected to is refused by a safe block-export-del and cut by a hard
// one (its event sent, the client's next read failing), the same on QSD
// and on our daemon.
func TestExportDeletionWithAConnectedClient(t *testing.T) {
	for _, prog := range []string{"qemu-storage-daemon", harness.Bin} {
		t.Run(filepath.Base(prog), func(t *testing.T) {
			dir := t.TempDir()
			nbdSock := filepath.Join(dir, "nbd.sock")
			d := startDaemon(t, prog, nil)
			c := dialRaw(t, d.sock, true)
			c.call(`{"execute": "blockdev-add", "arguments": {"driver": "null-co", "node-name": "n", "size": 1048576}}`)
			c.call(`{"execute": "nbd-server-start", "arguments": {"addr": {"type": "unix", "data": {"path": "` + nbdSock + `"}}}}`)
			if r := c.call(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "e", "node-name": "n"}}`); r["return"] == nil {
				t.Fatalf("block-export-add: %v", r)
			}
			client := exec.Command("qemu-io", "-r", "-f", "raw", "nbd+unix:///n?socket="+nbdSock)
			var out safeBuffer
			client.Stdout, client.Stderr = &out, &out
			stdin, _ := client.StdinPipe()
			if err := client.Start(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { stdin.Close(); client.Process.Kill(); client.Wait() })
			stdin.Write([]byte("read 0 4k\n"))
			for deadline := time.Now().Add(10 * time.Second); !strings.Contains(out.String(), "read 4096/4096"); time.Sleep(10 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("qemu-io did not read through the export:\n%s", out.String())
				}
			}
			wantError(t, "a safe block-export-del with a client connected", c.call(`{"execute": "block-export-del", "arguments": {"id": "e"}}`),
				"GenericError", "export 'e' still in use")
			if r := c.call(`{"execute": "block-export-del", "arguments": {"id": "e", "mode": "hard"}}`); r["return"] == nil {
				t.Fatalf("a hard block-export-del: %v", r)
			}
			deadline := time.Now().Add(10 * time.Second)
			for {
				r := c.call(`{"execute": "query-block-exports"}`)
				if fmt.Sprint(r["return"]) == "[]" {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("the export is still listed after a hard delete: %v", r)
				}
				time.Sleep(20 * time.Millisecond)
			}
			stdin.Write([]byte("read 0 4k\n"))
			for deadline := time.Now().Add(10 * time.Second); strings.Count(out.String(), "read 4096/4096") > 1 || !strings.Contains(out.String(), "failed"); time.Sleep(10 * time.Millisecond) {
				if strings.Count(out.String(), "read 4096/4096") > 1 {
					t.Fatalf("the client still reads after a hard delete:\n%s", out.String())
				}
				if time.Now().After(deadline) {
					t.Fatalf("no failed read after a hard delete:\n%s", out.String())
				}
			}
		})
	}
}

// safeBuffer is a bytes.Buffer a process writes while the test reads.
type safeBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *safeBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *safeBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestFUSEExportDeletedWhileHeldOpen: deleting a FUSE export whose file
// a process holds open succeeds at once with its event, and the holder's
// reads then fail with ENOTCONN, on QSD and on our daemon alike.
func TestFUSEExportDeletedWhileHeldOpen(t *testing.T) {
	for _, prog := range []string{"qemu-storage-daemon", harness.Bin} {
		t.Run(filepath.Base(prog), func(t *testing.T) {
			mnt := mountFile(t, t.TempDir(), "export")
			d := startDaemon(t, prog, []string{mnt})
			c := dialRaw(t, d.sock, true)
			c.call(`{"execute": "blockdev-add", "arguments": {"driver": "null-co", "node-name": "n", "size": 1048576, "read-zeroes": true}}`)
			if r := c.call(`{"execute": "block-export-add", "arguments": {"type": "fuse", "id": "e", "node-name": "n", "mountpoint": "` + mnt + `"}}`); r["return"] == nil {
				t.Fatalf("block-export-add: %v", r)
			}
			f, err := os.Open(mnt)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			buf := make([]byte, 4096)
			if n, err := f.ReadAt(buf, 0); n != 4096 || err != nil {
				t.Fatalf("read through the export: %d, %v", n, err)
			}
			if _, err := c.c.Write([]byte(`{"execute": "block-export-del", "arguments": {"id": "e"}}` + "\n")); err != nil {
				t.Fatal(err)
			}
			if e := c.read(); e["event"] != "BLOCK_EXPORT_DELETED" {
				t.Fatalf("got %v, want the deletion event first", e)
			}
			if r := c.read(); r["return"] == nil {
				t.Fatalf("block-export-del: %v", r)
			}
			// QSD replies before its unmount has finished: the held
			// file's reads fail soon after, not necessarily at once.
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				_, err := f.ReadAt(buf, 0)
				if harness.ErrnoOf(err) == syscall.ENOTCONN {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("a read of the held file after the delete: %v, want ENOTCONN", err)
				}
			}
		})
	}
}
