package vhdx

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"

	"github.com/blockexport/blockexport/aio"
)

// Fresh is a VHDX image that Create has just made, opened to be filled by
// convert -O vhdx: the one writer of a file nobody else reads. It is not
// the general write path (that goes through the log, later): blocks are
// allocated at the end of the file (a fixed disk's at the place Create
// kept for them), their data written there, and the BAT written in place
// at Flush and Close, after the data of the writes completed before it is
// on disk; so a crash leaves every block at its new state (zero) or with
// its data (convert flushes once its writes are done). The log stays
// empty.
type Fresh struct {
	*Image
	mu sync.Mutex
	// end is where the next dynamic block goes (whole MiB).
	end int64
	// dataOff is where a fixed disk's blocks lie, block after block.
	dataOff int64
	// dirty: BAT entries changed since the BAT was last written.
	dirty bool
	// batOff is the BAT region's offset in the file.
	batOff int64
}

// OpenFresh opens the image Create just made in f, writable; f is owned
// from now on (closed on failure too).
func OpenFresh(ctx context.Context, f aio.File) (*Fresh, error) {
	img, err := New(ctx, f, Options{})
	if err != nil {
		return nil, err
	}
	if img.diff {
		img.Close()
		return nil, fmt.Errorf("%w: %s: a differencing image is not written here", ErrUnsupported, img.path)
	}
	size, err := aio.FileSize(f)
	if err != nil {
		img.Close()
		return nil, fmt.Errorf("vhdx: %s: %w", img.path, err)
	}
	r, h, err := readHeaders(ctx, f, nil)
	if err != nil {
		img.Close()
		return nil, err
	}
	bat, _, _, err := r.regions([]span{{0, headerSection, "the header section"}, {h.logOffset, h.logOffset + uint64(h.logLength), "the log"}})
	if err != nil {
		img.Close()
		return nil, err
	}
	w := &Fresh{Image: img, end: (size + mib - 1) &^ (mib - 1), batOff: int64(bat.start), dataOff: -1}
	if img.fixed && size >= img.size && (size-img.size)%mib == 0 {
		w.dataOff = size - img.size // Create's layout: the data last
	}
	return w, nil
}

// WriteAt writes p at off, allocating the blocks it touches.
func (w *Fresh) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	if off < 0 || off > w.size || int64(len(p)) > w.size-off {
		return 0, fmt.Errorf("vhdx: write of %d bytes at %d is outside the disk (%d bytes)", len(p), off, w.size)
	}
	done := 0
	for done < len(p) {
		at := off + int64(done)
		in := at % w.blockSize
		n := int(min(int64(len(p)-done), w.blockSize-in))
		host, err := w.block(at/w.blockSize, true)
		if err != nil {
			return done, err
		}
		if _, err := w.f.WriteAt(ctx, p[done:done+n], host+in); err != nil {
			return done, fmt.Errorf("vhdx: %s: write block at %d: %w", w.path, host, err)
		}
		done += n
	}
	return done, nil
}

// block is the host offset of block b, allocated when alloc is set;
// -1: not allocated (it reads as zeroes).
func (w *Fresh) block(b int64, alloc bool) (int64, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	e := w.bat[b]
	if e&batStateMask == blockFullyPresent {
		return int64(e & batOffsetMask), nil
	}
	if !alloc {
		return -1, nil
	}
	host := w.end
	if w.dataOff >= 0 {
		host = (w.dataOff + b*w.blockSize + mib - 1) &^ (mib - 1)
	} else {
		w.end += (w.blockSize + mib - 1) &^ (mib - 1)
	}
	// A new block reads as zeroes where nothing is written: a dynamic
	// one is past the old end of the file, a fixed one in the hole Create
	// left. The last block need only hold the disk's bytes.
	w.bat[b] = uint64(host) | blockFullyPresent
	w.dirty = true
	return host, nil
}

// WriteZeroes zeroes the allocated blocks of the range; the others read as
// zeroes already (a new image has no parent).
func (w *Fresh) WriteZeroes(ctx context.Context, off, n int64, _ bool) error {
	var zero []byte
	for n > 0 {
		in := off % w.blockSize
		k := min(n, w.blockSize-in)
		host, err := w.block(off/w.blockSize, false)
		if err != nil {
			return err
		}
		if host >= 0 {
			if int64(len(zero)) < k {
				zero = make([]byte, k)
			}
			if _, err := w.f.WriteAt(ctx, zero[:k], host+in); err != nil {
				return fmt.Errorf("vhdx: %s: zero block at %d: %w", w.path, host, err)
			}
		}
		off, n = off+k, n-k
	}
	return nil
}

// Discard does nothing: what a discarded range reads is unspecified.
func (w *Fresh) Discard(context.Context, int64, int64) error { return nil }

// TryWriteAt never writes without waiting: WriteAt may allocate.
func (w *Fresh) TryWriteAt([]byte, int64) (bool, error) { return false, nil }

// Flush makes the data durable, then writes the BAT in place and makes
// it durable too.
func (w *Fresh) Flush(ctx context.Context) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	// Every block lies wholly inside the file, even where its tail was
	// never written (QEMU refuses a block past the end): one byte at the
	// end sizes the file and leaves the rest a hole.
	if size, err := aio.FileSize(w.f); err != nil {
		return fmt.Errorf("vhdx: %s: %w", w.path, err)
	} else if size < w.end {
		if _, err := w.f.WriteAt(ctx, []byte{0}, w.end-1); err != nil {
			return fmt.Errorf("vhdx: %s: size the file to %d: %w", w.path, w.end, err)
		}
	}
	if err := w.f.Fdatasync(ctx); err != nil {
		return fmt.Errorf("vhdx: %s: flush data: %w", w.path, err)
	}
	if !w.dirty {
		return nil
	}
	chunk := sectorsPerChunk * int64(w.logicalSector) / w.blockSize
	n := int64(len(w.bat))
	if n == 0 {
		return nil
	}
	buf := make([]byte, 8*batIndex(uint64(n-1), uint64(chunk))+8)
	for b, e := range w.bat {
		binary.LittleEndian.PutUint64(buf[8*batIndex(uint64(b), uint64(chunk)):], e)
	}
	// The sector bitmap entries between chunks stay 0 (NOT_PRESENT), as
	// Create wrote them.
	if _, err := w.f.WriteAt(ctx, buf, w.batOff); err != nil {
		return fmt.Errorf("vhdx: %s: write the BAT: %w", w.path, err)
	}
	if err := w.f.Fdatasync(ctx); err != nil {
		return fmt.Errorf("vhdx: %s: flush the BAT: %w", w.path, err)
	}
	w.dirty = false
	return nil
}

// Close writes the BAT (convert may close without a flush) and closes.
func (w *Fresh) Close() error {
	return errors.Join(w.Flush(context.Background()), w.Image.Close())
}
