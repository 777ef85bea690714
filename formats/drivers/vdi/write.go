package vdi

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync/atomic"
	"syscall"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
)

// Writes, as QEMU 7.2's vdi driver makes them and no less safely:
//
//   - A write to an allocated block goes to its data in place.
//   - A write to an unallocated (or discarded) block allocates data
//     block N, the header's blocks_allocated, at the end of the data: the
//     whole 1 MiB block is written (zeroes around the request, as QEMU
//     writes it) and synced first; then the header's count becomes N+1
//     and the block's map entry N. Nothing points at the new block before
//     its bytes are durable, so a crash never leaves an entry naming
//     garbage.
//   - Data blocks below the count that no entry names (leaked by a crash
//     between the count and the entry) are found when the image opens
//     for writing and taken first: only their entry is written.
//   - The count and the entry go in one write when the entry lies in the
//     file's first maxHead bytes (the first 16,256 blocks, 15.9 GiB of
//     disk, of an image laid out as QEMU and VirtualBox lay them out): a
//     killed writer leaves both or neither. Past that, the count goes
//     first and is synced, then the entry: a crash between them leaves a
//     block that nothing names, counted (a leak; qemu-img check reports
//     it as "allocated blocks mismatch", and every allocator, QEMU's and
//     VirtualBox's included, allocates past it). The other order would
//     leave an entry at the count, which QEMU's next allocation would
//     hand to a second block.
//   - Blocks are never deallocated: QEMU 7.2 has no discard and no
//     zero-write for vdi. Zeroes over an unallocated or discarded block
//     write nothing (it reads as zeroes already); over an allocated one
//     they are written as data. Discard does nothing.
//   - The size is fixed: QEMU has no resize for vdi ("Image format driver
//     does not support resize").

// maxHead bounds the part of the file an allocation rewrites in one
// write: the header and the block map's first entries, 16 pages dirtied
// at most per allocation.
const maxHead = 64 << 10

// ErrDamaged: the image reads, but its block map is not one a writer
// can extend safely; a writable open is refused.
var ErrDamaged = errors.New("vdi: the block map is damaged; refusing to write")

// openForWriting checks what a writer relies on beyond what the reader
// checked: the whole block map (blocks_in_image entries, QEMU's check
// reads them all) lies in the file, before the data, and names distinct
// data blocks below the header's count, which is at most the map's
// length. Then it reads the file's head for allocations.
func (img *Image) openForWriting(ctx context.Context, direct bool, log *slog.Logger) error {
	h := img.h
	fileSize, err := aio.FileSize(img.f)
	if err != nil {
		return err
	}
	mapStart := int64(h.OffsetBmap)
	mapEnd := mapStart + 4*int64(h.BlocksInImage)
	switch {
	case mapEnd > fileSize:
		return fmt.Errorf("%w: block map [%#x, %#x) ends past the end of the file (%d bytes)", ErrDamaged, mapStart, mapEnd, fileSize)
	case h.BlocksInImage > 0 && int64(h.OffsetData) < mapEnd:
		return fmt.Errorf("%w: data at %#x overlaps the block map [%#x, %#x)", ErrDamaged, h.OffsetData, mapStart, mapEnd)
	case h.BlocksAllocated > h.BlocksInImage:
		return fmt.Errorf("%w: %d blocks allocated, more than the map's %d", ErrDamaged, h.BlocksAllocated, h.BlocksInImage)
	case direct && h.OffsetData%sectorSize != 0:
		// The block map's last sector holds data: an O_DIRECT write of
		// either rewrites the other's bytes, and two could cross.
		return fmt.Errorf("vdi: data at %#x is not sector-aligned: write it without O_DIRECT (--cache writeback): %w", h.OffsetData, formats.ErrNotSupported)
	}
	// Every entry, the disk's (checked by loadBmap) and those past it.
	used := make([]uint64, (uint64(h.BlocksAllocated)+63)/64) // <= blocks_in_image bits: the map is in the file
	var entries uint32
	buf := make([]byte, 4*min(checkChunk, int64(h.BlocksInImage)))
	for i := uint32(0); i < h.BlocksInImage; {
		n := min(uint32(checkChunk), h.BlocksInImage-i)
		if _, err := img.f.ReadAt(ctx, buf[:4*n], mapStart+4*int64(i)); err != nil {
			return fmt.Errorf("vdi: read block map: %w", err)
		}
		for j := range n {
			e := binary.LittleEndian.Uint32(buf[4*j:])
			if e >= discarded {
				continue
			}
			if e >= h.BlocksAllocated {
				return fmt.Errorf("%w: block %d names data block %d, but %d are allocated", ErrDamaged, i+j, e, h.BlocksAllocated)
			}
			if used[e/64]&(1<<(e%64)) != 0 {
				return fmt.Errorf("%w: block %d names data block %d, which another block names too", ErrDamaged, i+j, e)
			}
			used[e/64] |= 1 << (e % 64)
			entries++
		}
		i += n
	}
	// A count above the entries (a crash between count and entry) is
	// a leak: those data blocks are taken again first.
	if entries < h.BlocksAllocated {
		a := &img.alloc
		a.used, a.leaked = used, h.BlocksAllocated-entries
		if log != nil {
			log.Warn("vdi: data blocks no entry names (a crash between the count and the entry); they are reused first",
				"image", img.f.Name(), "allocated", h.BlocksAllocated, "named", entries)
		}
	}
	a := &img.alloc
	a.count = h.BlocksAllocated
	a.metaEnd = mapEnd
	a.head = make([]byte, max(headerSize, min(mapEnd, maxHead)))
	if _, err := img.f.ReadAt(ctx, a.head, 0); err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("vdi: read the header: %w", err)
	}
	img.writable = true
	return nil
}

