package nbd

import (
	"context"
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/blockexport/blockexport/formats/drivers/null"
	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
)

// floodOptions connects to sock and sends LIST options in a loop without
// ever reading a reply, until its writes fail (the server hung up) or 30
// s pass. It returns a channel closed when it has stopped.
func floodOptions(t *testing.T, sock string) <-chan struct{} {
	t.Helper()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.SetWriteDeadline(time.Now().Add(30 * time.Second))
		if _, err := c.Write(be.AppendUint32(nil, wire.ClientFixed|wire.ClientNoZeroes)); err != nil {
			return
		}
		var opts []byte
		for range 64 {
			opts = be.AppendUint64(opts, wire.MagicOption)
			opts = be.AppendUint32(opts, wire.OptList)
			opts = be.AppendUint32(opts, 0)
		}
		for {
			if _, err := c.Write(opts); err != nil {
				return
			}
		}
	}()
	return done
}

// TestShutdownDropsAFloodingClient: a client in the handshake that floods
// options and never reads blocks our option reply in write. Shutdown once
// only shut down the read side of its socket, which does not wake a
// writer, and waited for it until its context ran out; a client still
// negotiating has nothing to be answered, so it is hung up on.
func TestShutdownDropsAFloodingClient(t *testing.T) {
	img, _ := null.New("null", 1<<20, true)
	s := New(img, Options{Name: "disk"})
	sock := filepath.Join(t.TempDir(), "s")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(l) }()
	flood := floodOptions(t, sock)
	// Until the socket is full and our reply blocks.
	deadline := time.Now().Add(10 * time.Second)
	for {
		s.mu.Lock()
		n := len(s.conns)
		s.mu.Unlock()
		if n == 1 || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond)
	l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown with a flooding client in the handshake: %v", err)
	}
	if err := <-served; err != nil {
		t.Fatal(err)
	}
	select {
	case <-flood:
	case <-time.After(5 * time.Second):
		t.Fatal("the flooding client's writes still go through after Shutdown")
	}
}
