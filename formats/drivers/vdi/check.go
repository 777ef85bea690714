package vdi

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/driver"
)

// ErrNoRepair: QEMU's vdi check repairs nothing (it refuses any -r,
// which qemu-img reports as a format without checks).
var ErrNoRepair = errors.New("vdi: this image format does not support repairs")

// maxCheckMessages bounds the lines a check keeps: a header claiming 2^30
// blocks over a short file has as many duplicate entries (each counted,
// as QEMU counts them), and QEMU prints a line for each.
const maxCheckMessages = 1000

// checkChunk is how many entries of the block map a check reads at once.
const checkChunk = 1 << 18

// Check checks the image of f as qemu-img check does (QEMU 7.2's
// vdi_co_check): the header as vdi_open checks it (a refusal is the
// check's error), then each of the header's blocks_in_image block-map
// entries (those past the end of the file read as zeroes, as QEMU reads
// them): an allocated entry at or past blocks_in_image, or naming a data
// block another entry named, is a corruption, and so is a count of
// allocated entries other than the header's. The messages are QEMU's.
// Where QEMU finds nothing, what the reader refuses at open (an entry
// whose data lies past the end of the file, a block map over the header
// or under the data) is one corruption more: QEMU reads such images
// without an error and serves zeroes or other bytes. Memory is bounded
// by the entries in the file, not by the header's counts. f is closed.
//
// A repair (-r) is refused as QEMU's vdi check refuses it, which qemu-img
// reports as a format without checks (exit 63), once the image has
// opened as it would for writing (the header checked, the writer's lock
// taken by the registry: an image in use fails first, exit 1, as in
// qemu-img).
func Check(ctx context.Context, f aio.File, _ driver.Options, repair int) (formats.CheckResult, error) {
	defer f.Close()
	if repair != driver.RepairNone {
		if _, err := readHeader(ctx, f); err != nil {
			return formats.CheckResult{}, fmt.Errorf("%s: %w", f.Name(), err)
		}
		return formats.CheckResult{}, fmt.Errorf("%s: %w: %w", f.Name(), ErrNoRepair, driver.ErrNoChecks)
	}
	res := formats.CheckResult{Filename: f.Name(), Format: "vdi"}
	fileSize, err := aio.FileSize(f)
	if err != nil {
		return res, err
	}
	h, err := readHeader(ctx, f)
	if err != nil {
		return res, fmt.Errorf("%s: %w", f.Name(), err)
	}
	note := func(format string, args ...any) {
		res.Corruptions++
		switch {
		case len(res.Messages) < maxCheckMessages:
			res.Messages = append(res.Messages, fmt.Sprintf(format, args...))
		case len(res.Messages) == maxCheckMessages:
			res.Messages = append(res.Messages, "ERROR: (further errors counted, not listed)")
		}
	}
	used := usedBlocks{}
	var allocated uint32
	entry := func(block, e uint32) {
		if e >= discarded {
			return
		}
		if e >= h.BlocksInImage {
			note("ERROR: block index %d too large, is %d", block, e)
			return
		}
		allocated++
		if used.mark(e) {
			note("ERROR: block index %d also used by %d", e, e)
		}
	}
	// The entries inside the file, a chunk at a time.
	inFile := uint32(0)
	if start := int64(h.OffsetBmap); start < fileSize {
		inFile = uint32(min(int64(h.BlocksInImage), (fileSize-start)/4))
	}
	buf := make([]byte, 4*min(checkChunk, int64(inFile)))
	for i := uint32(0); i < inFile; {
		n := min(uint32(checkChunk), inFile-i)
		if _, err := f.ReadAt(ctx, buf[:4*n], int64(h.OffsetBmap)+4*int64(i)); err != nil {
			return res, fmt.Errorf("%s: vdi: read block map: %w", f.Name(), err)
		}
		for j := range n {
			entry(i+j, binary.LittleEndian.Uint32(buf[4*j:]))
		}
		i += n
		if err := ctx.Err(); err != nil {
			return res, err
		}
	}
	// The rest reads as zeroes: each names data block 0, the first may
	// be its first user, every other one is a duplicate (counted at once
	// past the listed messages).
	if k := h.BlocksInImage - inFile; k > 0 {
		entry(inFile, 0)
		rest := k - 1
		allocated += rest
		for j := uint32(0); j < rest; j++ {
			if len(res.Messages) > maxCheckMessages {
				res.Corruptions += int64(rest - j)
				break
			}
			note("ERROR: block index 0 also used by 0")
		}
	}
	if allocated != h.BlocksAllocated {
		note("ERROR: allocated blocks mismatch, is %d, should be %d", allocated, h.BlocksAllocated)
	}
	if res.Corruptions == 0 {
		// What QEMU does not look at, the reader refuses.
		img := &Image{f: f, h: h, size: int64(h.DiskSize), static: h.ImageType == typeStatic}
		if err := img.loadBmap(ctx, fileSize); err != nil {
			if !errors.Is(err, ErrCorrupt) {
				return res, fmt.Errorf("%s: %w", f.Name(), err)
			}
			note("ERROR: %v", err)
		}
	}
	return res, nil
}

// usedBlocks marks data blocks, in chunks of 2^16 made as they are
// first used: memory follows the distinct blocks the map names, at most
// one chunk per entry in the file.
type usedBlocks map[uint32]*[1024]uint64

// mark marks block e and says whether it was marked before.
func (u usedBlocks) mark(e uint32) bool {
	c := u[e>>16]
	if c == nil {
		c = new([1024]uint64)
		u[e>>16] = c
	}
	w, bit := (e&0xffff)/64, uint64(1)<<(e%64)
	was := c[w]&bit != 0
	c[w] |= bit
	return was
}

// readHeader reads and checks the header as QEMU's vdi_open does; a short
// file reads as zero-padded.
func readHeader(ctx context.Context, f aio.File) (Header, error) {
	buf := make([]byte, headerSize)
	if _, err := f.ReadAt(ctx, buf, 0); err != nil && !errors.Is(err, io.EOF) {
		return Header{}, fmt.Errorf("vdi: read header: %w", err)
	}
	h, err := parseHeader(buf)
	if err != nil {
		return Header{}, err
	}
	if err := h.validate(); err != nil {
		return Header{}, err
	}
	return h, nil
}
