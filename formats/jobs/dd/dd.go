// Package dd is `qemu-img dd`: a byte range of an image, picked in
// blocks, copied into a new raw or qcow2 image. Its arithmetic is QEMU
// 7.2's (img_dd), quirks included, so that the same operands give the
// same output: count counts blocks from the start of the input, not from
// skip; the input's length is counted in whole 512-byte sectors, as
// bdrv_getlength does; a skip past the end leaves an empty output and a
// warning, not a failure.
package dd

import (
	"context"
	"fmt"
	"io"
	"math"

	"github.com/blockexport/blockexport/formats"
)

// Request is the operands bs=, count= and skip=.
type Request struct {
	BlockSize int64 // 1 to 2^31-1 (QEMU's limit); 512 unless bs= is given
	Count     int64
	HasCount  bool
	Skip      int64
	HasSkip   bool
}

// Plan is what a request copies from an input of a given length: the
// input range [From, To) to offset 0 of an output of OutputSize bytes.
// SkipPastEnd says skip= lies past the input's end (QEMU warns, creates
// an empty output and succeeds).
type Plan struct {
	From, To    int64
	OutputSize  int64
	SkipPastEnd bool
}

// Plan works out the copy for an input of inputSize bytes.
func (r Request) Plan(inputSize int64) Plan {
	bs := r.BlockSize
	size := (inputSize + 511) &^ 511 // bdrv_getlength: whole sectors
	if r.HasCount && r.Count <= math.MaxInt64/bs && r.Count*bs < size {
		size = r.Count * bs
	}
	if r.HasSkip && (r.Skip > math.MaxInt64/bs || size < r.Skip*bs) {
		return Plan{From: size, To: size, SkipPastEnd: true}
	}
	from := r.Skip * bs
	return Plan{From: from, To: size, OutputSize: size - from}
}

// Copy copies in's [p.From, p.To) to out at 0, in chunks of at least the
// block size (the result does not depend on the chunk: QEMU's
// block-at-a-time loop writes the same bytes). What lies past the input's
// own length, within its last sector, reads as zeroes.
func Copy(ctx context.Context, in, out formats.Image, p Plan, blockSize int64) error {
	chunk := max(blockSize, 1<<20)
	buf := make([]byte, min(chunk, max(p.To-p.From, 0)))
	end := in.Size()
	for pos := p.From; pos < p.To; {
		n := min(int64(len(buf)), p.To-pos)
		b := buf[:n]
		got := int64(0)
		if pos < end {
			got = min(n, end-pos)
			if _, err := in.ReadAt(ctx, b[:got], pos); err != nil && err != io.EOF {
				return fmt.Errorf("dd: read at %d: %w", pos, err)
			}
		}
		clear(b[got:])
		if _, err := out.WriteAt(ctx, b, pos-p.From); err != nil {
			return fmt.Errorf("dd: write at %d: %w", pos-p.From, err)
		}
		pos += n
	}
	return out.Flush(ctx)
}
