package nbd

import (
	"encoding/binary"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestNBDHandshakeFloodFreesItsClientSlot: a client that sends options in a loop
// and never reads its replies fills the socket; the server's option reply
// then blocks in write. The handshake limit once shut down only the read
// side, so the blocked writer never returned and the client kept its
// --max-clients slot for ever. Now the limit ends both directions: the
// slot is free again, and a second client is served, within a bound.
func TestNBDHandshakeFloodFreesItsClientSlot(t *testing.T) {
	s := harness.StartNBD(t, "null:1M", false, "--max-clients", "1", "--handshake-limit", "1")
	// StartNBD's own probe connection may hold the slot for a moment.
	time.Sleep(100 * time.Millisecond)
	c, err := net.Dial("unix", s.Socket())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	be := binary.BigEndian
	flood := make(chan struct{})
	go func() {
		defer close(flood)
		// Bounded: the writes stop once the server has hung up, or
		// after 30 s at most.
		c.SetWriteDeadline(time.Now().Add(30 * time.Second))
		if _, err := c.Write(be.AppendUint32(nil, 3)); err != nil { // fixed newstyle, no zeroes
			return
		}
		var opt []byte
		for range 64 {
			opt = be.AppendUint64(opt, 0x49484156454F5054) // IHAVEOPT
			opt = be.AppendUint32(opt, 3)                  // NBD_OPT_LIST: two replies each
			opt = be.AppendUint32(opt, 0)
		}
		for {
			if _, err := c.Write(opt); err != nil {
				return
			}
		}
	}()
	start := time.Now()
	for {
		out, err := exec.Command("nbdinfo", "--size", s.URI).CombinedOutput()
		if err == nil && strings.TrimSpace(string(out)) == "1048576" {
			break
		}
		if time.Since(start) > 8*time.Second {
			t.Fatalf("no client served %v after a flooding client took the only slot (--handshake-limit 1): %s\n%s", time.Since(start), out, s.Log())
		}
		time.Sleep(100 * time.Millisecond)
	}
	select {
	case <-flood:
	case <-time.After(5 * time.Second):
		t.Fatal("the flooding client's writes still go through: the server did not hang up on it")
	}
	if !strings.Contains(s.Log(), "did not finish the handshake") {
		t.Fatalf("no log line about the dropped client:\n%s", s.Log())
	}
}

// TestNBDSecondSigtermExitsAndRemovesSocketAndPidfile: a client that sends reads and never reads
// the replies holds the server's stop (its replies block in write) until
// the stop's minute runs out; a second SIGTERM then exits at once, status
// 1, and still removes the socket and the pidfile (it left both).
func TestNBDSecondSigtermExitsAndRemovesSocketAndPidfile(t *testing.T) {
	pidfile := filepath.Join(t.TempDir(), "pid")
	s := harness.StartNBD(t, "null:1G", false, "--pidfile", pidfile)
	c := rawNBDClient(t, s.Socket())
	t.Cleanup(func() { c.Close() })
	be := binary.BigEndian
	var reads []byte
	for i := range 64 {
		reads = be.AppendUint32(reads, 0x25609513)
		reads = be.AppendUint16(reads, 0)
		reads = be.AppendUint16(reads, 0) // READ
		reads = be.AppendUint64(reads, uint64(i))
		reads = be.AppendUint64(reads, uint64(i)<<20)
		reads = be.AppendUint32(reads, 1<<20)
	}
	if _, err := c.Write(reads); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond) // the replies fill the socket
	s.Cmd.Process.Signal(syscall.SIGTERM)
	time.Sleep(time.Second)
	select {
	case <-s.Exited:
		t.Fatalf("the stop did not wait for the client; nothing to test\n%s", s.Log())
	default:
	}
	s.Cmd.Process.Signal(syscall.SIGTERM)
	if code := s.Wait(20 * time.Second); code != 1 {
		t.Fatalf("exit %d after a second SIGTERM; want 1\n%s", code, s.Log())
	}
	for _, p := range []string{s.Socket(), pidfile} {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Fatalf("the fast exit left %s behind (%v)\n%s", p, err, s.Log())
		}
	}
}
