package aio

import (
	"fmt"
	"io"

	"golang.org/x/sys/unix"
)

// Sized is implemented by a File that has no host descriptor behind it (a
// remote object: Fd returns -1). Formats ask it, through FileSize and
// HasFd, what they would otherwise ask fstat and lseek.
type Sized interface {
	// Size is the file's length in bytes, fixed for the file's life.
	Size() int64
}

// HasFd says whether f is a host file that fstat, lseek(SEEK_DATA) and
// ftruncate may be called on. A remote file is not: its size comes from
// FileSize, and everything in it is data.
func HasFd(f File) bool { return f.Fd() >= 0 }

// FileSize is the length of f: lseek(SEEK_END) on a host file (a block
// device's size too), Size on a file without a descriptor.
func FileSize(f File) (int64, error) {
	if !HasFd(f) {
		if s, ok := f.(Sized); ok {
			return s.Size(), nil
		}
		return 0, fmt.Errorf("%s: no descriptor and no size", f.Name())
	}
	n, err := unix.Seek(f.Fd(), 0, io.SeekEnd)
	if err != nil {
		return 0, fmt.Errorf("size of %s: %w", f.Name(), err)
	}
	return n, nil
}
