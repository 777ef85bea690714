// Package qsd tests `blockexport daemon` as a drop-in for
// qemu-storage-daemon: its command line, QMP driven by a Go QMP client
// (DigitalOcean's go-qemu) and by raw sockets, the same script run
// against both binaries, and clients that misbehave.
package qsd

import (
	"bufio"
	"context"
	"encoding/json"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/digitalocean/go-qemu/qmp"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }

// daemon is one running daemon process (ours or qemu-storage-daemon)
// with its QMP socket.
type daemon struct {
	cmd    *exec.Cmd
	sock   string
	log    *strings.Builder
	exited chan struct{}
	err    error
}

// startDaemon runs prog ARGS... with a QMP monitor on a unix socket and
// returns once the socket answers. The process is killed, and every
// mountpoint in mounts unmounted, in t.Cleanup.
func startDaemon(t *testing.T, prog string, mounts []string, args ...string) *daemon {
	t.Helper()
	d := &daemon{sock: filepath.Join(t.TempDir(), "qmp.sock"), log: &strings.Builder{}, exited: make(chan struct{})}
	argv := append([]string{"--chardev", "socket,id=mon,path=" + d.sock + ",server=on,wait=off", "--monitor", "chardev=mon"}, args...)
	if prog == harness.Bin {
		argv = append([]string{"daemon"}, argv...)
	}
	d.cmd = exec.Command(prog, argv...)
	d.cmd.Stdout, d.cmd.Stderr = d.log, d.log
	if err := d.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", prog, err)
	}
	go func() { d.err = d.cmd.Wait(); close(d.exited) }()
	t.Cleanup(func() {
		d.cmd.Process.Kill()
		<-d.exited
		for _, m := range mounts {
			if harness.IsFuseMount(m) {
				syscall.Unmount(m, syscall.MNT_DETACH)
			}
		}
	})
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if c, err := net.Dial("unix", d.sock); err == nil {
			c.Close()
			return d
		}
		select {
		case <-d.exited:
			t.Fatalf("%s exited before its monitor came up: %v\n%s", prog, d.err, d.log)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: no monitor at %s in time\n%s", prog, d.sock, d.log)
		}
	}
}

// wait waits for the process to exit and returns its status.
func (d *daemon) wait(t *testing.T) int {
	t.Helper()
	select {
	case <-d.exited:
	case <-time.After(15 * time.Second):
		t.Fatalf("the daemon did not exit\n%s", d.log)
	}
	if d.err == nil {
		return 0
	}
	if ee, ok := d.err.(*exec.ExitError); ok {
		return ee.ExitCode()
	}
	return -1
}

type qmpEvent = qmp.Event

// monitor connects go-qemu's client to d, past capabilities negotiation,
// and returns it with its events. They are taken off go-qemu's channel
// at once: its reader blocks on an event nobody takes, and with it the
// reply of the command that caused it.
func (d *daemon) monitor(t *testing.T) (*qmp.SocketMonitor, <-chan qmpEvent) {
	t.Helper()
	m, err := qmp.NewSocketMonitor("unix", d.sock, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Connect(); err != nil {
		t.Fatalf("QMP handshake: %v", err)
	}
	t.Cleanup(func() { m.Disconnect() })
	in, _ := m.Events(context.Background())
	out := make(chan qmpEvent, 256)
	go func() {
		for e := range in {
			out <- e
		}
	}()
	return m, out
}

// run runs a command through go-qemu and returns its "return" value.
func run(t *testing.T, m *qmp.SocketMonitor, execute string, args any) any {
	t.Helper()
	out, err := runErr(m, execute, args)
	if err != nil {
		t.Fatalf("%s %v: %v", execute, args, err)
	}
	return out
}

func runErr(m *qmp.SocketMonitor, execute string, args any) (any, error) {
	cmd, _ := json.Marshal(qmp.Command{Execute: execute, Args: args})
	raw, err := m.Run(cmd)
	if err != nil {
		return nil, err
	}
	var r struct{ Return any }
	if err := json.Unmarshal(raw, &r); err != nil {
		return nil, err
	}
	return r.Return, nil
}

// rawClient speaks QMP over a bare socket, for what a well-behaved
// library never sends and for the error classes go-qemu drops.
type rawClient struct {
	t *testing.T
	c net.Conn
	r *bufio.Reader
}

func dialRaw(t *testing.T, sock string, negotiate bool) *rawClient {
	t.Helper()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	rc := &rawClient{t: t, c: c, r: bufio.NewReaderSize(c, 1<<20)}
	if g := rc.read(); g["QMP"] == nil {
		t.Fatalf("greeting: %v", g)
	}
	if negotiate {
		if r := rc.call(`{"execute":"qmp_capabilities"}`); r["return"] == nil {
			t.Fatalf("qmp_capabilities: %v", r)
		}
	}
	return rc
}

// read returns the next message, events included.
func (rc *rawClient) read() map[string]any {
	rc.t.Helper()
	rc.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	line, err := rc.r.ReadBytes('\n')
	if err != nil {
		rc.t.Fatalf("reading a QMP message: %v (got %q)", err, line)
	}
	var m map[string]any
	if err := json.Unmarshal(line, &m); err != nil {
		rc.t.Fatalf("QMP message %q: %v", line, err)
	}
	return m
}

// call sends text and returns the reply, skipping events.
func (rc *rawClient) call(text string) map[string]any {
	rc.t.Helper()
	if _, err := rc.c.Write([]byte(text + "\n")); err != nil {
		rc.t.Fatal(err)
	}
	for {
		if m := rc.read(); m["event"] == nil {
			return m
		}
	}
}

// wantError checks a reply is an error of class with desc (desc ""
// checks the class only).
func wantError(t *testing.T, what string, reply map[string]any, class, desc string) {
	t.Helper()
	e, _ := reply["error"].(map[string]any)
	if e == nil || e["class"] != class || (desc != "" && e["desc"] != desc) {
		t.Fatalf("%s: got %v, want error %s %q", what, reply, class, desc)
	}
}

// qcow2Image makes a qcow2 image of size in dir.
func qcow2Image(t *testing.T, dir, name, size string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", p, size)
	return p
}

// mountFile makes the regular file QEMU 7.2 mounts a FUSE export on.
func mountFile(t *testing.T, dir, name string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}
