package engine

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/blockexport/blockexport/formats/registry"
)

// wantDesc checks err is an engine Error of class GenericError with desc.
func wantDesc(t *testing.T, what string, err error, desc string) {
	t.Helper()
	var e *Error
	if !errors.As(err, &e) || e.Class != Generic || e.Desc != desc {
		t.Fatalf("%s: %v, want %q", what, err, desc)
	}
}

// TestNodesAddedAndDeletedAsQEMUDoes: names are checked, a format node
// holds its file child (deleting the child is refused while it does),
// an inline child is named and goes with its parent, and an export's
// node is in use until the export goes.
func TestNodesAddedAndDeletedAsQEMUDoes(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "disk.qcow2")
	if err := registry.Create(img, registry.QCOW2, registry.CreateOptions{Size: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	e := New(Options{Backend: "threads"})
	t.Cleanup(func() { e.Close() })
	wantDesc(t, "no node-name", e.AddNode(BlockdevOptions{Driver: "null-co"}), "'node-name' must be specified for the root node")
	wantDesc(t, "a bad node-name", e.AddNode(BlockdevOptions{Driver: "null-co", NodeName: "1x"}), "Invalid node-name: '1x'")
	wantDesc(t, "a missing file", e.AddNode(BlockdevOptions{Driver: "file", NodeName: "f", Filename: filepath.Join(dir, "none")}),
		"Could not open '"+filepath.Join(dir, "none")+"': No such file or directory")
	if err := e.AddNode(BlockdevOptions{Driver: "file", NodeName: "f", Filename: img}); err != nil {
		t.Fatal(err)
	}
	wantDesc(t, "a duplicate", e.AddNode(BlockdevOptions{Driver: "null-co", NodeName: "f"}), "Duplicate nodes with node-name='f'")
	if err := e.AddNode(BlockdevOptions{Driver: "qcow2", NodeName: "q", File: &BlockdevRef{Name: "f"}}); err != nil {
		t.Fatal(err)
	}
	wantDesc(t, "deleting a child", e.DelNode("f"), "Block device f is in use")
	if err := e.DelNode("q"); err != nil {
		t.Fatal(err)
	}
	if err := e.AddNode(BlockdevOptions{Driver: "qcow2", NodeName: "inline", ReadOnly: true,
		File: &BlockdevRef{Inline: &BlockdevOptions{Driver: "file", Filename: img, ReadOnly: true}}}); err != nil {
		t.Fatal(err)
	}
	nodes := e.Nodes()
	if len(nodes) != 3 || nodes[0].NodeName != "inline" || nodes[1].NodeName[0] != '#' || !nodes[0].RO || nodes[0].Image.VirtualSize != 1<<20 {
		t.Fatalf("nodes: %+v", nodes)
	}
	wantDesc(t, "deleting an inline child", e.DelNode(nodes[1].NodeName), "Node "+nodes[1].NodeName+" is not owned by the monitor")
	wantDesc(t, "a writable export of a read-only node", e.AddExport(ExportOptions{Type: "fuse", ID: "x", NodeName: "inline", Mountpoint: img, Writable: true}),
		"Cannot export read-only node 'inline' as writable")
	if err := e.DelNode("inline"); err != nil {
		t.Fatal(err)
	}
	if n := e.Nodes(); len(n) != 1 || n[0].NodeName != "f" {
		t.Fatalf("after deleting inline (its child goes with it): %+v", n)
	}
	if len(e.Exports()) != 0 {
		t.Fatalf("exports: %+v", e.Exports())
	}
	if _, err := os.Stat(img); err != nil {
		t.Fatal(err)
	}
}

// TestTLSCredentialsRefusedAsQEMURefusesThem: a client endpoint is no
// server's credentials, tls-authz names an object that cannot exist here,
// files that are there but no certificate fail at object-add, and none
// of these leaves a server behind: a plain one starts after them.
func TestTLSCredentialsRefusedAsQEMURefusesThem(t *testing.T) {
	dir := t.TempDir()
	for _, name := range []string{"ca-cert.pem", "server-cert.pem", "server-key.pem"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte("not PEM"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	e := New(Options{Backend: "threads"})
	t.Cleanup(func() { e.Close() })
	if err := e.AddTLSCreds(TLSCredsOptions{ID: "c", Dir: dir, Endpoint: "client", VerifyPeer: true}); err != nil {
		t.Fatal(err)
	}
	if err := e.AddTLSCreds(TLSCredsOptions{ID: "s", Dir: dir, Endpoint: "server", VerifyPeer: true}); err == nil {
		t.Fatal("server credentials from files with no certificate in them were added")
	}
	addr := NBDAddress{Type: "unix", Path: filepath.Join(dir, "nbd.sock")}
	wantDesc(t, "client credentials", e.StartNBD(NBDServerOptions{Addr: addr, TLSCreds: "c"}), "Expected TLS credentials for a server endpoint")
	wantDesc(t, "unknown credentials", e.StartNBD(NBDServerOptions{Addr: addr, TLSCreds: "s"}), "No TLS credentials with id 's'")
	wantDesc(t, "tls-authz", e.StartNBD(NBDServerOptions{Addr: addr, TLSAuthz: "a"}), "Cannot find QAuthZ object ID a")
	if _, err := os.Stat(addr.Path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a refused nbd-server-start left its socket: %v", err)
	}
	if err := e.StartNBD(NBDServerOptions{Addr: addr}); err != nil {
		t.Fatalf("a plain server after the refusals: %v", err)
	}
	if err := e.DelObject("c"); err != nil {
		t.Fatal(err)
	}
	wantDesc(t, "deleted twice", e.DelObject("c"), "object 'c' not found")
}

// TestDeletedNodesGiveTheirMemoryBackOnceDeletionsGoQuiet: with
// ReturnMemory, a run of blockdev-dels returns the freed memory once,
// after the last; without it, never.
func TestDeletedNodesGiveTheirMemoryBackOnceDeletionsGoQuiet(t *testing.T) {
	for _, on := range []bool{true, false} {
		e := New(Options{Backend: "threads", ReturnMemory: on})
		t.Cleanup(func() { e.Close() })
		given := make(chan time.Time, 10)
		e.giveBack = func() { given <- time.Now() }
		const nodes = 5
		for i := range nodes {
			if err := e.AddNode(BlockdevOptions{Driver: "null-co", NodeName: fmt.Sprintf("n%d", i)}); err != nil {
				t.Fatal(err)
			}
		}
		var last time.Time
		for i := range nodes {
			if err := e.DelNode(fmt.Sprintf("n%d", i)); err != nil {
				t.Fatal(err)
			}
			last = time.Now()
			time.Sleep(returnMemoryAfter / 10)
		}
		select {
		case at := <-given:
			if !on {
				t.Fatal("memory given back without ReturnMemory")
			}
			if at.Sub(last) < returnMemoryAfter*9/10 {
				t.Fatalf("memory given back %v after the last deletion, before the deletions went quiet (%v)", at.Sub(last), returnMemoryAfter)
			}
		case <-time.After(3 * returnMemoryAfter):
			if on {
				t.Fatal("memory not given back after the deletions")
			}
		}
		select {
		case <-given:
			t.Fatal("memory given back more than once for one run of deletions")
		case <-time.After(returnMemoryAfter):
		}
	}
}
