package vpc

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/formats"
)

// writer is the write state of an image opened writable.
//
// A fixed disk is its file's bytes: a write goes to the same offset, and
// the footer after the disk is out of every request's range.
//
// A dynamic disk allocates a block where nothing the image references
// lies (next, past every structure, block and the file's bytes), in the
// order that leaves, at any point a crash cuts it, at worst a block that
// nothing references (a leak), never a BAT entry naming bytes that are
// not the block's:
//
//  1. the footer at the block's end, which extends the file (the old
//     footer is left where the bitmap goes);
//  2. the sector bitmap (every sector present, as QEMU writes it) and the
//     data written; the rest of the block lies past the old end of the
//     file, a hole that reads as zeroes;
//  3. fdatasync: the data and the file's new size are durable;
//  4. the BAT entry, made durable by the next flush (or allocation).
//
// QEMU 7.2 writes the bitmap, the footer and the BAT entry (syncing each)
// before the data, so a crash there leaves a block of zeroes where the
// guest wrote.
type writer struct {
	// mu orders allocations: one at a time, each owning the file's end.
	mu sync.Mutex
	// next is where the next block's bitmap goes (under mu).
	next    int64
	noFlush atomic.Bool
	// ones is a block's sector bitmap: every sector present.
	ones []byte
	// end is where the file ends, right after its footer: a fixed
	// disk's as opened; a dynamic disk's is next plus the footer.
	end int64
}

// maxBlockSector is the last sector a BAT entry can name (0xffffffff
// means unallocated).
const maxBlockSector = unallocated - 1

// openWriter checks that the image can be written and prepares it.
func (img *Image) openWriter(ctx context.Context) error {
	if img.fixed && !img.footerAtEnd {
		// QEMU reads such a file from its first byte: the footer found at
		// the start would be the disk's first sector, the guest's to
		// overwrite.
		return fmt.Errorf("%w: a fixed disk whose footer is at the start of the file, inside the disk, is not written", ErrUnsupported)
	}
	size, err := fileSize(img.f)
	if err != nil {
		return err
	}
	w := &writer{end: size}
	if !img.fixed {
		// The last sector of the file is the footer (or, after a crash,
		// bytes nothing references): the next bitmap goes over it, so
		// the block's data lies past the file's end and reads as zeroes
		// where it is not written. Nothing referenced lies there: metaEnd
		// is the end of the last block or structure.
		w.next = max(img.metaEnd, (size+511)&^511-footerSize)
		w.end = w.next + footerSize
		w.ones = make([]byte, img.bitmapSize)
		for i := range w.ones {
			w.ones[i] = 0xff
		}
	}
	img.w = w
	return nil
}

func fileSize(f interface{ Fd() int }) (int64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(f.Fd(), &st); err != nil {
		return 0, fmt.Errorf("vpc: stat: %w", err)
	}
	return st.Size, nil
}

// writable refuses a request on a read-only image or out of range.
func (img *Image) writable(op string, off, n int64) error {
	if img.w == nil {
		return formats.ErrReadOnly
	}
	if off < 0 || n < 0 || off > img.size || n > img.size-off {
		return fmt.Errorf("vpc: %s %d bytes at %d: %w", op, n, off, formats.ErrOutOfRange)
	}
	return nil
}

// WriteAt writes p at off: a fixed disk's file bytes, or a dynamic
// disk's blocks, allocating those not yet allocated.
func (img *Image) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	if err := img.writable("write", off, int64(len(p))); err != nil {
		return 0, err
	}
	if img.fixed {
		if _, err := img.f.WriteAt(ctx, p, off); err != nil {
			return 0, fmt.Errorf("vpc: write %d bytes at %d: %w", len(p), off, err)
		}
		return len(p), nil
	}
	for done := 0; done < len(p); {
		at := off + int64(done)
		idx, in := at/img.blockSize, at%img.blockSize
		q := p[done : done+int(min(int64(len(p)-done), img.blockSize-in))]
		var err error
		if e := atomic.LoadUint32(&img.bat[idx]); e != unallocated {
			_, err = img.f.WriteAt(ctx, q, int64(e)*512+img.bitmapSize+in)
		} else {
			err = img.allocate(ctx, idx, q, in)
		}
		if err != nil {
			return done, fmt.Errorf("vpc: write %d bytes at %d: %w", len(q), at, err)
		}
		done += len(q)
	}
	return len(p), nil
}

