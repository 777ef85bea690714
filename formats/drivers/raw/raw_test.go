package raw

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
)

// TestDirectUnalignedIO: with O_DIRECT, unaligned reads and writes go
// through bounce buffers and read-modify-write. Goroutines write unaligned,
// overlapping-window (but byte-disjoint) ranges concurrently: a lost update
// from two RMWs of one block would show as a mismatch with the model.
func TestDirectUnalignedIO(t *testing.T) {
	for _, backend := range []aio.Backend{aio.IOUring, aio.Threads} {
		t.Run(string(backend), func(t *testing.T) {
			const size = 1<<20 + 777 // not a multiple of the block size
			path := filepath.Join(t.TempDir(), "img")
			os.WriteFile(path, make([]byte, size), 0o644)
			img, err := openTest(path, testOpts{Writable: true, Direct: true, Backend: backend})
			if err != nil {
				t.Fatal(err)
			}
			defer img.Close()
			if img.align < 512 {
				t.Fatalf("alignment %d with O_DIRECT", img.align)
			}
			model := make([]byte, size)
			ctx := context.Background()
			var wg sync.WaitGroup
			// Goroutine g owns bytes with (offset/100)%8 == g: every block
			// is shared by several goroutines.
			for g := 0; g < 8; g++ {
				wg.Add(1)
				go func(g int) {
					defer wg.Done()
					r := rand.New(rand.NewPCG(uint64(g), 3))
					for i := 0; i < 200; i++ {
						stripe := int64(r.IntN(size/100/8))*8 + int64(g)
						off := stripe*100 + int64(r.IntN(50))
						n := 1 + r.IntN(int(min(100-off%100, size-off)))
						p := make([]byte, n)
						for j := range p {
							p[j] = byte(r.Uint32() | 1)
						}
						if _, err := img.WriteAt(ctx, p, off); err != nil {
							t.Error(err)
							return
						}
						copy(model[off:], p) // disjoint bytes per goroutine: no race
					}
				}(g)
			}
			wg.Wait()
			got := make([]byte, size)
			// Read back with odd-sized, odd-offset pieces.
			for off := int64(0); off < size; {
				n := min(int64(3001), size-off)
				if _, err := img.ReadAt(ctx, got[off:off+n], off); err != nil {
					t.Fatal(err)
				}
				off += n
			}
			if !bytes.Equal(got, model) {
				t.Fatal("contents differ from the model of the writes")
			}
			if st, _ := os.Stat(path); st.Size() != size {
				t.Fatalf("host file size %d, want %d (bounce padding must not grow it)", st.Size(), size)
			}
		})
	}
}

func TestExtentsFollowHoles(t *testing.T) {
	path := filepath.Join(t.TempDir(), "img")
	f, _ := os.Create(path)
	f.Truncate(8 << 20)
	f.WriteAt(bytes.Repeat([]byte{1}, 1<<20), 2<<20)
	f.Close()
	img, err := openTest(path, testOpts{Backend: aio.Threads})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	ctx := context.Background()
	want := []formats.Extent{
		{Start: 0, Length: 2 << 20, Zero: true, Present: true, HasOffset: true},
		{Start: 2 << 20, Length: 1 << 20, Data: true, Present: true, Offset: 2 << 20, HasOffset: true},
		{Start: 3 << 20, Length: 5 << 20, Zero: true, Present: true, Offset: 3 << 20, HasOffset: true},
	}
	off := int64(0)
	for _, w := range want {
		e, err := img.Extent(ctx, off, 8<<20-off)
		w.File = path
		if err != nil || e != w {
			t.Fatalf("extent at %d: %+v %v, want %+v", off, e, err, w)
		}
		off += e.Length
	}
	if _, err := img.Extent(ctx, 8<<20, 1); !errors.Is(err, formats.ErrOutOfRange) {
		t.Fatalf("extent at EOF: %v", err)
	}
	if _, err := img.WriteAt(ctx, []byte{1}, 0); !errors.Is(err, formats.ErrReadOnly) {
		t.Fatalf("write to a read-only raw image: %v", err)
	}
}

