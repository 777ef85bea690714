package nbd

import (
	"context"
	"errors"
	"io"
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/blockexport/blockexport/formats/drivers/null"
)

// TestWaitAtMaxClientsLeavesTheNextClientUnanswered: with
// WaitAtMaxClients, a client past MaxClients is connected (the listen
// backlog holds it) but neither greeted nor closed until a slot frees,
// then greeted; Shutdown ends a Serve that waits for a slot.
func TestWaitAtMaxClientsLeavesTheNextClientUnanswered(t *testing.T) {
	img, _ := null.New("null", 1<<20, true)
	s := New(img, Options{MaxClients: 1, WaitAtMaxClients: true})
	l, err := net.Listen("unix", filepath.Join(t.TempDir(), "nbd.sock"))
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(l) }()
	t.Cleanup(func() { l.Close(); s.Shutdown(context.Background()) })
	dial := func() net.Conn {
		c, err := net.Dial("unix", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	greeted := func(c net.Conn, wait time.Duration) error {
		c.SetReadDeadline(time.Now().Add(wait))
		var magic [8]byte
		if _, err := io.ReadFull(c, magic[:]); err != nil {
			return err
		}
		if string(magic[:]) != "NBDMAGIC" {
			t.Fatalf("greeting %q", magic)
		}
		return nil
	}
	first := dial()
	if err := greeted(first, 5*time.Second); err != nil {
		t.Fatalf("the first client: %v", err)
	}
	second := dial()
	var ne net.Error
	if err := greeted(second, 300*time.Millisecond); !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("the client past MaxClients: %v, want no answer at all", err)
	}
	first.Close()
	if err := greeted(second, 5*time.Second); err != nil {
		t.Fatalf("the waiting client once the first left: %v", err)
	}
	dial() // waits for a slot, as Serve does
	l.Close()
	if err := s.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-served:
		if err != nil {
			t.Fatalf("Serve: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Serve did not return after Shutdown while it waited for a slot")
	}
}
