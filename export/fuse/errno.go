package fuse

import (
	"context"
	"errors"
	"syscall"

	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/blockexport/blockexport/formats"
)

// errno maps an image error to the one errno the kernel gets: the sentinel
// errors by meaning, host errors by their own errno, the rest EIO.
func errno(err error) fuse.Status {
	var en syscall.Errno
	switch {
	case err == nil:
		return fuse.OK
	case errors.Is(err, formats.ErrReadOnly):
		return fuse.EACCES
	case errors.Is(err, formats.ErrNotSupported):
		return fuse.Status(syscall.EOPNOTSUPP)
	case errors.Is(err, formats.ErrOutOfRange):
		return fuse.EINVAL
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return fuse.EINTR
	case errors.As(err, &en):
		if en == syscall.ENOTSUP {
			return fuse.Status(syscall.EOPNOTSUPP)
		}
		return fuse.Status(en)
	}
	return fuse.EIO
}
