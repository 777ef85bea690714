package fuse

import (
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestConnectionEndsDetachOnlyWhereNotUnmounted checks the two ends of a
// connection that Mount.serve tells apart: our own Unmount (the mount
// table is not read again) and an abort from outside (the dead mount is
// found in the table and detached); and that mountPoint, which spares an
// add the table, says yes on a mount and no on a plain file.
func TestConnectionEndsDetachOnlyWhereNotUnmounted(t *testing.T) {
	path := filepath.Join(t.TempDir(), "disk.raw")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if mountPoint(path) {
		t.Fatalf("%s: a plain file taken for a mount point", path)
	}
	mount := func() *Mount {
		t.Helper()
		m, err := New(newNull(t, 1<<20), Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}).Mount(path, MountOptions{FsName: "null"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Unmount(path, unix.MNT_DETACH) })
		if !mountPoint(path) || !fuseMounted(path) {
			t.Fatalf("%s: the export's mount is not seen (mountPoint %v, fuseMounted %v)", path, mountPoint(path), fuseMounted(path))
		}
		return m
	}
	done := func(m *Mount) {
		t.Helper()
		select {
		case <-m.Done():
		case <-time.After(10 * time.Second):
			t.Fatal("the connection did not end")
		}
	}

	m := mount()
	if err := m.Unmount(); err != nil {
		t.Fatal(err)
	}
	done(m)
	if !m.unmounted.Load() || fuseMounted(path) {
		t.Fatalf("after Unmount: unmounted flag %v, still mounted %v", m.unmounted.Load(), fuseMounted(path))
	}

	m = mount()
	m.abort() // as fusectl's abort from outside: the mount stays, dead
	done(m)
	if m.unmounted.Load() || fuseMounted(path) {
		t.Fatalf("after an abort: unmounted flag %v, dead mount left %v", m.unmounted.Load(), fuseMounted(path))
	}
}
