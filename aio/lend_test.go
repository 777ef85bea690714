package aio

import (
	"bytes"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// lendFile writes size bytes of a pattern to a new file and opens it
// with each backend, its pages dropped from the cache first when cold.
func lendFile(t *testing.T, size int, cold bool) ([]byte, map[Backend]File) {
	t.Helper()
	data := make([]byte, size)
	r := rand.New(rand.NewPCG(1, 2))
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	path := filepath.Join(t.TempDir(), "img")
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	if cold {
		f, err := os.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		unix.Fdatasync(int(f.Fd()))
		if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
			t.Fatal(err)
		}
		f.Close()
	}
	return data, openBoth(t, path, Options{})
}

// A resident range is lent as the file's bytes, across chunk boundaries
// and at the file's end; a range that is not, or not wholly, is refused,
// and so are ranges out of bounds, near 2^63 included.
func TestTryLendResidentPages(t *testing.T) {
	const size = 5<<20 + 1234 // three chunks, the last partial
	data, files := lendFile(t, size, false)
	for b, f := range files {
		l := f.(PageSource)
		for _, c := range []struct{ off, n int64 }{
			{0, 1}, {0, 4096}, {4095, 2}, {lendChunk - 100, 200}, {lendChunk - 4096, 1 << 20},
			{2*lendChunk - 1, size - 2*lendChunk + 1}, {size - 4096, 4096}, {size - 1, 1}, {12345, 1 << 20},
		} {
			got, ok := l.TryLend(c.off, c.n)
			if !ok {
				t.Fatalf("%s: [%d, +%d) of a file just written: not lent", b, c.off, c.n)
			}
			if !bytes.Equal(got, data[c.off:c.off+c.n]) || cap(got) != int(c.n) {
				t.Fatalf("%s: [%d, +%d): lent bytes differ from the file's (cap %d)", b, c.off, c.n, cap(got))
			}
		}
		// Past the end: pages that do not exist are never resident.
		for _, c := range []struct{ off, n int64 }{
			{size - 1, 4097}, {size + 4096, 4096}, {8 << 20, 1}, {-1, 10}, {0, 0}, {0, -5},
			{lendMapMax - 1, 2}, {lendMapMax, 1}, {1 << 62, 1 << 62}, {1, 1<<63 - 1}, {1<<63 - 1, 1},
		} {
			if _, ok := l.TryLend(c.off, c.n); ok {
				t.Fatalf("%s: [%d, +%d) lent", b, c.off, c.n)
			}
		}
		z, ok := l.Zeroes(LendZeroes)
		if !ok || len(z) != LendZeroes || !bytes.Equal(z, make([]byte, LendZeroes)) {
			t.Fatalf("%s: Zeroes(%d): %v, not all zero", b, LendZeroes, ok)
		}
		if _, ok := l.Zeroes(LendZeroes + 1); ok {
			t.Fatalf("%s: Zeroes past LendZeroes", b)
		}
		if _, ok := l.Zeroes(-1); ok {
			t.Fatalf("%s: Zeroes(-1)", b)
		}
		f.Close()
		if _, ok := l.TryLend(0, 4096); ok {
			t.Fatalf("%s: lent after Close", b)
		}
		if _, ok := l.Zeroes(10); ok {
			t.Fatalf("%s: zeroes lent after Close", b)
		}
	}
}

// Pages not in the page cache are not lent (a loop that lent them would
// wait for the disk in its writev); once read, they are, after the
// recheck interval.
func TestTryLendRefusesPagesNotCached(t *testing.T) {
	data, files := lendFile(t, 3<<20, true)
	for b, f := range files {
		l := f.(PageSource)
		// The other backend's file read the page back in, and its
		// mapping holds it (until its next zap).
		for _, o := range files {
			lendState(o).zap()
		}
		if err := unix.Fadvise(f.Fd(), 0, 0, unix.FADV_DONTNEED); err != nil {
			t.Fatal(err)
		}
		if _, ok := l.TryLend(lendChunk+8192, 4096); ok {
			t.Fatalf("%s: a dropped page was lent", b)
		}
		p := make([]byte, 4096)
		if _, err := f.ReadAt(t.Context(), p, lendChunk+8192); err != nil {
			t.Fatal(err)
		}
		var got []byte
		ok := false
		for range 200 {
			if got, ok = l.TryLend(lendChunk+8192, 4096); ok {
				break
			}
			unix.Nanosleep(&unix.Timespec{Nsec: int64(recheckAfter)}, nil)
		}
		if !ok || !bytes.Equal(got, data[lendChunk+8192:lendChunk+12288]) {
			t.Fatalf("%s: a page read back in: lent %v", b, ok)
		}
		if _, ok := l.TryLend(lendChunk+8192, 8192); ok {
			t.Fatalf("%s: a range with a dropped page lent", b)
		}
	}
}

// An O_DIRECT file has no page cache to lend from.
func TestTryLendNotDirect(t *testing.T) {
	path := filepath.Join(t.TempDir(), "img")
	if err := os.WriteFile(path, make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	for b, f := range openBoth(t, path, Options{Direct: true}) {
		if _, ok := f.(PageSource).TryLend(0, 4096); ok {
			t.Fatalf("%s: O_DIRECT file lent", b)
		}
	}
}

func lendState(f File) *pageMap {
	switch f := f.(type) {
	case *uringFile:
		return &f.lend
	case *threadFile:
		return &f.lend
	}
	panic("no lending state")
}

// Pages a lend mapped into the process are unmapped zapAfter later, so
// that POSIX_FADV_DONTNEED (and drop_caches, and reclaim) can drop them
// again once the reader is gone.
func TestLentPagesAreUnmappedAfterwards(t *testing.T) {
	_, files := lendFile(t, 1<<20, false)
	for b, f := range files {
		got, ok := f.(PageSource).TryLend(0, 1<<20)
		if !ok {
			t.Fatalf("%s: not lent", b)
		}
		var sum byte
		for i := 0; i < len(got); i += 4096 { // maps the pages, as a writev's copy does
			sum += got[i]
		}
		t.Logf("%s: lent, sum of first bytes %d", b, sum)
		// Lent again after the touch: had the unmap run between the lend
		// and the touch (a stalled test), the touch would have mapped the
		// pages again for good; a lend schedules the next unmap.
		f.(PageSource).TryLend(0, 4096)
	}
	for b, f := range files {
		// The unmap runs zapAfter after the last lend, on a timer: a
		// loaded machine may run it late, so poll for the drop.
		n := 0
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			unix.Fdatasync(f.Fd()) // FADV_DONTNEED leaves dirty pages
			if err := unix.Fadvise(f.Fd(), 0, 0, unix.FADV_DONTNEED); err != nil {
				t.Fatal(err)
			}
			m, err := unix.Mmap(f.Fd(), 0, 1<<20, unix.PROT_READ, unix.MAP_SHARED)
			if err != nil {
				t.Fatal(err)
			}
			vec := make([]byte, 256)
			err = mincore(m, vec)
			unix.Munmap(m)
			if err != nil {
				t.Fatal(err)
			}
			if n = bytes.Count(vec, []byte{0}); n >= 200 || time.Now().After(deadline) {
				break
			}
		}
		if n < 200 {
			t.Fatalf("%s: %d of 256 pages dropped by FADV_DONTNEED 5 s after the lend", b, n)
		}
	}
}
