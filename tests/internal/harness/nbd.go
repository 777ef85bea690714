package harness

import (
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// StartNBD serves image on a unix socket (tcp=false) or a free loopback
// port, and waits until it accepts connections.
func StartNBD(t *testing.T, image string, tcp bool, args ...string) *NBDServer {
	t.Helper()
	dir := t.TempDir()
	var listen, uri, dial, network string
	if tcp {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		dial = l.Addr().String()
		l.Close()
		network, listen, uri = "tcp", "tcp:"+dial, "nbd://"+dial
	} else {
		sock := filepath.Join(dir, "nbd.sock")
		network, dial, listen, uri = "unix", sock, "unix:"+sock, "nbd+unix:///?socket="+sock
	}
	argv := append([]string{"nbd", "--listen", listen}, args...)
	argv = append(argv, image)
	d := &Daemon{t: t, Exited: make(chan struct{})}
	d.LogFile = filepath.Join(dir, "nbd.log")
	lf, _ := os.Create(d.LogFile)
	d.Cmd = exec.Command(Bin, argv...)
	d.Cmd.Stdout, d.Cmd.Stderr = lf, lf
	if err := d.Cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lf.Close()
	go func() { d.Err = d.Cmd.Wait(); close(d.Exited) }()
	t.Cleanup(d.cleanup)
	for i := 0; ; i++ {
		if c, err := net.Dial(network, dial); err == nil {
			c.Close()
			break
		}
		select {
		case <-d.Exited:
			t.Fatalf("nbd server exited: %v\n%s", d.Err, d.Log())
		default:
		}
		if i > 500 {
			t.Fatalf("nbd server did not listen\n%s", d.Log())
		}
		time.Sleep(10 * time.Millisecond)
	}
	return &NBDServer{Daemon: d, URI: uri}
}

// NBDURI names an export on a unix socket.
func NBDURI(export, sock string) string {
	return "nbd+unix:///" + export + "?socket=" + sock
}

// StartServerProc runs prog and waits until sock takes connections. It is
// killed in t.Cleanup.
func StartServerProc(t *testing.T, sock, prog string, args ...string) *ServerProc {
	t.Helper()
	s := &ServerProc{Sock: sock, LogFile: filepath.Join(t.TempDir(), "server.log"), Done: make(chan struct{})}
	lf, err := os.Create(s.LogFile)
	if err != nil {
		t.Fatal(err)
	}
	s.Cmd = exec.Command(prog, args...)
	s.Cmd.Stdout, s.Cmd.Stderr = lf, lf
	if err := s.Cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lf.Close()
	go func() { s.Cmd.Wait(); close(s.Done) }()
	t.Cleanup(func() { s.Kill() })
	deadline := time.Now().Add(15 * time.Second)
	for {
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			return s
		}
		select {
		case <-s.Done:
			b, _ := os.ReadFile(s.LogFile)
			t.Fatalf("%s exited before serving\n%s", prog, b)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not serve %s in time", prog, sock)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// NBDServer is a running `blockexport nbd`.
type NBDServer struct {
	*Daemon
	URI string // for qemu-img / qemu-io / nbdinfo / nbdcopy
}

// ServerProc is a server process serving on a unix socket.
type ServerProc struct {
	Cmd     *exec.Cmd
	Sock    string
	LogFile string
	Done    chan struct{}
}

// Socket is the unix socket path of a server StartNBD started with tcp false.
func (s *NBDServer) Socket() string { return strings.TrimPrefix(s.URI, "nbd+unix:///?socket=") }

// Kill ends the server at once (SIGKILL), as a crash would.
func (s *ServerProc) Kill() {
	select {
	case <-s.Done:
	default:
		s.Cmd.Process.Kill()
		<-s.Done
	}
	os.Remove(s.Sock)
}
