package engine

import (
	"bytes"
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/blockexport/blockexport/export/nbd"
	"github.com/blockexport/blockexport/formats/registry"
)

// TestOneShotNBDExportServesABorrowedImage: an image opened outside the
// engine is served as the one export of a server of its own on the
// caller's listener, under the server's export name; ending the export
// closes the listener and reports the end on Ended, and closing the
// engine leaves the borrowed image open for its owner.
func TestOneShotNBDExportServesABorrowedImage(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "disk.raw")
	want := bytes.Repeat([]byte("oneshot!"), 8192)
	if err := os.WriteFile(path, want, 0o600); err != nil {
		t.Fatal(err)
	}
	img, err := registry.Open(path, registry.Options{Format: registry.Raw, Backend: "threads"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { img.Image.Close() })
	e := New(Options{Backend: "threads"})
	t.Cleanup(func() { e.Close() })
	if err := e.AddImageNode(img.Image, ImageNode{NodeName: "image", Driver: img.Format, Filename: path, ReadOnly: true}); err != nil {
		t.Fatal(err)
	}
	wantDesc(t, "a second node of the name", e.AddImageNode(img.Image, ImageNode{NodeName: "image"}), "Duplicate nodes with node-name='image'")
	wantDesc(t, "a writable export of a read-only node",
		e.AddExport(ExportOptions{Type: "nbd", ID: "export", NodeName: "image", Writable: true, NBD: &NBDExtras{}}),
		"Cannot export read-only node 'image' as writable")

	sock := filepath.Join(dir, "nbd.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	ended := make(chan error, 1)
	if err := e.AddExport(ExportOptions{Type: "nbd", ID: "export", NodeName: "image",
		NBD: &NBDExtras{Listener: l, Ended: ended, Server: nbd.Options{Name: "disk"}}}); err != nil {
		t.Fatal(err)
	}
	if x := e.Exports(); len(x) != 1 || x[0].ID != "export" || x[0].Type != "nbd" || x[0].NodeName != "image" {
		t.Fatalf("exports: %+v", x)
	}
	client, err := registry.Open("nbd+unix:///disk?socket="+sock, registry.Options{Backend: "threads",
		NBD: registry.NBDOptions{Connections: 1}})
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(want))
	_, err = client.Image.ReadAt(context.Background(), got, 0)
	client.Image.Close()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the export's bytes differ from the image's")
	}

	if err := e.EndExport("export"); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-ended:
		if err != nil {
			t.Fatalf("the server ended with %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Ended got nothing once the export ended")
	}
	if _, err := net.Dial("unix", sock); err == nil {
		t.Fatal("the listener still accepts once the export ended")
	}
	if x := e.Exports(); len(x) != 0 {
		t.Fatalf("exports after the end: %+v", x)
	}
	wantDesc(t, "ending it twice", e.EndExport("export"), "Export 'export' is not found")
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := img.Image.ReadAt(context.Background(), got[:4096], 0); err != nil {
		t.Fatalf("the borrowed image after the engine closed: %v", err)
	}
}

// TestOneShotEngineLogsOnlyWhatGoesWrong: the one-shot engine's own
// bookkeeping lines stay out of the command's log; its warnings do not.
func TestOneShotEngineLogsOnlyWhatGoesWrong(t *testing.T) {
	var buf bytes.Buffer
	e := NewOneShot(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug})))
	e.log.With("export", "x").Info("export added")
	e.log.Debug("a detail")
	e.log.WithGroup("g").Warn("something went wrong")
	out := buf.String()
	if strings.Contains(out, "export added") || strings.Contains(out, "a detail") || !strings.Contains(out, "something went wrong") {
		t.Fatalf("log:\n%s", out)
	}
}
