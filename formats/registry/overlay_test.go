package registry

import (
	"errors"
	"os"
	"os/exec"
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
	// Every format read here may be written; those left read-only (none,
	// once vhdx is written) are refused before their file opens.
	for _, format := range ReadOnlyFormats() {
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
	// A variant a format reads and does not write (a streamOptimized
	// vmdk that holds grains), probed: the overlay names the format found.
	dir := t.TempDir()
	raw, path := filepath.Join(dir, "disk.raw"), filepath.Join(dir, "disk")
	if err := os.WriteFile(raw, append(make([]byte, 1<<20), 1), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("qemu-img", "convert", "-f", "raw", "-O", "vmdk", "-o", "subformat=streamOptimized", raw, path).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img (apt package qemu-utils): %v\n%s", err, out)
	}
	_, err := Open(path, Options{Writable: true})
	if !errors.Is(err, ErrNeedsOverlay) || !errors.Is(err, formats.ErrReadOnly) || !strings.Contains(err.Error(), "-F vmdk overlay.qcow2") || strings.Contains(err.Error(), "\n") {
		t.Errorf("probed streamOptimized vmdk, writable open: %v", err)
	}
}
