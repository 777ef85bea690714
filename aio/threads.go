package aio

import (
	"context"
	"io"
	"os"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// hostFile is the part of a File both engines share: the descriptor, and
// the drop-behind and lending state kept beside it.
type hostFile struct {
	f      *os.File
	fd     int
	direct bool
	// shut guards against using a descriptor number that Close released
	// and the kernel may have handed to another file.
	shut   atomic.Bool
	behind atomic.Pointer[dropper] // set by SetDropBehind
	lend   pageMap                 // see PageSource
}

func (h *hostFile) Fd() int      { return h.fd }
func (h *hostFile) Name() string { return h.f.Name() }
func (h *hostFile) closed() bool { return h.shut.Load() }

// check refuses calls on a closed file.
func (h *hostFile) check(ctx context.Context, op string) error {
	if h.closed() {
		return &os.PathError{Op: op, Path: h.f.Name(), Err: os.ErrClosed}
	}
	return ctx.Err()
}

// TryReadAt: see File.
func (h *hostFile) TryReadAt(p []byte, off int64) bool {
	if h.closed() || !tryRead(h.fd, h.direct, p, off) {
		return false
	}
	h.behind.Load().done(off, len(p))
	return true
}

// close ends drop-behind and lending, then closes the descriptor once
// stop (the engine's) has returned.
func (h *hostFile) close(stop func()) error {
	h.shut.Store(true)
	h.behind.Load().close()
	h.lend.close()
	stop()
	return h.f.Close()
}

// threadFile issues each call as a plain syscall from the calling goroutine.
type threadFile struct{ hostFile }

// directEOF says whether err, from the read that continues one that came
// back short after done bytes, is the end of an O_DIRECT file: the short
// read stopped at the end as it was then, maybe off a block boundary, and
// a write that grew the file since makes the unaligned continuation fail
// with EINVAL instead of reading nothing.
func directEOF(f File, done int, err error) bool {
	if done == 0 || err != unix.EINVAL {
		return false
	}
	switch f := f.(type) {
	case *threadFile:
		return f.direct
	case *uringFile:
		return f.direct
	}
	return false
}

func newThreadFile(f *os.File, direct bool) *threadFile {
	return &threadFile{hostFile{f: f, fd: int(f.Fd()), direct: direct}}
}

func (t *threadFile) Backend() Backend { return Threads }
func (t *threadFile) Close() error     { return t.close(func() {}) }

func (t *threadFile) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	n, err := transfer(ctx, t, false, [][]byte{p}, off, t.check)
	t.behind.Load().done(off, n)
	return n, err
}

func (t *threadFile) TryWriteAt(p []byte, off int64) (bool, error) {
	return tryWrite(t, t.direct, t.check, p, off)
}

func (t *threadFile) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	return transfer(ctx, t, true, [][]byte{p}, off, t.check)
}

// transfer runs pread or pwrite (one buffer), preadv or pwritev (several)
// from the calling goroutine until iov is done, continuing short transfers:
// a read returns fewer bytes only at end of file, with io.EOF. check runs
// before each try.
func transfer(ctx context.Context, f File, write bool, iov [][]byte, off int64, check func(context.Context, string) error) (int, error) {
	op := "pread"
	switch {
	case write && len(iov) > 1:
		op = "pwritev"
	case write:
		op = "pwrite"
	case len(iov) > 1:
		op = "preadv"
	}
	iov = advance(iov, 0) // nothing to move for leading empty pieces
	// advance reslices the pieces: the caller's stay as they are.
	var one [1][]byte
	if len(iov) == 1 {
		one[0], iov = iov[0], one[:]
	} else {
		iov = append([][]byte(nil), iov...)
	}
	total := 0
	for len(iov) > 0 {
		if err := check(ctx, op); err != nil {
			return total, err
		}
		var n int
		var err error
		switch at := off + int64(total); {
		case len(iov) == 1 && write:
			n, err = unix.Pwrite(f.Fd(), iov[0], at)
		case len(iov) == 1:
			n, err = unix.Pread(f.Fd(), iov[0], at)
		case write:
			n, err = unix.Pwritev(f.Fd(), iov, at)
		default:
			n, err = unix.Preadv(f.Fd(), iov, at)
		}
		if err == unix.EINTR || err == unix.EAGAIN {
			continue
		}
		if !write && directEOF(f, total, err) {
			return total, io.EOF
		}
		if err != nil {
			return total, pathErr(op, f, err)
		}
		if n == 0 {
			return total, nothingMoved(op, f, write)
		}
		total += n
		iov = advance(iov, n)
	}
	return total, nil
}

func (t *threadFile) ReadvAt(ctx context.Context, iov [][]byte, off int64) (int, error) {
	n, err := transfer(ctx, t, false, iov, off, t.check)
	t.behind.Load().done(off, n)
	return n, err
}

func (t *threadFile) WritevAt(ctx context.Context, iov [][]byte, off int64) (int, error) {
	return transfer(ctx, t, true, iov, off, t.check)
}

// nothingMoved is the error for a transfer of zero bytes: the end of the
// file for a read, a full device for a write.
func nothingMoved(op string, f File, write bool) error {
	if write {
		return pathErr(op, f, unix.ENOSPC)
	}
	return io.EOF
}

func (t *threadFile) Fsync(ctx context.Context) error {
	return retryEINTR(ctx, "fsync", t, t.check, func() error { return unix.Fsync(t.fd) })
}

func (t *threadFile) Fdatasync(ctx context.Context) error {
	return retryEINTR(ctx, "fdatasync", t, t.check, func() error { return unix.Fdatasync(t.fd) })
}

func (t *threadFile) Fallocate(ctx context.Context, mode uint32, off, n int64) error {
	return retryEINTR(ctx, "fallocate", t, t.check, func() error { return unix.Fallocate(t.fd, mode, off, n) })
}

// retryEINTR runs a syscall from the calling goroutine until it is not
// interrupted; check runs before each try.
func retryEINTR(ctx context.Context, op string, f File, check func(context.Context, string) error, call func() error) error {
	for {
		if err := check(ctx, op); err != nil {
			return err
		}
		err := call()
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return pathErr(op, f, err)
		}
		return nil
	}
}
