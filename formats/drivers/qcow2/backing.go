package qcow2

import (
	"fmt"
	"path/filepath"
	"strings"

	"github.com/blockexport/blockexport/formats"
)

// backingPath is what the backing string backing of the image named
// image resolves to: a URI (nbd://, http://) or an absolute path as it
// is, a relative name relative to the image's directory, or to its URL
// for a remote image (as QEMU combines them).
func backingPath(image, backing string) string {
	switch {
	case filepath.IsAbs(backing) || strings.Contains(backing, "://"):
		return backing
	case strings.Contains(image, "://"):
		return image[:strings.LastIndexByte(image, '/')+1] + backing
	}
	return filepath.Join(filepath.Dir(image), backing)
}

// openBacking opens the backing file the header names, if any, through
// open: a relative name is relative to this image's directory, as in
// QEMU; a backing file without a format is probed by open. shown is how
// the backing string may appear in a message (the opener's: a URL
// without its secrets); nil: as it is.
func (q *Image) openBacking(open formats.BackingOpener, shown func(string) string) error {
	if q.h.backingFile == "" {
		return nil
	}
	shownBacking := q.h.backingFile
	if shown != nil {
		shownBacking = shown(shownBacking)
	}
	if open == nil {
		return fmt.Errorf("qcow2: %s has a backing file (%s) and nothing to open it with", q.path, shownBacking)
	}
	if strings.Contains(q.path, "://") && filepath.IsAbs(q.h.backingFile) {
		// A local file is not for an image from a server (http://…) to
		// name: an export would show it.
		return fmt.Errorf("qcow2: %s: backing file %s: a remote image may not name a local file", q.path, shownBacking)
	}
	bpath := backingPath(q.path, q.h.backingFile)
	// The backing format is whatever the header names: the opener is the
	// one place that knows every format, and refuses by name one it does
	// not read.
	b, err := open(bpath, q.h.backingFormat)
	if err != nil {
		return fmt.Errorf("qcow2: %s: backing file %s: %w", q.path, shownBacking, err)
	}
	q.backing = b
	return nil
}
