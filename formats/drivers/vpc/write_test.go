package vpc

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/driver"
)

// createVHD makes a new VHD with Create and returns its path.
func createVHD(t testing.TB, size int64, keys map[string]string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "n.vhd")
	if err := Create(p, driver.CreateOptions{Size: size, Keys: keys}); err != nil {
		t.Fatal(err)
	}
	return p
}

func openWritable(t testing.TB, p string) *Image {
	t.Helper()
	f, err := aio.Open(p, aio.Options{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	img, err := New(context.Background(), f, Options{Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// TestCreatedGeometryIsQemus: the virtual sizes qemu-img 7.2 gives these
// requests (measured with qemu-img create -f vpc and info).
func TestCreatedGeometryIsQemus(t *testing.T) {
	for _, c := range []struct {
		size       int64
		chs, force int64
	}{
		{1 << 20, 1079296, 1 << 20},
		{10 << 20, 10514432, 10 << 20},
		{127 << 20, 133171200, 133169152},
		{1 << 30, 1073995776, 1 << 30},
		{3<<30 + 1024, 3221471232, 3<<30 + 1024},
		{2040 << 30, 2040 << 30, 2040 << 30},
		{0, 0, 0},
	} {
		for _, force := range []bool{false, true} {
			_, _, _, sectors, err := createGeometry(c.size, force)
			want := c.chs
			if force {
				want = c.force
			}
			if err != nil || int64(sectors)*512 != want {
				t.Errorf("size %d force %v: %d sectors (%v), want %d bytes", c.size, force, sectors, err, want)
			}
		}
	}
	for _, force := range []bool{false, true} {
		if _, _, _, _, err := createGeometry(2040<<30+512, force); !errors.Is(err, driver.ErrBadOption) {
			t.Errorf("2040 GiB + 512, force %v: %v, want a refusal", force, err)
		}
	}
}

// TestWritesReadBackAsQemuReadsThem: writes across blocks (allocating
// some, rewriting others), zeroes and discards of a dynamic and a fixed
// disk read back as written, here after a reopen and through qemu-img;
// the fixed disk's footer is out of reach.
func TestWritesReadBackAsQemuReadsThem(t *testing.T) {
	for _, sub := range []string{"dynamic", "fixed"} {
		t.Run(sub, func(t *testing.T) {
			p := createVHD(t, 9<<20, map[string]string{"subformat": sub, "force_size": "on"})
			img := openWritable(t, p)
			ctx := context.Background()
			model := make([]byte, img.Size())
			r := rand.New(rand.NewPCG(1, 2))
			fill := rand.NewChaCha8([32]byte{1})
			for i := 0; i < 24; i++ {
				n := 1 + r.IntN(5<<19)
				off := r.Int64N(img.Size() - int64(n))
				b := make([]byte, n)
				fill.Read(b)
				if _, err := img.WriteAt(ctx, b, off); err != nil {
					t.Fatal(err)
				}
				copy(model[off:], b)
				if i%7 == 3 {
					z := r.Int64N(1 << 20)
					if err := img.WriteZeroes(ctx, off, z, i%2 == 0); err != nil {
						t.Fatal(err)
					}
					clear(model[off : off+z])
				}
			}
			if err := img.Discard(ctx, 0, 4096); err != nil { // QEMU's vpc: nothing
				t.Fatal(err)
			}
			if _, err := img.WriteAt(ctx, make([]byte, 1), img.Size()); !errors.Is(err, formats.ErrOutOfRange) {
				t.Fatalf("a write past the disk (at the footer): %v", err)
			}
			if err := img.Resize(ctx, 20<<20); !errors.Is(err, formats.ErrNotSupported) {
				t.Fatalf("resize: %v", err)
			}
			if err := img.Flush(ctx); err != nil {
				t.Fatal(err)
			}
			img.Close()
			back, err := openVHD(t, p, Options{})
			if err != nil {
				t.Fatal(err)
			}
			got := make([]byte, back.Size())
			if _, err := back.ReadAt(ctx, got, 0); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, model) {
				t.Fatal("reopened, the disk is not what was written")
			}
			if q, ok := qemuReads(t, p); !ok || !bytes.Equal(q, model) {
				t.Fatal("qemu-img reads other bytes")
			}
		})
	}
}

// crashingFile is a host file whose process dies after its first limit
// writes: later writes and syncs fail and change nothing, as when the
// writer is killed (the page cache keeps what was written before).
type crashingFile struct {
	aio.File
	limit, writes int
}

var errKilled = errors.New("killed")

func (c *crashingFile) dead() bool { c.writes++; return c.writes > c.limit }

func (c *crashingFile) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	if c.dead() {
		return 0, errKilled
	}
	return c.File.WriteAt(ctx, p, off)
}

func (c *crashingFile) WritevAt(ctx context.Context, v [][]byte, off int64) (int, error) {
	if c.dead() {
		return 0, errKilled
	}
	return c.File.WritevAt(ctx, v, off)
}

func (c *crashingFile) TryWriteAt([]byte, int64) (bool, error) { return false, nil }

func (c *crashingFile) Fdatasync(ctx context.Context) error {
	if c.writes >= c.limit {
		return errKilled
	}
	return c.File.Fdatasync(ctx)
}

// TestAllocationKilledAfterEveryWriteLeavesAtWorstALeak: the writer dies
// after each of its host writes in turn (the moved footer, the bitmap and
// data, the BAT entry, of allocations at a block's start, inside one and
// into an allocated block, with flushes between). Every time the image
// opens here (no entry past the end or over another structure) and in
// qemu-img, which read the same bytes, and every write acknowledged
// before a flush that succeeded reads back.
func TestAllocationKilledAfterEveryWriteLeavesAtWorstALeak(t *testing.T) {
	ctx := context.Background()
	type step struct {
		off   int64
		n     int
		flush bool
	}
	// A disk of 16 blocks of 4 KiB (QEMU's are 2 MiB; the order of the
	// writes is the same, the test is faster).
	const bs = testBS
	steps := []step{{0, 1024, true}, {3*bs + 512, 2048, false}, {100, 1000, true}, {5 * bs, 2 * bs, true}, {bs - 512, 1024, false}}
	for limit := 0; ; limit++ {
		spec := goodVHD()
		spec.currentSize, spec.entries = 16*bs, 16
		spec.bat = slices.Repeat([]uint32{unallocated}, 16)
		p := spec.build(t)
		f, err := aio.Open(p, aio.Options{Backend: aio.Threads, Writable: true})
		if err != nil {
			t.Fatal(err)
		}
		cf := &crashingFile{File: f, limit: limit}
		img, err := New(ctx, cf, Options{Writable: true})
		if err != nil {
			t.Fatal(err)
		}
		durable := make([]byte, img.Size()) // what must read back
		known := make([]bool, img.Size())   // whether it must
		for i := range known {
			known[i] = true
		}
		pending := map[int]step{}
		killed := false
		for i, s := range steps {
			b := bytes.Repeat([]byte{byte(0x11 * (i + 1))}, s.n)
			for j := s.off; j < s.off+int64(s.n); j++ {
				known[j] = false
			}
			if _, err := img.WriteAt(ctx, b, s.off); err != nil {
				killed = true
				break
			}
			pending[i] = s
			if s.flush {
				if img.Flush(ctx) != nil {
					killed = true
					break
				}
				for k, ps := range pending {
					for j := ps.off; j < ps.off+int64(ps.n); j++ {
						durable[j], known[j] = byte(0x11*(k+1)), true
					}
				}
				clear(pending)
			}
		}
		img.Close()
		back, err := openVHD(t, p, Options{})
		if err != nil {
			t.Fatalf("killed after %d writes: the image does not open: %v", limit, err)
		}
		got := make([]byte, back.Size())
		if _, err := back.ReadAt(ctx, got, 0); err != nil {
			t.Fatal(err)
		}
		for j := range got {
			if known[j] && got[j] != durable[j] {
				t.Fatalf("killed after %d writes: byte %d reads %#x, flushed %#x", limit, j, got[j], durable[j])
			}
		}
		if q, ok := qemuReads(t, p); !ok || !bytes.Equal(q, got) {
			t.Fatalf("killed after %d writes: qemu-img reads it differently (opens: %v)", limit, ok)
		}
		// A second session after the crash allocates past the leak and
		// never hands stale bytes to a new block.
		img2 := openWritable(t, p)
		if _, err := img2.WriteAt(ctx, []byte{0x77}, 15*bs+1); err != nil {
			t.Fatal(err)
		}
		tail := make([]byte, bs)
		if _, err := img2.ReadAt(ctx, tail, 15*bs); err != nil {
			t.Fatal(err)
		}
		if tail[1] != 0x77 || bytes.Count(tail, []byte{0}) != len(tail)-1 {
			t.Fatalf("killed after %d writes: a block allocated afterwards holds stale bytes", limit)
		}
		img2.Close()
		if !killed {
			if limit < 6 {
				t.Fatalf("every step finished after %d writes: the kill points were not reached", limit)
			}
			return
		}
	}
}

// TestWritableOpenOfHostileFiles: every crafted file of the hostile
// table opened writable is refused in the same one line as when read,
// leaving the file as it was, or opens, takes a write over the whole
// disk and opens again (here and in qemu-img) reading it back: no
// metadata was written into data, nor data into metadata.
func TestWritableOpenOfHostileFiles(t *testing.T) {
	for _, c := range hostileVHDs() {
		t.Run(c.name, func(t *testing.T) {
			s := goodVHD()
			c.mod(&s)
			p := s.build(t)
			before, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			f, err := aio.Open(p, aio.Options{Backend: aio.Threads, Writable: true})
			if err != nil {
				t.Fatal(err)
			}
			img, err := New(context.Background(), f, Options{Writable: true})
			if err != nil {
				if strings.Contains(err.Error(), "\n") {
					t.Fatalf("refusal is not one line: %q", err)
				}
				if after, _ := os.ReadFile(p); !bytes.Equal(after, before) {
					t.Fatal("a refused image was changed")
				}
				if c.want == nil && s.typ != typeDiff {
					t.Fatalf("refused for writing: %v", err)
				}
				return
			}
			defer img.Close()
			if c.want != nil {
				t.Fatalf("opens for writing; read-only it is refused (%v)", c.want)
			}
			ctx := context.Background()
			data := bytes.Repeat([]byte{0x5a, 0xc3}, int(img.Size()/2))
			if _, err := img.WriteAt(ctx, data, 0); err != nil {
				t.Fatal(err)
			}
			if err := img.Flush(ctx); err != nil {
				t.Fatal(err)
			}
			back, err := openVHD(t, p, Options{})
			if err != nil {
				t.Fatalf("after a write over the disk it no longer opens: %v", err)
			}
			got := make([]byte, back.Size())
			if _, err := back.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, data) {
				t.Fatalf("the disk reads other bytes back (%v)", err)
			}
			if q, ok := qemuReads(t, p); !ok || !bytes.Equal(q, data) {
				t.Fatal("qemu-img reads other bytes back")
			}
		})
	}
}

// TestDifferencingDiskIsNotWritten: a writable open of a differencing
// disk is refused in one line naming a qcow2 overlay.
func TestDifferencingDiskIsNotWritten(t *testing.T) {
	s := goodVHD()
	s.typ = typeDiff
	f, err := aio.Open(s.build(t), aio.Options{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	_, err = New(context.Background(), f, Options{Writable: true, OpenParent: func(string) (formats.Image, string, error) { return nil, "", nil }})
	if !errors.Is(err, formats.ErrReadOnly) || !strings.Contains(err.Error(), "qcow2 overlay") {
		t.Fatalf("got %v", err)
	}
}

// TestProbeTailWantsAWholeFixedFooter: a fixed disk's footer at the end
// is recognised only with its cookie, its checksum, type fixed and a
// current size that is the file's bytes before it.
func TestProbeTailWantsAWholeFixedFooter(t *testing.T) {
	p := createVHD(t, 1<<20, map[string]string{"subformat": "fixed", "force_size": "on"})
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	size := int64(len(b))
	good := b[len(b)-footerSize:]
	if !ProbeTail(good, size) {
		t.Fatal("a fixed disk's footer is not recognised")
	}
	mod := func(f func([]byte)) []byte {
		c := append([]byte(nil), good...)
		f(c)
		return c
	}
	for name, tail := range map[string][]byte{
		"bad checksum": mod(func(c []byte) { c[100] ^= 1 }),
		"no cookie":    mod(func(c []byte) { c[0] = 'C'; setChecksum(c, 64) }),
		"dynamic":      mod(func(c []byte) { c[63] = typeDynamic; setChecksum(c, 64) }),
		"short":        good[:100],
	} {
		if ProbeTail(tail, size) {
			t.Errorf("%s: recognised", name)
		}
	}
	for _, s := range []int64{size - 512, size + 512, 0} {
		if ProbeTail(good, s) {
			t.Errorf("a file of %d bytes (the footer says %d): recognised", s, size)
		}
	}
}

// TestConcurrentWritesIntoNewBlocks: writers that race to allocate the
// same blocks (each its own sectors) and readers meanwhile: every block
// is allocated once, and every sector reads back what its writer wrote.
func TestConcurrentWritesIntoNewBlocks(t *testing.T) {
	p := createVHD(t, 8<<20, map[string]string{"force_size": "on"})
	img := openWritable(t, p)
	ctx := context.Background()
	const writers = 8
	done := make(chan error, writers+1)
	for w := range writers {
		go func() {
			b := bytes.Repeat([]byte{byte(w + 1)}, 512)
			for off := int64(w) * 512; off < img.Size(); off += writers * 512 {
				if _, err := img.WriteAt(ctx, b, off); err != nil {
					done <- err
					return
				}
			}
			done <- nil
		}()
	}
	go func() {
		buf := make([]byte, 64<<10)
		for i := 0; i < 200; i++ {
			if _, err := img.ReadAt(ctx, buf, int64(i%100)*(64<<10)); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	for range writers + 1 {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	img.Flush(ctx)
	img.Close()
	back, err := openVHD(t, p, Options{})
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, back.Size())
	if _, err := back.ReadAt(ctx, got, 0); err != nil {
		t.Fatal(err)
	}
	for s := 0; s < len(got)/512; s++ {
		if !bytes.Equal(got[s*512:(s+1)*512], bytes.Repeat([]byte{byte(s%writers + 1)}, 512)) {
			t.Fatalf("sector %d is not its writer's", s)
		}
	}
	if fi, err := os.Stat(p); err != nil || fi.Size() != 1536+512+4*(512+2<<20)+512 {
		t.Fatalf("file of %v bytes: each of the 4 blocks allocated once?", fi.Size())
	}
}

// TestFooterStaysTheLastSectorUnderPaddedWrites: through aio.Aligned (as
// with O_DIRECT, where a write of part of a host block pads it past the
// end of the file), writes at the end of a fixed and a dynamic disk
// leave the footer the file's last 512 bytes once flushed and closed.
func TestFooterStaysTheLastSectorUnderPaddedWrites(t *testing.T) {
	for _, sub := range []string{"dynamic", "fixed"} {
		t.Run(sub, func(t *testing.T) {
			p := createVHD(t, 3<<20+512, map[string]string{"subformat": sub, "force_size": "on"})
			f, err := aio.Open(p, aio.Options{Backend: aio.Threads, Writable: true})
			if err != nil {
				t.Fatal(err)
			}
			img, err := New(context.Background(), aio.Aligned(f, 4096), Options{Writable: true})
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			for _, off := range []int64{img.Size() - 1000, 2<<20 - 100, 0} {
				if _, err := img.WriteAt(ctx, bytes.Repeat([]byte{9}, 1000), off); err != nil {
					t.Fatal(err)
				}
			}
			if err := img.Flush(ctx); err != nil {
				t.Fatal(err)
			}
			if err := img.Close(); err != nil {
				t.Fatal(err)
			}
			b, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			tail := b[len(b)-footerSize:]
			if !bytes.HasPrefix(tail, []byte("conectix")) || !checksumOK(tail) {
				t.Fatalf("the file's last 512 bytes are no footer (file of %d bytes)", len(b))
			}
			if sub == "fixed" && !ProbeTail(tail, int64(len(b))) {
				t.Fatal("the fixed disk is no longer recognised by its footer")
			}
			if q, ok := qemuReads(t, p); !ok || !bytes.Equal(q[len(q)-1000:], bytes.Repeat([]byte{9}, 1000)) {
				t.Fatal("qemu-img does not read the write at the disk's end")
			}
		})
	}
}
