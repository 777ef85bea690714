// Package copyonread is QEMU's copy-on-read filter: reads copy what the top
// layer does not allocate from the backing chain into it, so that every
// block crosses from the backing file once and the top layer can later be
// used without it; everything else goes to the top layer as usual. The
// copying belongs to the top layer's format (qcow2 alone knows its
// clusters and holds the range lock that orders a copy against a write);
// this package routes reads there and refuses images that cannot.
package copyonread

import (
	"context"
	"errors"
	"fmt"

	"github.com/blockexport/blockexport/formats"
)

// Copier is a writable top layer that copies on read.
type Copier interface {
	formats.Image
	formats.Layered
	// ReadCopy reads p at off, first copying the clusters it touches that
	// this layer does not allocate from the backing chain into it.
	ReadCopy(ctx context.Context, p []byte, off int64) (int, error)
	// TryReadHere is TryReadAt for bytes this layer allocates; anything
	// else would wait (ReadCopy copies it).
	TryReadHere(p []byte, off int64) bool
}

// ErrNoBacking: the image has no backing file to copy from.
var ErrNoBacking = errors.New("--copy-on-read: the image has no backing file to copy from")

// Image reads through its top layer's copy-on-read; the rest of
// formats.Image, and every optional capability but lending, is the top
// layer's own (formats.Filter).
type Image struct {
	formats.Filter
	top Copier
}

// New wraps img, which must be a writable image of a format that copies
// on read (qcow2), with a backing file.
func New(img formats.Image, format string) (*Image, error) {
	c, ok := img.(Copier)
	if !ok {
		return nil, fmt.Errorf("--copy-on-read needs a qcow2 overlay; the image is %s", format)
	}
	if c.Backing() == nil {
		return nil, ErrNoBacking
	}
	return &Image{Filter: formats.Filter{Image: c}, top: c}, nil
}

// ReadAt copies what the top layer lacks, then reads.
func (i *Image) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	return i.top.ReadCopy(ctx, p, off)
}

// TryReadAt serves only bytes the top layer holds: a read of the backing
// chain must go through ReadAt, which copies.
func (i *Image) TryReadAt(p []byte, off int64) bool {
	return i.top.TryReadHere(p, off)
}

// Nothing is lent (formats.PageLender, formats.CacheLender): a lend
// would read the backing chain without copying it.
func (i *Image) TryLendAt(_, _ int64, v [][]byte) ([][]byte, bool) { return v, false }
func (i *Image) CanLend() bool                                     { return false }
func (i *Image) LendAt(context.Context, int64, int64, int) ([][]byte, func(), bool, error) {
	return nil, nil, false, nil
}
