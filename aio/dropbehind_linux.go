package aio

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// Drop-behind reads (RWF_DONTCACHE, Linux 6.14+): a buffered read still
// goes through the page cache, so it is read ahead as usual and finds
// what is cached, but the pages it brings in leave the cache once read.
// A front end that caches what it serves (the FUSE export under the
// kernel cache) turns it on for the image's host files, so that the same
// bytes are not held twice, once for the export and once for the file,
// while the file keeps the disk's read-ahead that O_DIRECT (--cache none)
// gives up.

// dropBehinder is what files that can read drop-behind implement.
type dropBehinder interface {
	setDropBehind() bool
}

// SetDropBehind makes f's reads drop-behind from now on, where f is a
// buffered host file whose file system supports it; it says whether it
// did. Set it before f serves reads: a read already under way keeps the
// flags it started with.
func SetDropBehind(f File) bool {
	d, ok := f.(dropBehinder)
	return ok && d.setDropBehind()
}

// dropBehindSupported asks the file system with a one-byte drop-behind
// read at offset 0 (pages that were cached before stay cached): file
// systems without it, and kernels before 6.14, refuse the flag.
func dropBehindSupported(fd int) bool {
	var b [1]byte
	iov := unix.Iovec{Base: &b[0]}
	iov.SetLen(1)
	for {
		_, _, errno := unix.Syscall6(unix.SYS_PREADV2, uintptr(fd), uintptr(unsafe.Pointer(&iov)), 1, 0, 0, unix.RWF_DONTCACHE)
		if errno == unix.EINTR || errno == unix.EAGAIN {
			continue
		}
		return errno == 0
	}
}
