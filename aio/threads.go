package aio

import (
	"context"
	"io"
	"os"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// threadFile issues each call as a plain syscall from the calling goroutine.
type threadFile struct {
	f  *os.File
	fd int
	// closed guards against using a descriptor number that Close released
	// and the kernel may have handed to another file.
	closed atomic.Bool
}

func newThreadFile(f *os.File) *threadFile {
	return &threadFile{f: f, fd: int(f.Fd())}
}

func (t *threadFile) Fd() int          { return t.fd }
func (t *threadFile) Name() string     { return t.f.Name() }
func (t *threadFile) Backend() Backend { return Threads }
func (t *threadFile) Close() error {
	t.closed.Store(true)
	return t.f.Close()
}

// check refuses calls on a closed file.
func (t *threadFile) check(ctx context.Context, op string) error {
	if t.closed.Load() {
		return pathErr(op, t, os.ErrClosed)
	}
	return ctx.Err()
}

func (t *threadFile) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	return preadAll(ctx, t, p, off, t.check)
}

// preadAll fills p from off with pread(2) from the calling goroutine,
// continuing short reads; fewer bytes only at end of file, with io.EOF.
func preadAll(ctx context.Context, f File, p []byte, off int64, check func(context.Context, string) error) (int, error) {
	done := 0
	for done < len(p) {
		if err := check(ctx, "pread"); err != nil {
			return done, err
		}
		n, err := unix.Pread(f.Fd(), p[done:], off+int64(done))
		if err == unix.EINTR || err == unix.EAGAIN {
			continue
		}
		if err != nil {
			return done, pathErr("pread", f, err)
		}
		if n == 0 {
			return done, io.EOF
		}
		done += n
	}
	return done, nil
}

func (t *threadFile) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	return pwriteAll(ctx, t, p, off, t.check)
}

// pwriteAll writes all of p at off with pwrite(2) from the calling
// goroutine, continuing short writes; check runs before each try.
func pwriteAll(ctx context.Context, f File, p []byte, off int64, check func(context.Context, string) error) (int, error) {
	done := 0
	for done < len(p) {
		if err := check(ctx, "pwrite"); err != nil {
			return done, err
		}
		n, err := unix.Pwrite(f.Fd(), p[done:], off+int64(done))
		if err == unix.EINTR || err == unix.EAGAIN {
			continue
		}
		if err != nil {
			return done, pathErr("pwrite", f, err)
		}
		if n == 0 {
			return done, pathErr("pwrite", f, unix.ENOSPC)
		}
		done += n
	}
	return done, nil
}

func (t *threadFile) ReadvAt(ctx context.Context, iov [][]byte, off int64) (int, error) {
	return preadvAll(ctx, t, iov, off, t.check)
}

func (t *threadFile) WritevAt(ctx context.Context, iov [][]byte, off int64) (int, error) {
	return pwritevAll(ctx, t, iov, off, t.check)
}

// preadvAll and pwritevAll are preadAll and pwriteAll for an iovec.
func preadvAll(ctx context.Context, f File, iov [][]byte, off int64, check func(context.Context, string) error) (int, error) {
	return vectored(ctx, f, "preadv", unix.Preadv, io.EOF, iov, off, check)
}

func pwritevAll(ctx context.Context, f File, iov [][]byte, off int64, check func(context.Context, string) error) (int, error) {
	return vectored(ctx, f, "pwritev", unix.Pwritev, pathErr("pwritev", f, unix.ENOSPC), iov, off, check)
}

// vectored runs call until iov is done, continuing short transfers; a
// transfer of nothing ends it with onZero (EOF for reads, ENOSPC for
// writes).
func vectored(ctx context.Context, f File, op string, call func(int, [][]byte, int64) (int, error), onZero error, iov [][]byte, off int64, check func(context.Context, string) error) (int, error) {
	iov = append([][]byte(nil), iov...)
	total := 0
	for len(iov) > 0 {
		if err := check(ctx, op); err != nil {
			return total, err
		}
		n, err := call(f.Fd(), iov, off+int64(total))
		if err == unix.EINTR || err == unix.EAGAIN {
			continue
		}
		if err != nil {
			return total, pathErr(op, f, err)
		}
		if n == 0 {
			return total, onZero
		}
		total += n
		iov = advance(iov, n)
	}
	return total, nil
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
