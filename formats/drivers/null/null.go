// Package null is the null device: an image of a given size that stores
// nothing. Writes succeed and are dropped; reads return zeroes, or, with
// ReadZeroes off, leave the buffer as it is, so that a benchmark measures
// the protocol and nothing else (QEMU's null-co with read-zeroes=off).
package null

import (
	"context"
	"fmt"
	"sync/atomic"

	"github.com/blockexport/blockexport/formats"
)

// Image is a null device.
type Image struct {
	size       atomic.Int64
	readZeroes bool
	name       string
}

// New makes a null device of size bytes.
func New(name string, size int64, readZeroes bool) (*Image, error) {
	if size < 0 {
		return nil, fmt.Errorf("null: negative size %d", size)
	}
	img := &Image{readZeroes: readZeroes, name: name}
	img.size.Store(size)
	return img, nil
}

func (n *Image) ReadAt(_ context.Context, p []byte, _ int64) (int, error) {
	if n.readZeroes {
		clear(p)
	}
	return len(p), nil
}

func (n *Image) WriteAt(_ context.Context, p []byte, _ int64) (int, error) { return len(p), nil }

func (n *Image) WriteZeroes(context.Context, int64, int64, bool) error { return nil }
func (n *Image) Discard(context.Context, int64, int64) error           { return nil }
func (n *Image) Flush(context.Context) error                           { return nil }
func (n *Image) Size() int64                                           { return n.size.Load() }

func (n *Image) Resize(_ context.Context, size int64) error {
	if size < 0 {
		return fmt.Errorf("null: resize to %d: %w", size, formats.ErrOutOfRange)
	}
	n.size.Store(size)
	return nil
}

// Extent reports the whole device as one hole, as QEMU's null-co does: no
// data is stored, and the bytes are zero when reads return zeroes.
func (n *Image) Extent(_ context.Context, off, length int64) (formats.Extent, error) {
	size := n.size.Load()
	if off < 0 || off >= size {
		return formats.Extent{}, fmt.Errorf("null: extent at %d: %w", off, formats.ErrOutOfRange)
	}
	return formats.Extent{Start: off, Length: min(length, size-off), Zero: n.readZeroes, Present: n.readZeroes}, nil
}

// AllocatedSize is 0: a null device occupies nothing.
func (n *Image) AllocatedSize(context.Context) (int64, error) { return 0, nil }

func (n *Image) Info() formats.Info {
	return formats.Info{Format: "null", Filename: n.name, VirtualSize: n.size.Load(), ActualSize: 0, RequestAlignment: 1}
}

func (n *Image) Close() error { return nil }

// TryReadAt never waits: there is nothing to read.
func (n *Image) TryReadAt(p []byte, _ int64) bool {
	if n.readZeroes {
		clear(p)
	}
	return true
}

// TryWriteAt never waits: writes go nowhere.
func (n *Image) TryWriteAt([]byte, int64) (bool, error) { return true, nil }

// Features: zeroing writes nothing; there is no host file.
func (n *Image) Features() formats.Features { return formats.Features{FastZero: true} }
