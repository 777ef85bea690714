package nbd

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// rawNBDClient connects and negotiates the default export with
// NBD_OPT_EXPORT_NAME, leaving the connection ready for requests.
func rawNBDClient(t *testing.T, sock string) net.Conn {
	t.Helper()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := io.ReadFull(c, make([]byte, 18)); err != nil {
		t.Fatalf("greeting: %v", err)
	}
	be := binary.BigEndian
	msg := be.AppendUint32(nil, 3)                 // fixed newstyle, no zeroes
	msg = be.AppendUint64(msg, 0x49484156454F5054) // IHAVEOPT
	msg = be.AppendUint32(msg, 1)                  // NBD_OPT_EXPORT_NAME
	msg = be.AppendUint32(msg, 0)                  // ""
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 10)); err != nil { // size, flags
		t.Fatalf("export name reply: %v", err)
	}
	return c
}

func vmHWM(t *testing.T, pid int) int64 {
	t.Helper()
	return harness.ProcField(t, pid, "status", "VmHWM:") << 10
}

// TestNBDMemoryIsBoundedUnderAbuse: six clients each send a burst of 1000
// READs of 32 MiB (28 KB on the wire) and hang up. Every request once got
// a goroutine and its buffer at once (7.3 GiB for one client, past 13 GiB
// for six; qemu-nbd stays near 212 MiB). Now the bytes in flight are
// bounded per connection and per server, and the server serves on.
func TestNBDMemoryIsBoundedUnderAbuse(t *testing.T) {
	s := harness.StartNBD(t, "null:64G", false)
	var wg sync.WaitGroup
	for range 6 {
		c := rawNBDClient(t, s.Socket())
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer c.Close()
			go io.Copy(io.Discard, c)
			be := binary.BigEndian
			burst := make([]byte, 0, 1000*28)
			for i := range 1000 {
				h := be.AppendUint32(nil, 0x25609513)
				h = be.AppendUint16(h, 0)
				h = be.AppendUint16(h, 0) // READ
				h = be.AppendUint64(h, uint64(i))
				h = be.AppendUint64(h, uint64(i%2000)<<25)
				h = be.AppendUint32(h, 32<<20)
				burst = append(burst, h...)
			}
			c.Write(burst)
			time.Sleep(200 * time.Millisecond)
		}()
	}
	wg.Wait()
	// The server is still there and serves a new client.
	out, err := exec.Command("nbdinfo", "--size", s.URI).CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != fmt.Sprint(int64(64)<<30) {
		t.Fatalf("nbdinfo after the abuse: %v %s\n%s", err, out, s.Log())
	}
	hwm := vmHWM(t, s.Cmd.Process.Pid)
	t.Logf("peak RSS under the abuse: %d MiB", hwm>>20)
	if hwm > 768<<20 {
		t.Fatalf("the server's peak RSS was %d MiB under the abuse; want it bounded (under 768 MiB)", hwm>>20)
	}
}

// TestNBDHandshakeLimit: clients that never finish the handshake are
// dropped after --handshake-limit, so idle sockets cannot lock real
// clients out of --max-clients.
func TestNBDHandshakeLimit(t *testing.T) {
	// 3 s: a third client started on a loaded machine still comes while
	// the idle ones hold both slots.
	s := harness.StartNBD(t, "null:1M", false, "--max-clients", "2", "--handshake-limit", "3")
	// StartNBD's own probe connection may hold a slot for a moment.
	time.Sleep(100 * time.Millisecond)
	var idle []net.Conn
	for range 2 {
		c, err := net.Dial("unix", s.Socket())
		if err != nil {
			t.Fatal(err)
		}
		idle = append(idle, c)
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.ReadFull(c, make([]byte, 18)); err != nil {
			t.Fatalf("greeting: %v", err)
		}
	}
	start := time.Now()
	if out, err := exec.Command("nbdinfo", "--size", s.URI).CombinedOutput(); err == nil {
		t.Fatalf("a third client was served past --max-clients 2: %s", out)
	}
	// The idle sockets are closed by the server once the limit passes...
	for _, c := range idle {
		if _, err := c.Read(make([]byte, 1)); err == nil {
			t.Fatal("an idle client got data instead of being dropped")
		}
		c.Close()
	}
	if waited := time.Since(start); waited > 8*time.Second {
		t.Fatalf("idle clients dropped after %v; the limit is 3 s", waited)
	}
	// ...and a real client gets in.
	deadline := time.Now().Add(5 * time.Second)
	for {
		out, err := exec.Command("nbdinfo", "--size", s.URI).CombinedOutput()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no client served after the idle ones were dropped: %s\n%s", out, s.Log())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !strings.Contains(s.Log(), "did not finish the handshake") {
		t.Fatalf("no log line about the dropped clients:\n%s", s.Log())
	}
	// A bad value is a usage error.
	if code, out := harness.RunBlockexport(t, "nbd", "--handshake-limit", "-1", "null:1M"); code != 2 || !strings.Contains(out, "--handshake-limit") {
		t.Fatalf("--handshake-limit -1: exit %d %q", code, out)
	}
}