// SetNoFlush skips every sync (qemu-img convert's cache=unsafe): the
// order of writes is kept, their durability left to the kernel.
func (img *Image) SetNoFlush(on bool) { img.noFlush.Store(on) }

func (img *Image) sync(ctx context.Context) error {
	if img.noFlush.Load() {
		return nil
	}
	if err := img.f.Fdatasync(ctx); err != nil {
		return fmt.Errorf("vdi: sync %s: %w", img.f.Name(), err)
	}
	return nil
}

// Flush makes every completed write durable.
func (img *Image) Flush(ctx context.Context) error {
	if !img.writable {
		return nil
	}
	return img.sync(ctx)
}

func (img *Image) check(what string, off, n int64) error {
	switch {
	case !img.writable:
		return formats.ErrReadOnly
	case off < 0 || n < 0 || off > img.size || n > img.size-off:
		return fmt.Errorf("vdi: %s %d bytes at %d: %w", what, n, off, formats.ErrOutOfRange)
	}
	return nil
}

// dataOffset is where data block e's byte in lies in the file.
func (img *Image) dataOffset(e uint32, in int64) int64 {
	return int64(img.h.OffsetData) + int64(e)*blockSize + in
}

// WriteAt writes p at off, block by block, allocating blocks it is the
// first to write.
func (img *Image) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	if err := img.check("write", off, int64(len(p))); err != nil {
		return 0, err
	}
	for done := 0; done < len(p); {
		at := off + int64(done)
		in := at % blockSize
		n := int(min(int64(len(p)-done), blockSize-in))
		q := p[done : done+n]
		if e := atomic.LoadUint32(&img.bmap[at/blockSize]); e < discarded {
			if _, err := img.f.WriteAt(ctx, q, img.dataOffset(e, in)); err != nil {
				return done, fmt.Errorf("vdi: write %d bytes at %d: %w", n, at, err)
			}
		} else if err := img.allocate(ctx, at/blockSize, q, in); err != nil {
			return done, err
		}
		done += n
	}
	return len(p), nil
}

// allocate writes q at byte in of block i, which had no data block when
// looked at: it allocates one unless a concurrent write did first.
func (img *Image) allocate(ctx context.Context, i int64, q []byte, in int64) error {
	a := &img.alloc
	a.mu.Lock()
	defer a.mu.Unlock()
	if e := atomic.LoadUint32(&img.bmap[i]); e < discarded {
		if _, err := img.f.WriteAt(ctx, q, img.dataOffset(e, in)); err != nil {
			return fmt.Errorf("vdi: write %d bytes at %d: %w", len(q), i*blockSize+in, err)
		}
		return nil
	}
	if a.failed != nil {
		return a.failed
	}
	n, reuse := a.count, false
	if a.leaked > 0 {
		for a.used[a.next/64]&(1<<(a.next%64)) != 0 {
			a.next++ // leaked > 0: a clear bit lies below the count
		}
		n, reuse = a.next, true
	}
	if n >= img.h.BlocksInImage { // the disk's blocks fit in the map: never
		return fmt.Errorf("vdi: no data block left (%d of %d allocated): %w", n, img.h.BlocksInImage, syscall.ENOSPC)
	}
	if a.block == nil {
		a.block = make([]byte, blockSize)
	}
	clear(a.block[:in])
	copy(a.block[in:], q)
	clear(a.block[in+int64(len(q)):])
	if _, err := img.f.WriteAt(ctx, a.block, img.dataOffset(n, 0)); err != nil {
		return fmt.Errorf("vdi: write new data block %d for block %d: %w", n, i, err)
	}
	if err := img.sync(ctx); err != nil {
		return err
	}
	if err := img.link(ctx, i, n, reuse); err != nil {
		// What reached the file is unknown: no more allocations.
		a.failed = fmt.Errorf("vdi: an earlier allocation failed, no more writes: %w", err)
		return err
	}
	if reuse {
		a.used[n/64] |= 1 << (n % 64)
		if a.leaked--; a.leaked == 0 {
			a.used = nil
		}
	} else {
		a.count = n + 1
	}
	atomic.StoreUint32(&img.bmap[i], n)
	return nil
}

