package aio

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// TestImageLocks: lock bytes as QEMU takes them. A qcow2-style writer
// (holds write and resize, shares neither) excludes a second writer and a
// reader that wants consistency; raw-style writers (share everything)
// coexist; closing the file releases its locks.
func TestImageLocks(t *testing.T) {
	path := filepath.Join(t.TempDir(), "img")
	if err := os.WriteFile(path, make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	open := func(writable bool, l Lock) (File, error) {
		return Open(path, Options{Backend: Threads, Writable: writable, Lock: &l})
	}
	exclusive := Lock{Perm: PermConsistentRead | PermWrite | PermResize, Unshared: PermWrite | PermResize}
	reader := Lock{Perm: PermConsistentRead, Unshared: PermWrite | PermResize}
	shared := Lock{Perm: PermConsistentRead | PermWrite | PermResize}

	w, err := open(true, exclusive)
	if err != nil {
		t.Fatal(err)
	}
	for name, l := range map[string]Lock{"second writer": exclusive, "consistent reader": reader, "sharing writer": shared} {
		if f, err := open(l.Perm&PermWrite != 0, l); !errors.Is(err, ErrInUse) {
			if f != nil {
				f.Close()
			}
			t.Errorf("%s while a writer holds the image: %v, want ErrInUse", name, err)
		}
	}
	if f, err := Open(path, Options{Backend: Threads}); err != nil {
		t.Errorf("an open without locks (inspection) was refused: %v", err)
	} else {
		f.Close()
	}
	w.Close()

	a, err := open(true, shared)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := open(true, shared)
	if err != nil {
		t.Fatalf("two writers that share writes: %v", err)
	}
	b.Close()
	if f, err := open(false, reader); !errors.Is(err, ErrInUse) {
		if f != nil {
			f.Close()
		}
		t.Errorf("a consistent reader beside a writer: %v, want ErrInUse", err)
	}
}
