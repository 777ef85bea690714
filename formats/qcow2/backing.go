package qcow2

import (
	"fmt"
	"path/filepath"
	"strings"

	"github.com/blockexport/blockexport/formats"
)

// openBacking opens the backing file the header names, if any, through
// open: a relative name is relative to this image's directory, as in
// QEMU; a backing file without a format is probed by open.
func (q *Image) openBacking(open formats.BackingOpener) error {
	if q.h.backingFile == "" {
		return nil
	}
	if open == nil {
		return fmt.Errorf("qcow2: %s has a backing file (%s) and nothing to open it with", q.path, q.h.backingFile)
	}
	bpath := q.h.backingFile
	if !filepath.IsAbs(bpath) && !strings.Contains(bpath, "://") { // a URI (nbd://) is no path
		bpath = filepath.Join(filepath.Dir(q.path), bpath)
	}
	// The backing format is whatever the header names: the opener is the
	// one place that knows every format, and refuses by name one it does
	// not read.
	b, err := open(bpath, q.h.backingFormat)
	if err != nil {
		return fmt.Errorf("qcow2: %s: backing file %s: %w", q.path, q.h.backingFile, err)
	}
	q.backing = b
	return nil
}
