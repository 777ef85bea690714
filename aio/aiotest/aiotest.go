// Package aiotest holds test doubles of aio.File that the format
// packages' tests share.
package aiotest

import (
	"context"
	"fmt"
	"os"
	"sync/atomic"
	"unsafe"

	"github.com/blockexport/blockexport/aio"
	"golang.org/x/sys/unix"
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

// Resident is how many of the pages of the first n bytes of path the
// page cache holds (mincore over a shared mapping, which reads nothing
// in): what a test of drop-behind reads counts.
func Resident(path string, n int) (int, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	m, err := unix.Mmap(int(f.Fd()), 0, n, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return 0, err
	}
	defer unix.Munmap(m)
	vec := make([]byte, (n+os.Getpagesize()-1)/os.Getpagesize())
	if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(n), uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
		return 0, fmt.Errorf("mincore %s: %w", path, errno)
	}
	k := 0
	for _, v := range vec {
		k += int(v & 1)
	}
	return k, nil
}
