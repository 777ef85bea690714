package convert

import (
	"context"
	"fmt"

	"github.com/blockexport/blockexport/formats"
)

// qemu-img convert's progress (qemu-img.c, convert_iteration_sectors and
// convert_co_do_copy) counts sectors of data (and of zeroes, with -S 0)
// in the pieces it copies: up to 2 MiB of one block-status run (a
// cluster when compressing), each counted as it starts. -p prints the
// running share of the total whenever it has grown by more than 1%, so
// printing the same percentages means counting the same pieces.
type qemuCount struct {
	starts []int64 // where each counted piece starts
	counts []int64 // the count once it has started
	total  int64
	next   int
}

const (
	qemuBuf        = 2 << 20               // IO_BUF_SIZE
	qemuRequestMax = (1<<31 - 1) >> 9 << 9 // BDRV_REQUEST_MAX_SECTORS in bytes
)

// qemuSteps walks src's block status as qemu-img convert's first pass
// does, with o's -S and compression.
func qemuSteps(ctx context.Context, src formats.Image, o Options) (*qemuCount, error) {
	buf := int64(qemuBuf)
	if o.Compressed != nil {
		buf = o.Compressed.ClusterSize()
	}
	size := src.Size()
	total := (size + 511) &^ 511
	q := &qemuCount{}
	var nextStatus int64
	var data bool
	for pos := int64(0); pos < total; {
		if err := ctx.Err(); err != nil { // Extent of a local image may not look
			return nil, err
		}
		if nextStatus <= pos {
			x, err := src.Extent(ctx, pos, min(size-pos, qemuRequestMax))
			if err != nil {
				return nil, fmt.Errorf("block status of the source at %d: %w", pos, err)
			}
			data = !zeroKnown(x)
			nextStatus = min(pos+(min(end(x)-pos, qemuRequestMax)+511)&^511, total)
		}
		n := nextStatus - pos
		isData := data
		if isData || o.MinSparse == 0 {
			n = min(n, buf)
		}
		if o.Compressed != nil {
			if n < buf {
				n, isData = min(buf, total-pos), true
			} else {
				n -= n % buf
			}
		}
		if isData || o.MinSparse == 0 {
			q.total += n
			q.starts = append(q.starts, pos)
			q.counts = append(q.counts, q.total)
		}
		pos += n
	}
	return q, nil
}

// follow returns the engine's Progress: told that the target holds the
// source up to done, it reports every piece that has started by then.
func (q *qemuCount) follow(report func(done, total int64)) func(done, total int64) {
	return func(done, _ int64) {
		for ; q.next < len(q.starts) && q.starts[q.next] < done; q.next++ {
			report(q.counts[q.next], q.total)
		}
	}
}
