package aio

import (
	"bytes"
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// TestAlignedTakesAnyRequest: unaligned reads, writes and vectored writes
// on an O_DIRECT file, from goroutines whose byte ranges interleave inside
// the same blocks (so read-modify-write must not undo a neighbour), end
// with the file equal to a mirror of the same writes.
func TestAlignedTakesAnyRequest(t *testing.T) {
	for _, backend := range []Backend{IOUring, Threads} {
		t.Run(string(backend), func(t *testing.T) {
			const size = 1 << 20
			path := filepath.Join(t.TempDir(), "direct")
			if err := os.WriteFile(path, make([]byte, size), 0o644); err != nil {
				t.Fatal(err)
			}
			raw, err := Open(path, Options{Backend: backend, Writable: true, Direct: true})
			if err != nil {
				t.Skipf("O_DIRECT not available here: %v", err)
			}
			f := Aligned(raw, LogicalBlockSize(raw.Fd()))
			defer f.Close()
			ctx := context.Background()
			mirror := make([]byte, size)
			const workers = 4
			var wg sync.WaitGroup
			errs := make(chan error, workers)
			for w := range workers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					r := rand.New(rand.NewPCG(1, uint64(w)))
					for range 300 {
						// Worker w owns bytes whose index%16 is in [4w, 4w+4):
						// every request touches blocks other workers write too.
						off := int64(r.IntN(size/16-64))*16 + int64(4*w)
						p := []byte{byte(r.Uint32()), byte(r.Uint32()), byte(r.Uint32()), byte(r.Uint32())}
						var err error
						if r.IntN(2) == 0 {
							_, err = f.WriteAt(ctx, p, off)
						} else {
							_, err = f.WritevAt(ctx, [][]byte{p[:1], p[1:]}, off)
						}
						if err != nil {
							errs <- err
							return
						}
						copy(mirror[off:], p) // disjoint bytes per worker
						got := make([]byte, 3)
						if _, err := f.ReadAt(ctx, got, off+1); err != nil {
							errs <- err
							return
						}
						if !bytes.Equal(got, p[1:]) {
							errs <- errors.New("an unaligned read does not see the write before it")
							return
						}
					}
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatal(err)
			}
			got := make([]byte, size)
			iov := [][]byte{got[:1000], got[1000:]}
			if n, err := f.ReadvAt(ctx, iov, 0); err != nil || n != size {
				t.Fatalf("readv: %d, %v", n, err)
			}
			if !bytes.Equal(got, mirror) {
				t.Fatal("the file differs from the mirror of the writes")
			}
			// Reads across the end of the file stop there.
			tail := make([]byte, 700)
			n, err := f.ReadAt(ctx, tail, size-300)
			if n != 300 || !errors.Is(err, io.EOF) || !bytes.Equal(tail[:300], mirror[size-300:]) {
				t.Fatalf("read across EOF: %d, %v", n, err)
			}
		})
	}
}
