package qcow2

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/aio"

	"github.com/blockexport/blockexport/formats/raw"
)

// maxChainDepth bounds backing chains; QEMU has no fixed limit, but a chain
// this deep is a loop we failed to see or an attack.
const maxChainDepth = 256

// chainGuard refuses a backing chain that loops (the same file twice, by
// device and inode, whatever the names) or grows absurdly deep.
type chainGuard struct {
	seen  map[[2]uint64]string
	depth int
}

func newChainGuard() *chainGuard { return &chainGuard{seen: map[[2]uint64]string{}} }

func (g *chainGuard) enter(fd int, path string) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("qcow2: stat %s: %w", path, err)
	}
	id := [2]uint64{st.Dev, st.Ino}
	if prev, ok := g.seen[id]; ok {
		return fmt.Errorf("%w: backing chain loops: %s is %s again", ErrCorrupt, path, prev)
	}
	g.seen[id] = path
	g.depth++
	if g.depth > maxChainDepth {
		return fmt.Errorf("%w: backing chain deeper than %d", ErrCorrupt, maxChainDepth)
	}
	return nil
}

// openChain opens path and, recursively, its backing files.
func openChain(path string, o Options, guard *chainGuard) (*Image, error) {
	q, err := openOne(path, o, guard)
	if err != nil {
		return nil, err
	}
	if q.h.backingFile == "" {
		return q, nil
	}
	bpath := q.h.backingFile
	if !filepath.IsAbs(bpath) {
		bpath = filepath.Join(filepath.Dir(path), bpath)
	}
	bfmt := q.h.backingFormat
	if bfmt == "" {
		bfmt, err = probeFormat(bpath)
		if err != nil {
			q.Close()
			return nil, fmt.Errorf("qcow2: %s: backing file %s: %w", path, q.h.backingFile, err)
		}
	}
	bo := o
	bo.Writable = false // writes never reach the backing chain
	switch bfmt {
	case "qcow2":
		b, err := openChain(bpath, bo, guard)
		if err != nil {
			q.Close()
			return nil, fmt.Errorf("%s: backing file: %w", path, err)
		}
		q.backing = b
	case "raw":
		b, err := raw.Open(bpath, raw.Options{Backend: o.Backend, Direct: o.Direct, Logger: o.Logger, Lock: o.Lock, Backing: true})
		if err != nil {
			q.Close()
			return nil, fmt.Errorf("qcow2: %s: backing file: %w", path, err)
		}
		q.backing = b
	default:
		q.Close()
		return nil, fmt.Errorf("%w: backing format %q of %s", ErrUnsupported, bfmt, path)
	}
	q.bfmt = bfmt
	return q, nil
}

// probeFormat names the format of a backing file given without one.
func probeFormat(path string) (string, error) {
	f, err := aio.OpenHostFile(path, os.O_RDONLY)
	if err != nil {
		return "", err
	}
	defer f.Close()
	var head [4]byte
	if _, err := io.ReadFull(f, head[:]); err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
		return "", err
	}
	if bytes.Equal(head[:], magic[:]) {
		return "qcow2", nil
	}
	return "raw", nil
}
