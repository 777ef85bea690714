package qsd

import (
	"bufio"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestCommandLineSetsUpNodesAndExports gives nodes, the NBD server and
// exports on the command line as a QSD user does: dotted keyval (with
// ",," for a comma in a file name) and JSON --blockdev, an implied
// export type, a pidfile; then serves through both exports and stops on
// SIGTERM, leaving no mount and no pidfile.
func TestCommandLineSetsUpNodesAndExports(t *testing.T) {
	dir := t.TempDir()
	img := qcow2Image(t, dir, "disk,1.qcow2", "8M")
	other := qcow2Image(t, dir, "other.qcow2", "4M")
	mnt := mountFile(t, dir, "disk.raw")
	nbdSock := filepath.Join(dir, "nbd.sock")
	pidfile := filepath.Join(dir, "daemon.pid")
	d := startDaemon(t, harness.Bin, []string{mnt},
		"--blockdev", "driver=file,node-name=disk-file,filename="+strings.ReplaceAll(img, ",", ",,"),
		"--blockdev", `{"driver": "qcow2", "node-name": "disk", "file": "disk-file"}`,
		"--blockdev", "driver=qcow2,node-name=other,read-only=on,file.driver=file,file.filename="+other,
		"--nbd-server", "addr.type=unix,addr.path="+nbdSock,
		"--export", "type=nbd,id=disk-nbd,node-name=disk,name=disk,writable=on",
		"--export", "fuse,id=disk-fuse,node-name=disk,mountpoint="+mnt,
		"--pidfile", pidfile)
	pid, err := os.ReadFile(pidfile)
	if err != nil || strings.TrimSpace(string(pid)) != strconv.Itoa(d.cmd.Process.Pid) {
		t.Fatalf("pidfile: %q, %v; want %d", pid, err, d.cmd.Process.Pid)
	}
	c := dialRaw(t, d.sock, true)
	var exports []map[string]any
	raw, _ := json.Marshal(c.call(`{"execute": "query-block-exports"}`)["return"])
	json.Unmarshal(raw, &exports)
	if len(exports) != 2 || exports[0]["id"] != "disk-fuse" || exports[1]["node-name"] != "disk" {
		t.Fatalf("query-block-exports: %v", exports)
	}
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x77 0 64k", "nbd+unix:///disk?socket="+nbdSock)
	got := harness.ReadAll(t, mnt)
	if len(got) != 8<<20 || got[0] != 0x77 || got[64<<10-1] != 0x77 || got[64<<10] != 0 {
		t.Fatalf("the FUSE export: %d bytes, %x %x %x", len(got), got[0], got[64<<10-1], got[64<<10])
	}
	if err := os.WriteFile(mnt, []byte("x"), 0); err == nil {
		t.Fatal("a write to an export without writable=on succeeded")
	}
	nodes := string(mustJSON(c.call(`{"execute": "query-named-block-nodes"}`)["return"]))
	if !strings.Contains(nodes, `"node-name":"other","ro":true`) {
		t.Fatalf("the read-only node given in dotted keys: %s", nodes)
	}
	d.cmd.Process.Signal(syscall.SIGTERM)
	if code := d.wait(t); code != 0 {
		t.Fatalf("exit %d after SIGTERM\n%s", code, d.log)
	}
	if harness.IsFuseMount(mnt) {
		t.Fatal("still mounted after SIGTERM")
	}
	if _, err := os.Stat(pidfile); !os.IsNotExist(err) {
		t.Fatalf("pidfile left behind: %v", err)
	}
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "read -P 0x77 0 64k", img)
}

