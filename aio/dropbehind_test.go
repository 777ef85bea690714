package aio_test

import (
	"bytes"
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/aio/aiotest"
	"golang.org/x/sys/unix"
)

// cachedAfter waits up to 10 s for the page cache to hold no page of
// [from, to) of path, and returns how many it holds at the end.
func cachedAfter(t *testing.T, path string, from, to int) int {
	t.Helper()
	k := 0
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		k = residentIn(t, path, from, to)
		if k == 0 || time.Now().After(deadline) {
			return k
		}
	}
}

// residentIn is how many pages of [from, to) of path the page cache
// holds.
func residentIn(t *testing.T, path string, from, to int) int {
	t.Helper()
	k := residentPages(t, path, to)
	if from > 0 {
		k -= residentPages(t, path, from)
	}
	return k
}

// residentPages is how many pages of [0, n) of path the page cache holds.
func residentPages(t *testing.T, path string, n int) int {
	t.Helper()
	k, err := aiotest.Resident(path, n)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// TestDropBehindReadsLeaveNothingCached: with drop-behind on, a file read
// whole (ReadAt, ReadvAt) returns its bytes and leaves none of the pages
// it brought in cached, its file still open (every granule was read
// whole); without it, the same reads leave them.
func TestDropBehindReadsLeaveNothingCached(t *testing.T) {
	const size = 4 << 20
	path, data := randomFile(t, size)
	for _, backend := range []aio.Backend{aio.IOUring, aio.Threads} {
		for _, drop := range []bool{false, true} {
			f, err := aio.Open(path, aio.Options{Backend: backend})
			if err != nil {
				t.Fatal(err)
			}
			if drop && !aio.SetDropBehind(f) {
				f.Close()
				t.Fatal("SetDropBehind refused a buffered file")
			}
			// Out of the cache first (written back, then dropped).
			unix.Fdatasync(f.Fd())
			if err := unix.Fadvise(f.Fd(), 0, size, unix.FADV_DONTNEED); err != nil {
				t.Fatal(err)
			}
			if k := residentPages(t, path, size); k != 0 {
				t.Fatalf("%d pages still cached after FADV_DONTNEED", k)
			}
			ctx := context.Background()
			got := make([]byte, size)
			half := size / 2
			if _, err := f.ReadAt(ctx, got[:half], 0); err != nil {
				t.Fatal(err)
			}
			if _, err := f.ReadvAt(ctx, [][]byte{got[half : half+4096], got[half+4096:]}, int64(half)); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, data) {
				t.Fatalf("%s drop-behind %v: reads back wrong", backend, drop)
			}
			k := residentPages(t, path, size)
			if drop {
				k = cachedAfter(t, path, 0, size)
			}
			f.Close()
			switch {
			case drop && k > 0:
				t.Fatalf("%s drop-behind: %d of %d pages left cached after the reads", backend, k, size/4096)
			case !drop && k < size/4096/2:
				t.Fatalf("%s without drop-behind: only %d of %d pages cached after the reads (the test cannot tell the two apart)", backend, k, size/4096)
			}
		}
	}
}

