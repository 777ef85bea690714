// Package hostfile answers what the formats ask of the host file under an
// image: where its holes are (qemu-img map's zero runs) and how much it
// has allocated (qemu-img info's actual-size). Raw, qcow2, vmdk's flat
// extents and fixed vdi and vpc images ask the same two questions.
package hostfile

import (
	"errors"

	"golang.org/x/sys/unix"
)

// Run is how many of the n bytes at off in the file fd are all hole (zero
// true: they read as zeroes, nothing allocated) or all data, from off on.
// Past the file's end is one hole; a host without SEEK_DATA has data
// everywhere, so the whole n is data.
func Run(fd int, off, n int64) (length int64, zero bool) {
	data, err := unix.Seek(fd, off, unix.SEEK_DATA)
	switch {
	case errors.Is(err, unix.ENXIO):
		return n, true // no data from off to the end
	case err != nil:
		return n, false
	case data > off:
		return min(n, data-off), true
	}
	end, err := unix.Seek(fd, off, unix.SEEK_HOLE)
	if err != nil || end <= off {
		return n, false
	}
	return min(n, end-off), false
}

// Allocated is the bytes the host has allocated to the file fd (its
// blocks, not its length): qemu-img info's actual-size.
func Allocated(fd int) (int64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return 0, err
	}
	return st.Blocks * 512, nil
}
