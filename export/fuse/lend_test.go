package fuse

import (
	"bytes"
	"context"
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/blockexport/blockexport/formats"
)

// lender is an image that lends its bytes (as a remote object's cache
// does), counting loans and releases and what it was asked for.
type lender struct {
	formats.Image
	data            []byte
	loans, releases int
	lastOff, lastN  int64
	lastMax         int
}

func (l *lender) CanLend() bool { return true }

func (l *lender) LendAt(_ context.Context, off, n int64, maxBufs int) ([][]byte, func(), bool, error) {
	l.lastOff, l.lastN, l.lastMax = off, n, maxBufs
	if off < 0 || off+n > int64(len(l.data)) {
		return nil, nil, false, nil
	}
	l.loans++
	half := off + n/2
	return [][]byte{l.data[off:half], l.data[half : off+n]}, func() { l.releases++ }, true, nil
}

// A read of a lending image is lent within the image (clamped at its end
// as any read), at most maxLent slices; a read past the end is not lent.
func TestCacheLendClampsAndLends(t *testing.T) {
	const size = 10000
	img := &lender{Image: newNull(t, size), data: make([]byte, size)}
	for i := range img.data {
		img.data[i] = byte(i * 7)
	}
	e := New(img, Options{})
	bufs, release, st, ok := lendFromCache(e, &fuse.ReadIn{Offset: 8000, Size: 4096})
	if !ok || st != fuse.OK || release == nil {
		t.Fatalf("read across the end: ok %v, st %v", ok, st)
	}
	if got := bytes.Join(bufs, nil); !bytes.Equal(got, img.data[8000:]) {
		t.Fatalf("read across the end lent %d bytes, want the last 2000", len(got))
	}
	if img.lastMax != maxLent {
		t.Fatalf("asked for at most %d slices, want %d", img.lastMax, maxLent)
	}
	release()
	if img.loans != 1 || img.releases != 1 {
		t.Fatalf("%d loans, %d releases", img.loans, img.releases)
	}
	// A READ larger than maxWrite is cut to it.
	big := &lender{Image: newNull(t, 2*maxWrite), data: make([]byte, 2*maxWrite)}
	if _, release, _, ok := lendFromCache(New(big, Options{}), &fuse.ReadIn{Offset: 0, Size: 2 * maxWrite}); !ok || big.lastN != maxWrite {
		t.Fatalf("read cut to maxWrite: ok %v, lent %d bytes", ok, big.lastN)
	} else {
		release()
	}
	for _, off := range []uint64{size, size + 1, 1 << 63} {
		if _, _, _, ok := lendFromCache(e, &fuse.ReadIn{Offset: off, Size: 4096}); ok {
			t.Fatalf("read at %d (past the end) was lent", off)
		}
	}
	// An image that does not lend is not asked to.
	if _, _, _, ok := lendFromCache(New(newNull(t, size), Options{}), &fuse.ReadIn{Size: 4096}); ok {
		t.Fatal("the null image lent a read")
	}
}
