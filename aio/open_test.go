package aio_test

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/aio"
)

// TestOpenHostFileRefusesWhatHoldsNoImage: a FIFO (which would block the
// open until a writer came), a directory and a character device are
// refused at once, by name of their type, as ErrNotImage.
func TestOpenHostFileRefusesWhatHoldsNoImage(t *testing.T) {
	fifo := filepath.Join(t.TempDir(), "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	for path, kind := range map[string]string{fifo: "a FIFO", t.TempDir(): "a directory", "/dev/null": "a character device"} {
		f, err := aio.OpenHostFile(path, unix.O_RDONLY)
		if err == nil {
			f.Close()
			t.Fatalf("%s opened", path)
		}
		if !errors.Is(err, aio.ErrNotImage) || !strings.Contains(err.Error(), " is "+kind+":") {
			t.Errorf("%s: %v; want it named %s and ErrNotImage", path, err, kind)
		}
	}
}
