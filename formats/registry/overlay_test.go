package registry

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/formats"
)

// TestWritableOpenOfAReadOnlyFormatPointsToAnOverlay: a writable open of
// an image in a format read here and not written is refused before the
// file is opened, with one error value (ErrNeedsOverlay, a read-only
// refusal) and one line naming the command that makes the overlay, with
// the format given or probed.
func TestWritableOpenOfAReadOnlyFormatPointsToAnOverlay(t *testing.T) {
	ro := ReadOnlyFormats()
	if len(ro) == 0 {
		t.Fatal("no read-only formats in the registry")
	}
	for _, format := range ro {
		path := filepath.Join(t.TempDir(), "disk."+format)
		if err := os.WriteFile(path, make([]byte, 4096), 0o644); err != nil {
			t.Fatal(err)
		}
		_, err := Open(path, Options{Format: format, Writable: true, Lock: true})
		want := "blockexport create -f qcow2 -b " + path + " -F " + format + " overlay.qcow2"
		if !errors.Is(err, ErrNeedsOverlay) || !errors.Is(err, formats.ErrReadOnly) || errors.Is(err, ErrBadSpec) ||
			!strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: writable open: %v, want ErrNeedsOverlay naming %q", format, err, want)
		}
	}
	// Probed: the overlay names the format found.
	path := filepath.Join(t.TempDir(), "disk")
	if err := os.WriteFile(path, append([]byte("vhdxfile"), make([]byte, 4096)...), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(path, Options{Writable: true}); !errors.Is(err, ErrNeedsOverlay) || !strings.Contains(err.Error(), "-F vhdx overlay.qcow2") {
		t.Errorf("probed vhdx, writable open: %v", err)
	}
}
