package formats

import "github.com/blockexport/blockexport/aio"

// PageLender is an Image that can answer a read from the page cache of
// its host files without copying: slices of their mappings for data
// (aio.Lender), lent zeroes for holes. A front end that replies with a
// writev then writes the reply straight from there, one system call
// where a read into a buffer costs two (see aio.Lender for what that is
// worth). Only images whose data never moves within their files while
// they are open lend: the read-only formats, a raw file, a qcow2 image
// opened read-only (a writable one may free and reuse a cluster between
// the lend and the writev).
type PageLender interface {
	// TryLendAt appends [off, off+n) to v as slices in order and returns
	// it, with ok true when every byte was lent without waiting. ok
	// false: some part would wait or cannot be lent, v is to be thrown
	// away, and the caller reads instead (TryReadAt, ReadAt). The slices
	// stay valid until the image is closed; they are for the kernel (a
	// writev), never read in Go.
	TryLendAt(off, n int64, v [][]byte) ([][]byte, bool)
}

// LendFile appends [host, host+n) of host file f to v, if f lends and
// every page is resident.
func LendFile(f aio.File, v [][]byte, host, n int64) ([][]byte, bool) {
	l, ok := f.(aio.Lender)
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
	l, ok := f.(aio.Lender)
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

// LendRuns is TryLendAt for an image of one host file f whose locate
// maps an offset to the run of bytes from there on that lie together:
// at host in f (mapped), or a hole that reads as zeroes. (vdi, vpc.)
func LendRuns(f aio.File, v [][]byte, off, n int64, locate func(off int64) (host, run int64, mapped bool)) ([][]byte, bool) {
	ok := true
	for done := int64(0); done < n && ok; {
		host, run, mapped := locate(off + done)
		k := min(n-done, run)
		if k <= 0 {
			return v, false
		}
		if mapped {
			v, ok = LendFile(f, v, host, k)
		} else {
			v, ok = LendZeroes(f, v, k)
		}
		done += k
	}
	return v, ok
}
