package aio_test

import (
	"bytes"
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/aio/aiotest"
	"golang.org/x/sys/unix"
)

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
// whole (through every read path: ReadAt, ReadvAt, TryReadAt after a
// buffered read brought pages in) returns its bytes and leaves none of
// the pages it brought in cached; without it, the same reads leave them.
func TestDropBehindReadsLeaveNothingCached(t *testing.T) {
	const size = 4 << 20
	data := make([]byte, size)
	r := rand.New(rand.NewPCG(1, 2))
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	path := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, backend := range []aio.Backend{aio.IOUring, aio.Threads} {
		for _, drop := range []bool{false, true} {
			f, err := aio.Open(path, aio.Options{Backend: backend})
			if err != nil {
				t.Fatal(err)
			}
			if drop && !aio.SetDropBehind(f) {
				f.Close()
				t.Skipf("the file system of %s refuses RWF_DONTCACHE", path)
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
			f.Close()
			switch {
			case drop && k > 16: // read-ahead past what was read may linger at the end
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
