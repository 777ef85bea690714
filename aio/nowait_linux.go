package aio

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// PreadNoWait is preadv2(fd, {p}, off, RWF_NOWAIT): it reads from the page
// cache and fails with EAGAIN instead of waiting for a device. It builds its
// single iovec on the stack, so the hot path does not allocate.
func PreadNoWait(fd int, p []byte, off int64) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	iov := unix.Iovec{Base: &p[0]}
	iov.SetLen(len(p))
	n, _, errno := unix.Syscall6(unix.SYS_PREADV2, uintptr(fd), uintptr(unsafe.Pointer(&iov)), 1,
		uintptr(off), uintptr(uint64(off)>>32>>32), unix.RWF_NOWAIT)
	if errno != 0 {
		return int(n), errno
	}
	return int(n), nil
}
