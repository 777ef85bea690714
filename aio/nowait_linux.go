package aio

import (
	"context"
	"unsafe"

	"golang.org/x/sys/unix"
)

// preadNoWait is preadv2(fd, {p}, off, RWF_NOWAIT): it reads from the
// page cache and fails with EAGAIN instead of waiting for a device. It
// builds its single iovec on the stack, so the hot path does not
// allocate.
func preadNoWait(fd int, p []byte, off int64) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	iov := unix.Iovec{Base: &p[0]}
	iov.SetLen(len(p))
	n, _, errno := unix.Syscall6(unix.SYS_PREADV2, uintptr(fd), uintptr(unsafe.Pointer(&iov)), 1,
		uintptr(off), uintptr(uint64(off)>>32>>32), uintptr(unix.RWF_NOWAIT))
	if errno != 0 {
		return int(n), errno
	}
	return int(n), nil
}

// tryRead is TryReadAt for a file that is not closed: the whole of p from
// the page cache, or nothing. A short read (the end of the file, or only
// part cached) counts as a miss: ReadAt sorts that out.
func tryRead(fd int, direct bool, p []byte, off int64) bool {
	if direct || len(p) == 0 {
		return false
	}
	n, err := preadNoWait(fd, p, off)
	return err == nil && n == len(p)
}

// tryWrite is TryWriteAt: a buffered write lands in the page cache, so it
// is written from the caller (file systems without non-blocking buffered
// writes — ext4 answers RWF_NOWAIT writes with EOPNOTSUPP — would make
// io_uring punt every one to a worker thread); an O_DIRECT one would wait
// for the device.
func tryWrite(f File, direct bool, check func(context.Context, string) error, p []byte, off int64) (bool, error) {
	if direct {
		return false, nil
	}
	_, err := transfer(context.Background(), f, true, [][]byte{p}, off, check)
	return true, err
}