// link records data block n as block i's, with the count n+1 unless
// reuse says n is a leaked block below the count (see the top of this
// file for the order).
func (img *Image) link(ctx context.Context, i int64, n uint32, reuse bool) error {
	a := &img.alloc
	le := binary.LittleEndian
	entryAt := int64(img.h.OffsetBmap) + 4*i
	if entryAt+4 <= int64(len(a.head)) {
		le.PutUint32(a.head[entryAt:], n)
	}
	if reuse {
		var e [4]byte
		le.PutUint32(e[:], n)
		return img.writeMeta(ctx, e[:], entryAt, "a block map entry")
	}
	le.PutUint32(a.head[allocatedField:], n+1)
	if entryAt+4 <= int64(len(a.head)) {
		return img.writeMeta(ctx, a.head[:entryAt+4], 0, "the allocated count and block map entry")
	}
	if err := img.writeMeta(ctx, a.head[:headerSize], 0, "the header"); err != nil {
		return err
	}
	if err := img.sync(ctx); err != nil {
		return err
	}
	var e [4]byte
	le.PutUint32(e[:], n)
	return img.writeMeta(ctx, e[:], entryAt, "a block map entry")
}

// writeMeta writes metadata p at off, which must lie before the end of
// the block map: the check every metadata write passes, so that no bug
// and no image puts metadata into data.
func (img *Image) writeMeta(ctx context.Context, p []byte, off int64, what string) error {
	if off < 0 || off+int64(len(p)) > img.alloc.metaEnd || off+int64(len(p)) > int64(img.h.OffsetData) && img.h.BlocksInImage > 0 {
		return fmt.Errorf("vdi: write of %s at [%#x, %#x) would overlap the data at %#x; refused", what, off, off+int64(len(p)), img.h.OffsetData)
	}
	if _, err := img.f.WriteAt(ctx, p, off); err != nil {
		return fmt.Errorf("vdi: write %s: %w", what, err)
	}
	return nil
}

// WriteZeroes makes [off, off+n) read as zeroes: allocated blocks are
// written with zeroes, unallocated and discarded ones already read as
// zeroes and are left alone. Nothing is deallocated (QEMU 7.2 neither).
func (img *Image) WriteZeroes(ctx context.Context, off, n int64, _ bool) error {
	if err := img.check("write zeroes", off, n); err != nil {
		return err
	}
	for end := off + n; off < end; {
		in := off % blockSize
		k := min(end-off, blockSize-in)
		if e := atomic.LoadUint32(&img.bmap[off/blockSize]); e < discarded {
			host := img.dataOffset(e, in)
			write := func(ctx context.Context, p []byte, o int64) (int, error) { return img.f.WriteAt(ctx, p, host+o-off) }
			if err := formats.WriteZeroBuffers(ctx, write, off, k, 4096); err != nil {
				return fmt.Errorf("vdi: write zeroes at %d: %w", off, err)
			}
		}
		off += k
	}
	return nil
}

// Discard does nothing but check the range: QEMU 7.2's vdi has no
// discard, and a block given back would need the map and the data moved.
func (img *Image) Discard(_ context.Context, off, n int64) error {
	return img.check("discard", off, n)
}

// Resize is refused, as QEMU 7.2 refuses it for vdi.
func (img *Image) Resize(context.Context, int64) error {
	if !img.writable {
		return formats.ErrReadOnly
	}
	return fmt.Errorf("vdi: Image format driver does not support resize: %w", formats.ErrNotSupported)
}

// TryWriteAt writes p in place when it lies in one allocated block and
// the page cache takes it at once; anything that allocates waits.
func (img *Image) TryWriteAt(p []byte, off int64) (bool, error) {
	if !img.writable || off < 0 || int64(len(p)) > img.size-off { // O_DIRECT: the file says it would wait
		return false, nil
	}
	in := off % blockSize
	if in+int64(len(p)) > blockSize {
		return false, nil
	}
	e := atomic.LoadUint32(&img.bmap[off/blockSize])
	if e >= discarded {
		return false, nil
	}
	return img.f.TryWriteAt(p, img.dataOffset(e, in))
}