// allocate gives block idx its place at the end of the file and writes
// q at in inside it, in the order writer describes.
func (img *Image) allocate(ctx context.Context, idx int64, q []byte, in int64) error {
	w := img.w
	w.mu.Lock()
	defer w.mu.Unlock()
	if e := atomic.LoadUint32(&img.bat[idx]); e != unallocated { // allocated while we waited
		_, err := img.f.WriteAt(ctx, q, int64(e)*512+img.bitmapSize+in)
		return err
	}
	start := w.next
	end := start + img.bitmapSize + img.blockSize
	// The metadata-overlap guard: a new block lies past everything the
	// image references, and its entry inside the BAT.
	entry := img.batOff + 4*idx
	switch {
	case start%512 != 0 || start < img.metaEnd:
		return fmt.Errorf("%w: a new block at %#x would overlap metadata or a block (which end at %#x)", ErrCorrupt, start, img.metaEnd)
	case start/512 > maxBlockSector:
		return fmt.Errorf("block %d: no room: a block's place is a 32-bit sector number, and the file reaches past it: %w", idx, unix.EFBIG)
	case entry < img.batOff || entry+4 > img.batOff+int64(len(img.bat))*4:
		return fmt.Errorf("%w: BAT entry %d out of the BAT", ErrCorrupt, idx)
	}
	if _, err := img.f.WriteAt(ctx, img.footerRaw, end); err != nil {
		return fmt.Errorf("move the footer to %#x: %w", end, err)
	}
	if in == 0 {
		if _, err := img.f.WritevAt(ctx, [][]byte{w.ones, q}, start); err != nil {
			return fmt.Errorf("write block %d at %#x: %w", idx, start, err)
		}
	} else {
		if _, err := img.f.WriteAt(ctx, w.ones, start); err != nil {
			return fmt.Errorf("write block %d's bitmap at %#x: %w", idx, start, err)
		}
		if _, err := img.f.WriteAt(ctx, q, start+img.bitmapSize+in); err != nil {
			return fmt.Errorf("write block %d at %#x: %w", idx, start, err)
		}
	}
	w.end = end + footerSize
	if err := img.cutToEnd(); err != nil {
		return err
	}
	if !w.noFlush.Load() {
		if err := img.f.Fdatasync(ctx); err != nil {
			return fmt.Errorf("sync block %d before its BAT entry: %w", idx, err)
		}
	}
	var b [4]byte
	binary.BigEndian.PutUint32(b[:], uint32(start/512))
	if _, err := img.f.WriteAt(ctx, b[:], entry); err != nil {
		return fmt.Errorf("write BAT entry %d at %#x: %w", idx, entry, err)
	}
	w.next, img.metaEnd = end, end
	atomic.StoreUint32(&img.bat[idx], uint32(start/512))
	return nil
}

// TryWriteAt writes p into the page cache when it can without waiting: a
// fixed disk's bytes, or one allocated block of a dynamic disk.
func (img *Image) TryWriteAt(p []byte, off int64) (bool, error) {
	if img.writable("write", off, int64(len(p))) != nil {
		return false, nil
	}
	if img.fixed {
		return img.f.TryWriteAt(p, off)
	}
	idx, in := off/img.blockSize, off%img.blockSize
	if int64(len(p)) > img.blockSize-in {
		return false, nil
	}
	e := atomic.LoadUint32(&img.bat[idx])
	if e == unallocated {
		return false, nil
	}
	return img.f.TryWriteAt(p, int64(e)*512+img.bitmapSize+in)
}

