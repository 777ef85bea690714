package formats

import (
	"context"

	"github.com/blockexport/blockexport/aio"
)

// PageLender is an Image that can answer a read from the page cache of its
// host files without copying and without waiting: slices of their mappings
// for data (aio.PageSource), lent zeroes for holes, for a front end to
// writev (one system call where a read into a buffer costs two). Only
// images whose data never moves within their files while open lend: the
// read-only formats, a raw file, a read-only qcow2 image.
type PageLender interface {
	// TryLendAt appends [off, off+n) to v as slices in order and returns
	// it, with ok true when every byte was lent without waiting. ok
	// false: some part would wait or cannot be lent, v is to be thrown
	// away, and the caller reads instead (TryReadAt, ReadAt). The slices
	// stay valid until the image is closed; they are for the kernel (a
	// writev), never read in Go.
	TryLendAt(off, n int64, v [][]byte) ([][]byte, bool)
}

// CacheLender is an Image (or the file under one) that can lend the
// bytes of a range where they lie in a memory cache of its own (a remote
// object's blocks, fetched first if it must), until the caller releases
// them, so that a front end replies from them instead of a copy.
type CacheLender interface {
	// CanLend says whether LendAt may lend anything at all (a raw image
	// lends only when its file does), so that front ends ask only then.
	CanLend() bool
	// LendAt returns [off, off+n) as slices in order, readable until
	// release is called (and only until then); max bounds how many
	// slices. ok false: nothing is lent (the range is not lendable,
	// would take more slices, or passes the end), and the caller reads
	// with ReadAt; err is a read's error (ok is true with it).
	LendAt(ctx context.Context, off, n int64, max int) (bufs [][]byte, release func(), ok bool, err error)
}

// LendFile appends [host, host+n) of host file f to v, if f lends and
// every page is resident.
func LendFile(f aio.File, v [][]byte, host, n int64) ([][]byte, bool) {
	l, ok := f.(aio.PageSource)
	if !ok {
		return v, false
	}
	b, ok := l.TryLend(host, n)
	if !ok {
		return v, false
	}
	return append(v, b), true
}

// LendZeroes appends n zero bytes to v, lent by host file f (a hole of
// the image that f holds).
func LendZeroes(f aio.File, v [][]byte, n int64) ([][]byte, bool) {
	l, ok := f.(aio.PageSource)
	if !ok {
		return v, false
	}
	for n > 0 {
		k := min(n, aio.LendZeroes)
		z, ok := l.Zeroes(int(k))
		if !ok {
			return v, false
		}
		v = append(v, z)
		n -= k
	}
	return v, true
}

// TryLend is img's TryLendAt where it lends (a backing image, say), else
// false.
func TryLend(img Image, off, n int64, v [][]byte) ([][]byte, bool) {
	l, ok := img.(PageLender)
	if !ok {
		return v, false
	}
	return l.TryLendAt(off, n, v)
}