// TestCommandLineMistakesFailAtStart: a bad option ends the daemon at
// once with a message, as QSD does, and one QSD has and we do not is
// refused by name.
func TestCommandLineMistakesFailAtStart(t *testing.T) {
	for _, tc := range []struct {
		args []string
		code int
		msg  string
	}{
		{[]string{"--blockdev", "driver=bogus,node-name=x"}, 1, "Parameter 'driver' does not accept value 'bogus'"},
		{[]string{"--blockdev", "driver=null-co,node-name=x,size=big"}, 1, "Parameter 'size' expects integer"},
		{[]string{"--blockdev", "driver=null-co,node-name"}, 1, "Expected '=' after parameter 'node-name'"},
		{[]string{"--export", "nbd,id=e,node-name=x"}, 1, "Cannot find device='' nor node-name='x'"},
		{[]string{"--object", "secret,id=s,data=x"}, 1, "Parameter 'qom-type' does not accept value 'secret'"},
		{[]string{"--object", "tls-creds-x509,id=t,dir=/nonexistent,endpoint=server"}, 1, "Unable to access credentials /nonexistent/ca-cert.pem: No such file or directory"},
		{[]string{"--nbd-server", "addr.type=unix,addr.path=/nonexistent/s,tls-creds=none"}, 1, "No TLS credentials with id 'none'"},
		{[]string{"--trace", "events=x"}, 2, "--trace is not supported"},
		{[]string{"--monitor", "chardev=nope"}, 1, `chardev "nope" not found`},
	} {
		cmd := exec.Command(harness.Bin, append([]string{"daemon"}, tc.args...)...)
		out, err := cmd.CombinedOutput()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		}
		if code != tc.code || !strings.Contains(string(out), tc.msg) {
			t.Errorf("daemon %v: exit %d, %q; want exit %d and %q", tc.args, code, out, tc.code, tc.msg)
		}
	}
}

// TestDaemonizeReturnsOnceServing: with --daemonize the command returns
// 0 once the monitor and the nodes are up, and the pidfile names the
// process left serving.
func TestDaemonizeReturnsOnceServing(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "qmp.sock")
	pidfile := filepath.Join(dir, "daemon.pid")
	out, err := exec.Command(harness.Bin, "daemon", "--daemonize", "--pidfile", pidfile,
		"--chardev", "socket,id=m,path="+sock+",server=on,wait=off", "--monitor", "m",
		"--blockdev", "driver=null-co,node-name=n").CombinedOutput()
	pidText, _ := os.ReadFile(pidfile)
	pid, _ := strconv.Atoi(strings.TrimSpace(string(pidText)))
	if pid > 0 {
		t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
	}
	if err != nil || pid <= 0 {
		t.Fatalf("daemon --daemonize: %v, pidfile %q\n%s", err, pidText, out)
	}
	c := dialRaw(t, sock, true)
	if r := c.call(`{"execute": "query-named-block-nodes"}`); !strings.Contains(string(mustJSON(r)), `"node-name":"n"`) {
		t.Fatalf("the daemonized process has not the node: %v", r)
	}
	c.call(`{"execute": "quit"}`)
	for deadline := time.Now().Add(10 * time.Second); syscall.Kill(pid, 0) == nil; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the daemonized process did not exit after quit")
		}
	}
}

// TestStdioMonitor: --chardev stdio with --monitor, as iotests drive QSD:
// the greeting on stdout, commands on stdin.
func TestStdioMonitor(t *testing.T) {
	cmd := exec.Command(harness.Bin, "daemon", "--chardev", "stdio,id=s", "--monitor", "chardev=s")
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	r := bufio.NewReader(stdout)
	line := func() string {
		s, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("stdout: %v", err)
		}
		return s
	}
	if g := line(); !strings.HasPrefix(g, `{"QMP": {"version": {"qemu": {"micro": `) || !strings.Contains(g, `"capabilities": ["oob"]`) {
		t.Fatalf("greeting %q", g)
	}
	stdin.Write([]byte(`{"execute": "qmp_capabilities"}` + "\n" + `{"execute": "blockdev-add", "arguments": {"driver": "null-co", "node-name": "n"}, "id": 1}` + "\n"))
	if got := line() + line(); got != "{\"return\": {}}\r\n{\"return\": {}, \"id\": 1}\r\n" {
		t.Fatalf("replies %q", got)
	}
	stdin.Write([]byte(`{"execute": "quit"}` + "\n"))
	line()
	if err := cmd.Wait(); err != nil {
		t.Fatalf("exit after quit: %v", err)
	}
}

func mustJSON(v any) []byte {
	b, _ := json.Marshal(v)
	return b
}
