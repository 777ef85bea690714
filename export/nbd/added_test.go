package nbd

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/blockexport/blockexport/formats/drivers/null"
	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
)

// TestExportsAddedAndRemovedWhileServing: a server made without an
// image of its own serves what Add gives it, each export as writable as
// it says; Remove in safe mode refuses an export a client chose, hard
// mode cuts that client, and the name is gone for the next one.
func TestExportsAddedAndRemovedWhileServing(t *testing.T) {
	s := New(nil, Options{})
	l, err := net.Listen("unix", filepath.Join(t.TempDir(), "nbd.sock"))
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve(l)
	t.Cleanup(func() { l.Close(); s.Shutdown(context.Background()) })
	img, _ := null.New("null", 1<<20, true)
	if err := s.Add(Export{Name: "rw", Image: img, Writable: true}); err != nil {
		t.Fatal(err)
	}
	if err := s.Add(Export{Name: "ro", Image: img}); err != nil {
		t.Fatal(err)
	}
	if s.Add(Export{Name: "rw", Image: img}) == nil {
		t.Fatal("a second export of one name was taken")
	}
	dial := func() *client {
		c, err := net.Dial("unix", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		c.SetDeadline(time.Now().Add(10 * time.Second))
		cl := &client{t: t, c: c, r: bufio.NewReader(c)}
		cl.greet()
		return cl
	}
	flagsOf := func(name string) (uint16, *client) {
		c := dial()
		types, payloads := c.option(wire.OptGo, goData(name))
		if types[len(types)-1] != wire.RepAck {
			t.Fatalf("GO %q: replies %x", name, types)
		}
		for i, p := range payloads {
			if types[i] == wire.RepInfo && be.Uint16(p) == wire.InfoExport {
				return be.Uint16(p[10:]), c
			}
		}
		t.Fatalf("GO %q: no export information", name)
		return 0, nil
	}
	f, roUser := flagsOf("ro")
	if f&wire.FlagReadOnly == 0 {
		t.Fatalf("export ro: flags %#x, want read-only", f)
	}
	f, user := flagsOf("rw")
	if f&wire.FlagReadOnly != 0 {
		t.Fatalf("export rw: flags %#x, want writable", f)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Remove(ctx, "rw", false); !errors.Is(err, ErrExportInUse) {
		t.Fatalf("safe Remove of an export in use: %v", err)
	}
	if err := s.Remove(ctx, "rw", true); err != nil {
		t.Fatalf("hard Remove: %v", err)
	}
	if _, err := user.r.ReadByte(); !errors.Is(err, io.EOF) {
		t.Fatalf("the client of a removed export reads %v, want EOF", err)
	}
	if types, _ := dial().option(wire.OptGo, goData("rw")); types[0] != wire.RepErrUnknown {
		t.Fatalf("GO of a removed export: %x", types)
	}
	// A client that hung up leaves the export free for a safe Remove at
	// once, before its connection's reader has come to the hang-up.
	roUser.c.Close()
	if err := s.Remove(ctx, "ro", false); err != nil {
		t.Fatalf("safe Remove right after the export's client hung up: %v", err)
	}
}