// WriteZeroes makes [off, off+n) read as zeroes. QEMU's vpc driver has
// none (QEMU writes zeroes, allocating blocks); here an unallocated
// block of a dynamic disk already reads as zeroes and stays so, and
// allocated bytes (a fixed disk's, a block's data) are punched or zeroed
// in the file. The footer is past the disk: out of range.
func (img *Image) WriteZeroes(ctx context.Context, off, n int64, mayUnmap bool) error {
	if err := img.writable("zero", off, n); err != nil {
		return err
	}
	if img.fixed {
		return img.zeroHost(ctx, off, n, mayUnmap)
	}
	for end := off + n; off < end; {
		idx, in := off/img.blockSize, off%img.blockSize
		k := min(end-off, img.blockSize-in)
		if e := atomic.LoadUint32(&img.bat[idx]); e != unallocated {
			if err := img.zeroHost(ctx, int64(e)*512+img.bitmapSize+in, k, true); err != nil {
				return err
			}
		}
		off += k
	}
	return nil
}

// zeroHost zeroes [host, host+n) of the file without growing it: a hole
// where allowed, else a zeroed range, else written zeroes.
func (img *Image) zeroHost(ctx context.Context, host, n int64, punch bool) error {
	const keep = unix.FALLOC_FL_KEEP_SIZE
	modes := []uint32{unix.FALLOC_FL_ZERO_RANGE | keep}
	if punch {
		modes = []uint32{unix.FALLOC_FL_PUNCH_HOLE | keep, unix.FALLOC_FL_ZERO_RANGE | keep}
	}
	for _, m := range modes {
		err := img.f.Fallocate(ctx, m, host, n)
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.ENOSYS) && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("vpc: zero [%#x, +%d): %w", host, n, err)
		}
	}
	write := func(ctx context.Context, p []byte, off int64) (int, error) { return img.f.WriteAt(ctx, p, off) }
	return formats.WriteZeroBuffers(ctx, write, host, n, 4096)
}

// Discard does nothing, as QEMU's vpc driver (which has no discard): the
// bytes read as before, which discard allows.
func (img *Image) Discard(_ context.Context, off, n int64) error {
	return img.writable("discard", off, n)
}

// Resize is refused, as QEMU 7.2's vpc driver has no truncate.
func (img *Image) Resize(context.Context, int64) error {
	if img.w == nil {
		return formats.ErrReadOnly
	}
	return fmt.Errorf("vpc: resize: %w", formats.ErrNotSupported)
}

// SetNoFlush makes Flush and the syncs of allocations no-ops (qemu-img
// convert's cache=unsafe for its target).
func (img *Image) SetNoFlush(on bool) {
	if img.w != nil {
		img.w.noFlush.Store(on)
	}
}

// trimTail cuts the file back to end right after its footer where a
// write grew it past: with O_DIRECT (aio.Aligned), a write that is not
// whole host blocks pads the last one with zeroes past the end of the
// file, and a VHD's footer must be its last 512 bytes (libyal reads it
// there; a fixed disk is recognised by it). The padding holds nothing.
func (img *Image) trimTail() error {
	if !img.fixed {
		img.w.mu.Lock()
		defer img.w.mu.Unlock()
	}
	return img.cutToEnd()
}

// cutToEnd is trimTail with the allocation lock held.
func (img *Image) cutToEnd() error {
	size, err := fileSize(img.f)
	if err != nil || size <= img.w.end {
		return err
	}
	if err := unix.Ftruncate(img.f.Fd(), img.w.end); err != nil {
		return fmt.Errorf("vpc: cut the padding after the footer at %#x: %w", img.w.end, err)
	}
	return nil
}

// Flush makes every completed write durable, the BAT entries of the
// blocks allocated since the last flush with them.
func (img *Image) Flush(ctx context.Context) error {
	if img.w == nil {
		return nil
	}
	if err := img.trimTail(); err != nil {
		return err
	}
	if img.w.noFlush.Load() {
		return nil
	}
	if err := img.f.Fdatasync(ctx); err != nil {
		return fmt.Errorf("vpc: flush: %w", err)
	}
	return nil
}
