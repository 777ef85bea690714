// Package aiotest holds test doubles of aio.File that the format
// packages' tests share.
package aiotest

import (
	"context"
	"sync/atomic"

	"github.com/blockexport/blockexport/aio"
)

// SyncCounter is an aio.File that counts the fdatasyncs and fsyncs asked
// of it (each also reaches the file), so that a test can tell whether a
// flush made anything durable.
type SyncCounter struct {
	aio.File
	N *atomic.Int64
}

// Fdatasync counts, then syncs the file's data.
func (c SyncCounter) Fdatasync(ctx context.Context) error {
	c.N.Add(1)
	return c.File.Fdatasync(ctx)
}

// Fsync counts, then syncs the file.
func (c SyncCounter) Fsync(ctx context.Context) error {
	c.N.Add(1)
	return c.File.Fsync(ctx)
}
