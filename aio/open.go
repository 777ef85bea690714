package aio

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// ErrNotImage marks a path that is neither a regular file nor a block
// device, so it cannot hold an image.
var ErrNotImage = errors.New("not a regular file or block device")

// OpenHostFile opens an image's host file with flag (os.O_RDONLY, O_RDWR,
// O_DIRECT...): only a regular file or a block device. A FIFO would block
// the open and every read until a writer came, so the file is opened
// non-blocking (cleared again after) and a FIFO refused at once.
func OpenHostFile(path string, flag int) (*os.File, error) {
	f, err := os.OpenFile(path, flag|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return nil, fmt.Errorf("stat %s: %w", path, err)
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG, unix.S_IFBLK:
	default:
		f.Close()
		return nil, fmt.Errorf("%s is a %s: %w", path, FileType(st.Mode), ErrNotImage)
	}
	// Regular files and block devices ignore O_NONBLOCK for I/O, but clear
	// it anyway so that nothing depends on that.
	fl, err := unix.FcntlInt(f.Fd(), unix.F_GETFL, 0)
	if err == nil {
		_, err = unix.FcntlInt(f.Fd(), unix.F_SETFL, fl&^unix.O_NONBLOCK)
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: clear O_NONBLOCK: %w", path, err)
	}
	return f, nil
}

// FileType names the type of a file that is not a regular one, by its
// stat mode, for an error ("FIFO", "directory"...).
func FileType(mode uint32) string {
	switch mode & unix.S_IFMT {
	case unix.S_IFIFO:
		return "FIFO"
	case unix.S_IFDIR:
		return "directory"
	case unix.S_IFCHR:
		return "character device"
	case unix.S_IFBLK:
		return "block device"
	case unix.S_IFLNK:
		return "symbolic link"
	case unix.S_IFSOCK:
		return "socket"
	}
	return fmt.Sprintf("file of type %#o", mode&unix.S_IFMT)
}