// TestDropBehindRefusedForDirect: an O_DIRECT file has no pages to drop.
func TestDropBehindRefusedForDirect(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(path, make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := aio.Open(path, aio.Options{Direct: true})
	if err != nil {
		t.Skipf("O_DIRECT: %v", err)
	}
	defer f.Close()
	if aio.SetDropBehind(f) {
		t.Fatal("SetDropBehind on an O_DIRECT file said yes")
	}
}

// randomFile writes size random bytes to a new file.
func randomFile(t *testing.T, size int) (string, []byte) {
	t.Helper()
	data := make([]byte, size)
	r := rand.New(rand.NewPCG(3, 4))
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	path := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return path, data
}

// dropBehindFile writes size random bytes to a new file, drops it from
// the page cache, and opens it with drop-behind on, sweeping every idle.
func dropBehindFile(t *testing.T, backend aio.Backend, size int, idle time.Duration) (aio.File, string, []byte) {
	t.Helper()
	path, data := randomFile(t, size)
	f, err := aio.Open(path, aio.Options{Backend: backend})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	if !aio.SetDropBehindIdle(f, idle) {
		t.Fatal("SetDropBehind refused a buffered file")
	}
	unix.Fdatasync(f.Fd())
	if err := unix.Fadvise(f.Fd(), 0, int64(size), unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	return f, path, data
}

// willNeed brings [off, off+n) of path into the page cache, as
// read-ahead would (from an open of its own: FADV_RANDOM on the file
// under test stops FADV_WILLNEED there), and waits until it is all there.
func willNeed(t *testing.T, path string, off, n int) {
	t.Helper()
	g, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	for c := off; c < off+n; c += 2 << 20 { // one call reads in one read-ahead window at most
		if err := unix.Fadvise(int(g.Fd()), int64(c), int64(min(2<<20, off+n-c)), unix.FADV_WILLNEED); err != nil {
			t.Fatal(err)
		}
	}
	k := 0
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		k = residentIn(t, path, off, off+n)
		if k == n/4096 || time.Now().After(deadline) {
			break
		}
	}
	if k != n/4096 {
		t.Fatalf("FADV_WILLNEED brought in %d of %d pages", k, n/4096)
	}
}

// TestDropBehindKeepsAGranuleUntilRead: the pages of a granule that a
// read has not reached yet (here brought in by FADV_WILLNEED, as the
// file's read-ahead brings them) stay cached while reads work through
// the granule, and leave with its last block: a drop per read (as
// RWF_DONTCACHE's, of whole folios) loses read-ahead a reader is about to
// use. Random and unaligned read sizes, so the marks cross pages; sweeps
// held off, so that a slow machine cannot sweep the granule midway.
func TestDropBehindKeepsAGranuleUntilRead(t *testing.T) {
	const granule = 2 << 20
	for _, backend := range []aio.Backend{aio.IOUring, aio.Threads} {
		f, path, data := dropBehindFile(t, backend, 2*granule, time.Hour)
		willNeed(t, path, 0, granule)
		r := rand.New(rand.NewPCG(5, 6))
		got := make([]byte, granule)
		for off := 0; off < granule; {
			n := min(1+r.IntN(300_000), granule-off)
			if _, err := f.ReadAt(context.Background(), got[off:off+n], int64(off)); err != nil {
				t.Fatal(err)
			}
			// The pages after the one this read ended in, not read
			// yet, are all still cached.
			if from := (off + n + 4095) / 4096; from < granule/4096 {
				k := residentIn(t, path, from*4096, granule)
				if k != granule/4096-from {
					t.Fatalf("%s: after reading to %d, %d of the %d pages not yet read are cached", backend, off+n, k, granule/4096-from)
				}
			}
			off += n
		}
		if !bytes.Equal(got, data[:granule]) {
			t.Fatalf("%s: the granule reads back wrong", backend)
		}
		if k := cachedAfter(t, path, 0, granule); k != 0 {
			t.Fatalf("%s: %d pages of a granule read whole still cached", backend, k)
		}
	}
}

// TestDropBehindSweepsWhatIsReadInPart: pages of granules read only in
// part (the end of a file, a random reader) leave the cache once no read
// has reached them for a while, within a few seconds; right after the
// read they are still there.
func TestDropBehindSweepsWhatIsReadInPart(t *testing.T) {
	const size = 8 << 20
	for _, backend := range []aio.Backend{aio.IOUring, aio.Threads} {
		f, path, data := dropBehindFile(t, backend, size, 2*time.Second)
		got := make([]byte, 4096)
		for _, off := range []int64{0, 3 << 20, size - 4096} {
			if _, err := f.ReadvAt(context.Background(), [][]byte{got[:100], got[100:]}, off); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, data[off:off+4096]) {
				t.Fatalf("%s: %d reads back wrong", backend, off)
			}
		}
		if k := residentPages(t, path, size); k < 3 {
			t.Fatalf("%s: only %d pages cached right after three reads (the test cannot tell a sweep from none)", backend, k)
		}
		if k := cachedAfter(t, path, 0, size); k > 0 {
			t.Fatalf("%s: %d pages read in part still cached after 10 s", backend, k)
		}
	}
}

// TestDropBehindDropsReadAheadPastWhereReadsStop: a reader that stops
// partway leaves the pages the file's read-ahead brought in past it
// (here FADV_WILLNEED brings them, reads themselves read nothing ahead:
// FADV_RANDOM), granules no read reached; they leave the cache too,
// within seconds, and so do they when the file is closed right after the
// reads (close drops what is tracked, without waiting for a sweep). A
// review found 1408 such pages left after a 2 MiB sequential read of a
// 16 MiB file, for good.
func TestDropBehindDropsReadAheadPastWhereReadsStop(t *testing.T) {
	const size, stop = 16 << 20, 3 << 20 // a granule and a half read
	for _, backend := range []aio.Backend{aio.IOUring, aio.Threads} {
		for _, closeAtOnce := range []bool{false, true} {
			f, path, _ := dropBehindFile(t, backend, size, time.Second)
			if err := unix.Fadvise(f.Fd(), 0, size, unix.FADV_RANDOM); err != nil {
				t.Fatal(err)
			}
			// The read-ahead first: the sweeps start with the first
			// read, and a slow machine bringing it in after the reads
			// could have it come in after the sweep that drops it.
			willNeed(t, path, stop, size-stop)
			buf := make([]byte, 128<<10)
			for off := 0; off < stop; off += len(buf) {
				if _, err := f.ReadAt(context.Background(), buf, int64(off)); err != nil {
					t.Fatal(err)
				}
			}
			if closeAtOnce {
				f.Close()
				if k := residentPages(t, path, size); k != 0 {
					t.Fatalf("%s: %d pages cached right after close", backend, k)
				}
				continue
			}
			if k := cachedAfter(t, path, 0, size); k != 0 {
				t.Fatalf("%s: %d pages cached 10 s after the reads stopped", backend, k)
			}
		}
	}
}

// TestDropBehindCountsTryReadAt: reads from the page cache (TryReadAt,
// what the FUSE serve loop tries first) count as reads: a granule read
// whole through it leaves the cache.
func TestDropBehindCountsTryReadAt(t *testing.T) {
	const granule = 2 << 20
	for _, backend := range []aio.Backend{aio.IOUring, aio.Threads} {
		f, path, data := dropBehindFile(t, backend, 2*granule, time.Hour)
		// Cached by another open of the file, so TryReadAt hits.
		if _, err := os.ReadFile(path); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, granule)
		for off := 0; off < granule; off += 64 << 10 {
			if !f.TryReadAt(got[off:off+64<<10], int64(off)) {
				t.Fatalf("%s: TryReadAt missed at %d, the file read whole just before", backend, off)
			}
		}
		if !bytes.Equal(got, data[:granule]) {
			t.Fatalf("%s: TryReadAt read back wrong", backend)
		}
		if k := cachedAfter(t, path, 0, granule); k != 0 {
			t.Fatalf("%s: %d pages of a granule read whole by TryReadAt still cached", backend, k)
		}
	}
}