// TestDirectAppendsWhileGrowing: with O_DIRECT, writers append at once the
// way a growable export does (grow under a mutex, then write the new tail,
// in parallel with other writers): an unaligned write trimming its padding
// must never cut off a growth that happened meanwhile.
func TestDirectAppendsWhileGrowing(t *testing.T) {
	path := filepath.Join(t.TempDir(), "img")
	os.WriteFile(path, nil, 0o644)
	img, err := openTest(path, testOpts{Writable: true, Direct: true, Backend: aio.Threads})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	ctx := context.Background()
	var grow sync.Mutex
	var wg sync.WaitGroup
	const writers, each, piece = 8, 60, 1000
	for g := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := bytes.Repeat([]byte{byte(g + 1)}, piece)
			for range each {
				grow.Lock()
				off := img.Size()
				err := img.Resize(ctx, off+piece)
				grow.Unlock()
				if err != nil {
					t.Error(err)
					return
				}
				if _, err := img.WriteAt(ctx, p, off); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	const size = writers * each * piece
	if img.Size() != size {
		t.Fatalf("image size %d, want %d", img.Size(), size)
	}
	got := make([]byte, size)
	if _, err := img.ReadAt(ctx, got, 0); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < size; i += piece {
		if got[i] == 0 || !bytes.Equal(got[i:i+piece], bytes.Repeat(got[i:i+1], piece)) {
			t.Fatalf("piece at %d lost or torn", i)
		}
	}
	if st, _ := os.Stat(path); st.Size() != size {
		t.Fatalf("host file size %d, want %d", st.Size(), size)
	}
}

// countingFile counts the bytes read from the host file.
type countingFile struct {
	aio.File
	read atomic.Int64
}

func (c *countingFile) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	n, err := c.File.ReadAt(ctx, p, off)
	c.read.Add(int64(n))
	return n, err
}

func (c *countingFile) ReadvAt(ctx context.Context, iov [][]byte, off int64) (int, error) {
	n, err := c.File.ReadvAt(ctx, iov, off)
	c.read.Add(int64(n))
	return n, err
}

// TestDirectWritesReadOnlyPartialBlocks: with O_DIRECT, a write whose
// offset and length are block-aligned reads nothing from the host, even
// when its payload is misaligned in memory (a FUSE WRITE's payload follows
// its headers); an unaligned one reads at most the two blocks it only
// partly covers. (Measured before: a 4 KiB aligned write from FUSE read
// 4 KiB first, halving --cache none write rates.)
func TestDirectWritesReadOnlyPartialBlocks(t *testing.T) {
	path := filepath.Join(t.TempDir(), "img")
	const size = 1 << 20
	os.WriteFile(path, make([]byte, size), 0o644)
	// Count below aio.Aligned: its read-modify-writes are what this is
	// about.
	f, err := aio.Open(path, aio.Options{Writable: true, Direct: true})
	if err != nil {
		t.Fatal(err)
	}
	cf := &countingFile{File: f}
	img, err := New(context.Background(), aio.Aligned(cf, aio.LogicalBlockSize(f.Fd())), Options{Writable: true, Direct: true})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	ctx := context.Background()
	a := img.align
	buf := make([]byte, 8*a+1)
	for i := range buf {
		buf[i] = byte(i*7 + 1)
	}
	misaligned := buf[1 : 1+4*a] // aligned length, misaligned address
	if _, err := img.WriteAt(ctx, misaligned, int64(2*a)); err != nil {
		t.Fatal(err)
	}
	if n := cf.read.Load(); n != 0 {
		t.Fatalf("an aligned write read %d bytes from the host first", n)
	}
	// Unaligned at both ends, spanning five blocks: only the first and
	// last are partly kept.
	if _, err := img.WriteAt(ctx, buf[:4*a+2], int64(8*a+a/2)); err != nil {
		t.Fatal(err)
	}
	if n := cf.read.Load(); n > int64(2*a) {
		t.Fatalf("an unaligned write read %d bytes; at most two blocks (%d) are needed", n, 2*a)
	}
	got := make([]byte, 4*a)
	if _, err := img.ReadAt(ctx, got, int64(2*a)); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, misaligned) {
		t.Fatal("the aligned write's data did not land")
	}
	got = make([]byte, 4*a+2)
	if _, err := img.ReadAt(ctx, got, int64(8*a+a/2)); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, buf[:4*a+2]) {
		t.Fatal("the unaligned write's data did not land")
	}
}

// testOpts are the knobs these tests turn: what the registry would be
// told.
type testOpts struct {
	Writable bool
	Direct   bool
	Backend  aio.Backend
}

// openTest opens the raw image at path as the registry does.
func openTest(path string, o testOpts) (*Image, error) {
	f, err := aio.Open(path, aio.Options{Backend: o.Backend, Writable: o.Writable, Direct: o.Direct})
	if err != nil {
		return nil, err
	}
	if o.Direct {
		f = aio.Aligned(f, aio.LogicalBlockSize(f.Fd()))
	}
	return New(context.Background(), f, Options{Writable: o.Writable, Direct: o.Direct})
}
