package qcow2

import (
	"bytes"
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/blockexport/blockexport/formats"
)

// gatedImage holds its first ReadAt until release is closed, after
// saying so on entered: a copy-on-read caught reading the backing file.
type gatedImage struct {
	formats.Image
	once     atomic.Bool
	entered  chan struct{}
	release  chan struct{}
	readsAll atomic.Int64
}

func (g *gatedImage) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	g.readsAll.Add(1)
	if g.once.CompareAndSwap(false, true) {
		close(g.entered)
		<-g.release
	}
	return g.Image.ReadAt(ctx, p, off)
}

// corOverlay makes a raw backing file of random data with a hole and a
// qcow2 overlay over it (64 KiB clusters), and returns the overlay's
// path and the backing data.
func corOverlay(t *testing.T, size int64, compat string) (string, []byte) {
	t.Helper()
	dir := t.TempDir()
	data := make([]byte, size)
	fill(rand.New(rand.NewPCG(7, 7)), data)
	clear(data[size/4 : size/2]) // zeroes: copied as zero clusters
	base := filepath.Join(dir, "base.raw")
	if err := os.WriteFile(base, data, 0o644); err != nil {
		t.Fatal(err)
	}
	over := filepath.Join(dir, "over.qcow2")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "compat="+compat, "-b", base, "-F", "raw", over)
	return over, data
}

// TestCopyOnReadLosesNoGuestWrite: a guest write into the cluster a
// copy-on-read is copying (caught reading the backing file) waits for the
// copy and then wins: the cluster ends up with the guest's bytes over the
// backing file's, never the backing file's over the guest's.
func TestCopyOnReadLosesNoGuestWrite(t *testing.T) {
	ctx := context.Background()
	over, data := corOverlay(t, 1<<20, "1.1")
	q := openRW(t, over)
	g := &gatedImage{Image: q.backing, entered: make(chan struct{}), release: make(chan struct{})}
	q.backing = g

	readDone := make(chan error, 1)
	got := make([]byte, 4096)
	go func() {
		_, err := q.ReadCopy(ctx, got, 8192)
		readDone <- err
	}()
	<-g.entered
	guest := bytes.Repeat([]byte{0xbb}, 4096)
	var writeDone atomic.Bool
	writeErr := make(chan error, 1)
	go func() {
		_, err := q.WriteAt(ctx, guest, 4096)
		writeDone.Store(true)
		writeErr <- err
	}()
	time.Sleep(200 * time.Millisecond)
	if writeDone.Load() {
		t.Fatal("a guest write into a cluster being copied did not wait for the copy")
	}
	close(g.release)
	if err := <-readDone; err != nil {
		t.Fatal(err)
	}
	if err := <-writeErr; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data[8192:8192+4096]) {
		t.Fatal("copy-on-read returned other bytes than the backing file's")
	}
	want := bytes.Clone(data)
	copy(want[4096:], guest)
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	checkClean(t, over)
	compareRaw(t, over, want)
}

// TestCopyOnReadRacesGuestWrites: readers copy random ranges while
// writers write random blocks (each block one writer's, so the outcome is
// defined); the image ends as the backing data with the writes applied,
// and every cluster a reader touched is allocated in the overlay. Run
// with a v2 image too (no zero clusters: zeroes are copied as data).
func TestCopyOnReadRacesGuestWrites(t *testing.T) {
	for _, compat := range []string{"1.1", "0.10"} {
		t.Run(compat, func(t *testing.T) {
			ctx := context.Background()
			const size = 4 << 20
			over, data := corOverlay(t, size, compat)
			q := openRW(t, over)
			mirror := bytes.Clone(data)
			var wg sync.WaitGroup
			var mu sync.Mutex
			const blk, writers = 4096, 3
			for w := range writers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					r := rand.New(rand.NewPCG(uint64(w), 1))
					buf := make([]byte, blk)
					for range 300 {
						b := int64(w + writers*r.IntN(size/blk/writers))
						fill(r, buf)
						if _, err := q.WriteAt(ctx, buf, b*blk); err != nil {
							t.Error(err)
							return
						}
						mu.Lock()
						copy(mirror[b*blk:], buf)
						mu.Unlock()
					}
				}()
			}
			for rd := range 3 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					r := rand.New(rand.NewPCG(uint64(rd), 2))
					for range 200 {
						n := 1 + r.Int64N(300<<10)
						off := r.Int64N(size - n)
						if _, err := q.ReadCopy(ctx, make([]byte, n), off); err != nil {
							t.Error(err)
							return
						}
					}
				}()
			}
			wg.Wait()
			// Copy the rest: then nothing is left to the backing file.
			if _, err := q.Populate(ctx, 0, size); err != nil {
				t.Fatal(err)
			}
			for off := int64(0); off < size; {
				e, err := q.Extent(ctx, off, size-off)
				if err != nil {
					t.Fatal(err)
				}
				if e.Depth != 0 {
					t.Fatalf("[%d, +%d) is still the backing file's after Populate", e.Start, e.Length)
				}
				off += e.Length
			}
			if err := q.Close(); err != nil {
				t.Fatal(err)
			}
			checkClean(t, over)
			compareRaw(t, over, mirror)
		})
	}
}

// TestDropBacking: once populated, the overlay drops its backing file
// crash-safely; QEMU then sees no backing file and the same bytes, even
// with the backing file gone.
func TestDropBacking(t *testing.T) {
	ctx := context.Background()
	over, data := corOverlay(t, 3<<20+4096, "1.1")
	q := openRW(t, over)
	if _, err := q.Populate(ctx, 0, q.Size()); err != nil {
		t.Fatal(err)
	}
	if err := q.DropBacking(ctx); err != nil {
		t.Fatal(err)
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(filepath.Dir(over), "base.raw")); err != nil {
		t.Fatal(err)
	}
	info := tool(t, "qemu-img", "info", "--output=json", over)
	if bytes.Contains([]byte(info), []byte("backing")) {
		t.Fatalf("qemu-img info still names a backing file:\n%s", info)
	}
	checkClean(t, over)
	compareRaw(t, over, data)
}
