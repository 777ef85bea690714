package aio

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestFallbackWhenIOUringIsDisabled turns io_uring off system-wide for a
// moment (kernel.io_uring_disabled=2, restored in Cleanup) and checks that
// Open falls back to threads with one log line and still does I/O.
func TestFallbackWhenIOUringIsDisabled(t *testing.T) {
	const knob = "/proc/sys/kernel/io_uring_disabled"
	old, err := os.ReadFile(knob)
	if err != nil {
		t.Fatalf("this test needs %s (Linux >= 6.6): %v", knob, err)
	}
	if err := os.WriteFile(knob, []byte("2"), 0); err != nil {
		t.Fatalf("cannot disable io_uring (run as root): %v", err)
	}
	t.Cleanup(func() { os.WriteFile(knob, old, 0) })

	path := filepath.Join(t.TempDir(), "f")
	os.WriteFile(path, bytes.Repeat([]byte{5}, 8192), 0o644)
	var logs bytes.Buffer
	f, err := Open(path, Options{Backend: IOUring, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if f.Backend() != Threads {
		t.Fatalf("backend %s with io_uring disabled, want threads", f.Backend())
	}
	if lines := strings.Count(logs.String(), "\n"); lines != 1 || !strings.Contains(logs.String(), "io_uring unavailable") {
		t.Fatalf("want one log line about the fallback, got %q", logs.String())
	}
	buf := make([]byte, 4096)
	if _, err := f.ReadAt(context.Background(), buf, 4096); err != nil || buf[0] != 5 {
		t.Fatalf("read through the fallback: %v", err)
	}
}
