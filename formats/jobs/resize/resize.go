// Package resize is `qemu-img resize`: a new virtual size for a raw or
// qcow2 image, absolute or relative, grown with or without preallocation,
// shrunk only when asked. Each refusal is QEMU 7.2's, in its words, so
// that scripts written against qemu-img read the same messages.
package resize

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/formats"
)

// maxLength is QEMU's BDRV_MAX_LENGTH: INT64_MAX aligned down to its
// largest request alignment. The block layer refuses any larger size.
const maxLength = 9223372035781033984

// Preallocation modes, QEMU's names.
const (
	PreallocOff      = "off"
	PreallocMetadata = "metadata"
	PreallocFalloc   = "falloc"
	PreallocFull     = "full"
)

// Request is a parsed command line.
type Request struct {
	// Size is the size given; Sign is +1 or -1 for a "+SIZE" or "-SIZE"
	// relative to the current size, 0 for an absolute one.
	Size     uint64
	Sign     int
	Prealloc string
	Shrink   bool
}

// Error is a refusal as qemu-img reports it: one entry per message.
type Error struct{ Messages []string }

func (e *Error) Error() string { return strings.Join(e.Messages, "\n") }

// Reports are the messages, one each.
func (e *Error) Reports() []string { return e.Messages }

func refuse(m ...string) error { return &Error{Messages: m} }

// CheckPrealloc refuses a preallocation mode QEMU does not know.
func CheckPrealloc(mode string) error {
	switch mode {
	case PreallocOff, PreallocMetadata, PreallocFalloc, PreallocFull:
		return nil
	}
	return refuse(fmt.Sprintf("Invalid preallocation mode '%s'", mode))
}

// NewSize is the size the request asks of an image of current bytes, and
// whether it may be applied, as img_resize decides (the arithmetic is
// QEMU's 64-bit two's complement: a sum past 2^63 is negative).
func (r Request) NewSize(current int64) (int64, error) {
	var total int64
	switch r.Sign {
	case 0:
		total = int64(r.Size)
	case 1:
		total = int64(uint64(current) + r.Size)
	default:
		total = int64(uint64(current) - r.Size)
	}
	switch {
	case total <= 0:
		return 0, refuse("New image size must be positive")
	case total <= current && r.Prealloc != PreallocOff:
		return 0, refuse("Preallocation can only be used for growing images")
	case total < current && !r.Shrink:
		return 0, refuse("Use the --shrink option to perform a shrink operation.",
			"warning: Shrinking an image will delete all data beyond the shrunken image's end. Before performing such an operation, make sure there is no important data there.")
	case total > maxLength:
		return 0, refuse(fmt.Sprintf("offset(%d) exceeds maximum(%d)", total, int64(maxLength)))
	}
	return total, nil
}

// rawPreallocator is a raw image that can grow with its new part
// allocated on the host.
type rawPreallocator interface {
	GrowPreallocated(ctx context.Context, size int64, full bool) error
}

// preallocator is a qcow2 image that allocates the grown part without
// marking its dirty bitmaps, as QEMU's preallocation marks none.
type preallocator interface {
	Preallocate(ctx context.Context, off, n int64) error
}

// resizeChecker is a qcow2 image that may refuse any resize.
type resizeChecker interface{ ResizeAllowed() error }

// Resize applies r to img, an image of format ("raw" or "qcow2") opened
// writable. The new size is durable on return.
func Resize(ctx context.Context, img formats.Image, format string, r Request) error {
	total, err := r.NewSize(img.Size())
	if err != nil {
		return err
	}
	old := img.Size()
	switch format {
	case "raw":
		if r.Prealloc == PreallocMetadata {
			return refuse("Unsupported preallocation mode: metadata")
		}
		if r.Prealloc != PreallocOff {
			p, ok := img.(rawPreallocator)
			if !ok {
				return fmt.Errorf("resize: preallocation of this raw image: %w", formats.ErrNotSupported)
			}
			if err := p.GrowPreallocated(ctx, total, r.Prealloc == PreallocFull); err != nil {
				return hostError(err, "Could not resize file")
			}
			return nil
		}
		if err := img.Resize(ctx, total); err != nil {
			return hostError(err, "Could not resize file")
		}
		return img.Flush(ctx)
	case "qcow2":
		if total%512 != 0 {
			return refuse("The new size must be a multiple of 512")
		}
		if c, ok := img.(resizeChecker); ok {
			if err := c.ResizeAllowed(); err != nil {
				return refuse(err.Error())
			}
		}
		if err := img.Resize(ctx, total); err != nil {
			return hostError(err, "Failed to grow the L1 table")
		}
		if r.Prealloc != PreallocOff && total > old {
			// Every mode leaves the new clusters allocated; writing
			// zeroes there allocates them as full does (metadata and
			// falloc leave the same guest data, with a sparser file).
			if p, ok := img.(preallocator); ok {
				if err := p.Preallocate(ctx, old, total-old); err != nil {
					return fmt.Errorf("resize: %w", err)
				}
			} else if err := writeZeroData(ctx, img, old, total); err != nil {
				return err
			}
		}
		return img.Flush(ctx)
	}
	// QEMU 7.2's vmdk, vhdx, vpc and vdi drivers have no truncate.
	return refuse("Image format driver does not support resize")
}

// hostError words a host refusal of the size as QEMU does ("Could not
// resize file: File too large"); other errors keep their own words.
func hostError(err error, what string) error {
	if errors.Is(err, unix.EFBIG) {
		return refuse(what + ": File too large")
	}
	return err
}

func writeZeroData(ctx context.Context, img formats.Image, from, to int64) error {
	zero := make([]byte, min(to-from, 1<<20))
	for off := from; off < to; off += int64(len(zero)) {
		n := min(int64(len(zero)), to-off)
		if _, err := img.WriteAt(ctx, zero[:n], off); err != nil {
			return fmt.Errorf("resize: preallocate at %d: %w", off, err)
		}
	}
	return nil
}
