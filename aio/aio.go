// Package aio does asynchronous I/O on host files.
//
// A [File] is a host file that many goroutines read and write at once, each
// call parking only its own goroutine. The engine is chosen at [Open]:
// "io_uring", one shared ring per file with concurrent submissions batched
// into one io_uring_enter (uring_linux.go), or "threads", plain system calls
// from the calling goroutine, the runtime's thread pool being the thread
// pool (threads.go). Open falls back to threads by itself, with one log
// line, where the kernel refuses rings. fallocate(2) is always a direct
// call: io_uring would hand it to a worker thread. [Aligned] lets an
// O_DIRECT file take requests of any alignment.
package aio

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"

	"golang.org/x/sys/unix"
)

// Backend names an I/O engine.
type Backend string

const (
	IOUring Backend = "io_uring"
	Threads Backend = "threads"
)

// ParseBackend accepts the names the --aio flag takes.
func ParseBackend(s string) (Backend, error) {
	switch Backend(s) {
	case IOUring, Threads:
		return Backend(s), nil
	}
	return "", fmt.Errorf("unknown aio backend %q (want io_uring or threads)", s)
}

// File is an open host file for concurrent asynchronous I/O.
type File interface {
	// ReadAt reads len(p) bytes at off. Short reads are continued; it
	// returns fewer bytes only at end of file, with io.EOF.
	ReadAt(ctx context.Context, p []byte, off int64) (int, error)
	// WriteAt writes all of p at off; short writes are continued.
	WriteAt(ctx context.Context, p []byte, off int64) (int, error)
	// TryReadAt reads all of p at off if it can without waiting for a device
	// (a page-cache hit: preadv2 with RWF_NOWAIT; never under O_DIRECT). false:
	// p holds nothing usable, and a ReadAt on a coroutines.AfterMiss context
	// goes to the device without a second try.
	TryReadAt(p []byte, off int64) bool
	// TryWriteAt writes all of p at off if the write completes in the page
	// cache: a buffered file's. false: it would wait for the device
	// (O_DIRECT) and nothing was written; true: err is the outcome.
	TryWriteAt(p []byte, off int64) (bool, error)
	// ReadvAt and WritevAt are the vectored forms, same rules.
	ReadvAt(ctx context.Context, iov [][]byte, off int64) (int, error)
	WritevAt(ctx context.Context, iov [][]byte, off int64) (int, error)
	// Fsync makes data and metadata durable; Fdatasync data (and the
	// metadata needed to read it back).
	Fsync(ctx context.Context) error
	Fdatasync(ctx context.Context) error
	// Fallocate is fallocate(2) with the FALLOC_FL_* mode bits.
	Fallocate(ctx context.Context, mode uint32, off, n int64) error
	// Fd is the descriptor, for metadata calls that are not I/O
	// (fstat, lseek SEEK_DATA, ftruncate); data goes through the methods
	// above.
	Fd() int
	// Name is the path the file was opened with.
	Name() string
	// Backend says which engine serves this file.
	Backend() Backend
	// Close stops the engine and closes the descriptor. Calls still in
	// flight complete first.
	Close() error
}

// Options choose how Open opens a file.
type Options struct {
	Backend  Backend // default IOUring
	Writable bool
	// Direct opens with O_DIRECT: the caller's buffers, offsets and lengths
	// must be multiples of the file's logical block size (see
	// [LogicalBlockSize]).
	Direct bool
	// Entries is the io_uring queue size; 0 means 256.
	Entries uint32
	// Lock, when set, is taken on the file as QEMU takes its image locks;
	// Open fails with ErrInUse when another user's locks conflict.
	Lock   *Lock
	Logger *slog.Logger
}

// Open opens path for I/O with the chosen engine.
func Open(path string, o Options) (File, error) {
	flags := os.O_RDONLY
	if o.Writable {
		flags = os.O_RDWR
	}
	if o.Direct {
		flags |= unix.O_DIRECT
	}
	f, err := OpenHostFile(path, flags)
	if err != nil {
		return nil, err
	}
	if o.Lock != nil {
		if err := lockImage(f, *o.Lock); err != nil {
			f.Close()
			return nil, err
		}
	}
	if cmp.Or(o.Backend, IOUring) == IOUring {
		uf, err := newURingFile(f, o)
		if err == nil {
			return uf, nil
		}
		if !errors.Is(err, ErrNoURing) {
			f.Close()
			return nil, err
		}
		cmp.Or(o.Logger, slog.Default()).Warn("io_uring unavailable, using the thread backend", "file", path, "err", err)
	}
	return newThreadFile(f, o.Direct), nil
}

// ErrInUse says another process uses the image in a way that conflicts
// with this open (its lock bytes say so).
var ErrInUse = errors.New("image is in use")

// ErrNoURing says the kernel will not give us a ring; Open then falls back.
var ErrNoURing = errors.New("io_uring not available")

// LogicalBlockSize is the alignment O_DIRECT needs on fd: the block device's
// logical block size for devices, the file system's for files (never below
// 512).
func LogicalBlockSize(fd int) int {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err == nil && st.Mode&unix.S_IFMT == unix.S_IFBLK {
		if n, err := unix.IoctlGetInt(fd, unix.BLKSSZGET); err == nil && n > 0 {
			return n
		}
	}
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(fd, &sfs); err == nil && sfs.Bsize >= 512 && sfs.Bsize <= 64<<10 {
		// Statx's DIO alignment would be more precise, but the fs block
		// size is always a valid (if conservative) alignment.
		return int(sfs.Bsize)
	}
	return 4096
}

func pathErr(op string, f File, errno error) error {
	return &os.PathError{Op: op, Path: f.Name(), Err: errno}
}

// advance drops the first n bytes from iov, reusing its backing array.
func advance(iov [][]byte, n int) [][]byte {
	for n > 0 && len(iov) > 0 {
		if n < len(iov[0]) {
			iov[0] = iov[0][n:]
			return iov
		}
		n -= len(iov[0])
		iov = iov[1:]
	}
	for len(iov) > 0 && len(iov[0]) == 0 {
		iov = iov[1:]
	}
	return iov
}
