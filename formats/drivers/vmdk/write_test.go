package vmdk

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/driver"
)

// openWritable opens the single-file image at p for writing.
func openWritable(t testing.TB, p string) (*Image, error) {
	t.Helper()
	f, err := aio.Open(p, aio.Options{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	return New(context.Background(), f, Options{Name: p, Writable: true})
}

// createSingle makes a new single-file image (monolithicSparse or
// streamOptimized) of size bytes with the -o keys given.
func createSingle(t *testing.T, size int64, keys map[string]string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "d.vmdk")
	if err := Create(p, driver.CreateOptions{Size: size, Keys: keys}); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestVmdkWritesReadBack: writes of every shape (inside a grain, across
// grains and tables, whole grains, rewrites of allocated grains, from
// goroutines at once, several into one new grain) read back, through the
// open image and after a reopen; zeroes over whole grains of a
// zeroed_grain image become zeroed-grain entries and allocate nothing.
func TestVmdkWritesReadBack(t *testing.T) {
	for _, zeroed := range []string{"off", "on"} {
		t.Run("zeroed_grain="+zeroed, func(t *testing.T) {
			const size = 80 << 20 // 3 grain tables
			p := createSingle(t, size, map[string]string{"zeroed_grain": zeroed})
			img, err := openWritable(t, p)
			if err != nil {
				t.Fatal(err)
			}
			want := make([]byte, size)
			var mu sync.Mutex
			write := func(seed int64, off, n int64) {
				b := make([]byte, n)
				rand.New(rand.NewSource(seed)).Read(b)
				if _, err := img.WriteAt(context.Background(), b, off); err != nil {
					t.Errorf("write %d at %d: %v", n, off, err)
					return
				}
				mu.Lock()
				copy(want[off:], b)
				mu.Unlock()
			}
			ctx := context.Background()
			write(1, 100, 1)
			write(2, 65536-10, 20)
			write(3, 32<<20-4096, 3<<20)
			write(4, 5<<20, 64<<10)
			write(5, size-512, 512)
			write(6, 200, 4000) // a rewrite of an allocated grain
			var wg sync.WaitGroup
			for i := range 16 {
				wg.Add(1)
				go func() { // four writers a grain, sixteen grains
					defer wg.Done()
					off := 40<<20 + int64(i/4)*65536 + int64(i%4)*16384
					write(int64(10+i), off, 16384)
				}()
			}
			wg.Wait()
			if err := img.WriteZeroes(ctx, 32<<20, 1<<20, true); err != nil {
				t.Fatal(err)
			}
			clear(want[32<<20 : 33<<20])
			before, _ := os.Stat(p)
			if err := img.WriteZeroes(ctx, 60<<20, 1<<20, true); err != nil { // unallocated already
				t.Fatal(err)
			}
			if after, _ := os.Stat(p); after.Size() != before.Size() {
				t.Errorf("zeroing unallocated grains grew the file from %d to %d bytes", before.Size(), after.Size())
			}
			if zeroed == "on" {
				if st, _, _, err := img.extents[0].lookupGrain(ctx, 32<<20, false); err != nil || st != grainZero {
					t.Errorf("a zeroed whole grain: state %d (%v), want a zeroed-grain entry", st, err)
				}
			}
			got := make([]byte, size)
			if _, err := img.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, want) {
				t.Fatalf("the open image reads other bytes than written (%v)", err)
			}
			if err := img.Flush(ctx); err != nil {
				t.Fatal(err)
			}
			img.Close()
			img, err = open(t, p, Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer img.Close()
			clear(got)
			if _, err := img.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, want) {
				t.Fatalf("the image reopened reads other bytes than written (%v)", err)
			}
			if r, err := img.check(ctx); err != nil || r.Corruptions != 0 {
				t.Fatalf("check: %+v %v", r, err)
			}
		})
	}
}

// TestVmdkStreamOptimizedTakesEachGrainOnce: a new streamOptimized image
// takes grains (partial ones padded with zeroes), deflated behind
// markers, and reads them back; a second write into a grain is refused as
// QEMU refuses it, and once it holds grains a writable open is refused
// with formats.ErrReadOnly (the registry's overlay advice).
func TestVmdkStreamOptimizedTakesEachGrainOnce(t *testing.T) {
	p := createSingle(t, 1<<20, map[string]string{"subformat": "streamOptimized"})
	img, err := openWritable(t, p)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	data := bytes.Repeat([]byte("stream"), 20000)[:65536]
	comp, ok, err := img.CompressCluster(data)
	if err != nil || !ok || len(comp) >= len(data) {
		t.Fatalf("CompressCluster: %d bytes, %v, %v", len(comp), ok, err)
	}
	if err := img.WriteCompressed(ctx, comp, 65536); err != nil {
		t.Fatal(err)
	}
	if _, err := img.WriteAt(ctx, []byte("tail"), 1<<20-4); err != nil {
		t.Fatal(err)
	}
	if _, err := img.WriteAt(ctx, []byte("again"), 65536+10); !errors.Is(err, formats.ErrNotSupported) {
		t.Fatalf("a second write into a grain: %v, want a refusal", err)
	}
	got := make([]byte, 1<<20)
	if _, err := img.ReadAt(ctx, got, 0); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, 1<<20)
	copy(want[65536:], data)
	copy(want[1<<20-4:], "tail")
	if !bytes.Equal(got, want) {
		t.Fatal("the stream-optimized image reads other bytes than written")
	}
	img.Close()
	if _, err := openWritable(t, p); !errors.Is(err, formats.ErrReadOnly) || strings.Contains(err.Error(), "\n") {
		t.Fatalf("writable open of a stream-optimized image holding grains: %v, want one line of ErrReadOnly", err)
	}
}

// hostOp is a write (off, n, and the value of a 4-byte one: a table
// entry) or a sync of a file.
type hostOp struct {
	sync   bool
	off    int64
	n      int
	le32   uint32
	before int // for a write: how many syncs came before it
}

// recordingFile records the writes and syncs of a file, in order.
type recordingFile struct {
	aio.File
	mu    sync.Mutex
	ops   []hostOp
	syncs int
}

func (r *recordingFile) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	r.mu.Lock()
	op := hostOp{off: off, n: len(p), before: r.syncs}
	if len(p) == 4 {
		op.le32 = binary.LittleEndian.Uint32(p)
	}
	r.ops = append(r.ops, op)
	r.mu.Unlock()
	return r.File.WriteAt(ctx, p, off)
}

func (r *recordingFile) Fdatasync(ctx context.Context) error {
	r.mu.Lock()
	r.ops = append(r.ops, hostOp{sync: true})
	r.syncs++
	r.mu.Unlock()
	return r.File.Fdatasync(ctx)
}

// TestVmdkNewGrainIsOnDiskBeforeItsTableEntry: every new grain is
// written, then synced, then its grain table entry is written, then the
// redundant table's, so that a crash at any point leaves a leak at
// worst, never an entry naming bytes not yet durable; the sync is shared
// by many grains (one per maxPendingGrains, and at a flush), and grains
// not yet linked read back through the image, from the pending map (a
// zeroed one reads zeroes and is never linked).
func TestVmdkNewGrainIsOnDiskBeforeItsTableEntry(t *testing.T) {
	const grain, grains = 65536, 700
	const size = grains * grain
	p := createSingle(t, size, map[string]string{"zeroed_grain": "on"})
	f, err := aio.Open(p, aio.Options{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	rec := &recordingFile{File: f}
	img, err := New(context.Background(), rec, Options{Name: p, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	l := newSparseLayout(size)
	gtAt := (l.gd + l.gdSectors) * sectorSize   // the tables lie one after another
	rgtAt := (l.rgd + l.gdSectors) * sectorSize // the redundant ones too
	onDisk := func(g int64) uint32 {
		b := make([]byte, 4)
		if _, err := rec.File.ReadAt(ctx, b, gtAt+4*g); err != nil {
			t.Fatal(err)
		}
		return binary.LittleEndian.Uint32(b)
	}
	want := make([]byte, size)
	write := func(g int64, inG, n int) {
		b := make([]byte, n)
		rand.New(rand.NewSource(g*7 + int64(inG))).Read(b)
		if _, err := img.WriteAt(ctx, b, g*grain+int64(inG)); err != nil {
			t.Fatalf("write grain %d: %v", g, err)
		}
		copy(want[g*grain+int64(inG):], b)
	}
	readsBack := func(when string) {
		t.Helper()
		got := make([]byte, size)
		if _, err := img.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("%s: the image does not read what was written (%v)", when, err)
		}
	}
	order := rand.New(rand.NewSource(1)).Perm(grains)
	for _, g := range order[:100] { // fewer than maxPendingGrains: all pending
		write(int64(g), 0, grain)
	}
	write(int64(order[100]), 100, 7) // a part of a grain: the rest zeroes
	write(int64(order[0]), 5, 10)    // a rewrite of a pending grain, in place
	readsBack("with 101 grains pending")
	for _, g := range order[:101] {
		if v := onDisk(int64(g)); v != 0 {
			t.Fatalf("grain %d linked (entry %d) before any sync", g, v)
		}
	}
	if err := img.WriteZeroes(ctx, int64(order[1])*grain, grain, false); err != nil {
		t.Fatal(err)
	}
	copy(want[int64(order[1])*grain:], make([]byte, grain))
	readsBack("a pending grain zeroed")
	for _, g := range order[101:600] {
		write(int64(g), 0, grain)
	}
	readsBack("after a batch linked")
	if err := img.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	for _, g := range order[600:] {
		write(int64(g), 0, grain)
	}
	readsBack("after a flush")
	if err := img.Close(); err != nil {
		t.Fatal(err)
	}

	// The rule, for every grain: its data written, a sync, its entry, its
	// redundant entry.
	dataAt := map[int64]hostOp{} // by sector
	linked := map[int64]uint32{}
	for i, op := range rec.ops {
		switch {
		case op.sync:
		case op.n == grain:
			dataAt[op.off/sectorSize] = op
		case op.n == 4 && op.off >= gtAt && op.off < gtAt+int64(grains)*4:
			g := (op.off - gtAt) / 4
			if op.le32 != gteZeroed {
				d, ok := dataAt[int64(op.le32)]
				if !ok {
					t.Fatalf("grain %d linked to sector %d, where no grain was written", g, op.le32)
				}
				if d.before == op.before {
					t.Fatalf("grain %d linked to sector %d with no sync since its data was written", g, op.le32)
				}
			}
			linked[g] = op.le32
			if i+1 >= len(rec.ops) || rec.ops[i+1].off != rgtAt+4*g || rec.ops[i+1].le32 != op.le32 {
				t.Fatalf("grain %d: the redundant entry does not follow the entry", g)
			}
		}
	}
	if len(linked) != grains {
		t.Fatalf("%d grains of %d linked by the close", len(linked), grains)
	}
	if v := linked[int64(order[1])]; v != gteZeroed {
		t.Fatalf("the zeroed pending grain was linked to %d, not zeroed", v)
	}
	if most := grains/maxPendingGrains + 5; rec.syncs > most {
		t.Fatalf("%d syncs for %d new grains, want at most %d", rec.syncs, grains, most)
	}
	t.Logf("%d syncs for %d new grains", rec.syncs, grains)
	img, err = openWritable(t, p)
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	readsBack("reopened")
}

// TestVmdkHostileImagesOpenedWritable: the hostile images of the read
// tests opened writable are refused in one line (ErrCorrupt,
// ErrUnsupported, or ErrReadOnly for a variant read only), and one read
// only through its redundant grain directory is refused for writing;
// those that open are written grain by grain without touching their
// metadata: they reopen and read what was written, or the write was
// refused as corrupt.
func TestVmdkHostileImagesOpenedWritable(t *testing.T) {
	dir := t.TempDir()
	for _, m := range headerMutations() {
		t.Run(m.name, func(t *testing.T) {
			p := writeTemp(t, dir, "x.vmdk", m.mut(craft(false).b))
			img, err := openWritable(t, p)
			if err != nil {
				if !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrUnsupported) && !errors.Is(err, formats.ErrReadOnly) {
					t.Fatalf("writable open: %v, want ErrCorrupt, ErrUnsupported or ErrReadOnly", err)
				}
				if strings.Contains(err.Error(), "\n") {
					t.Fatalf("refusal is more than one line: %q", err)
				}
				return
			}
			if strings.Contains(m.name, "RGD good") {
				img.Close()
				t.Fatal("an image whose grain directory is damaged opened writable")
			}
			ctx := context.Background()
			written := map[int64][]byte{}
			for off := int64(0); off < img.Size() && off < 8<<20; off += 15 * 4096 { // grains 0, 15, ... 600: both tables
				b := []byte(fmt.Sprintf("grain at %d", off))
				if _, err := img.WriteAt(ctx, b, off+100); err != nil {
					if !errors.Is(err, ErrCorrupt) && !errors.Is(err, formats.ErrNotSupported) {
						t.Fatalf("write at %d: %v, want a refusal as corrupt", off, err)
					}
					continue
				}
				written[off+100] = b
			}
			img.Close()
			img, err = open(t, p, Options{})
			if err != nil {
				t.Fatalf("the image written no longer opens: %v", err)
			}
			defer img.Close()
			for off, b := range written {
				got := make([]byte, len(b))
				if _, err := img.ReadAt(ctx, got, off); err != nil || !bytes.Equal(got, b) {
					t.Fatalf("at %d: read %q (%v), wrote %q", off, got, err, b)
				}
			}
		})
	}
}

// TestVmdkCreateRefusesWhatQemuImgRefuses: the option combinations
// qemu-img create refuses are refused in its words, before any file.
func TestVmdkCreateRefusesWhatQemuImgRefuses(t *testing.T) {
	for _, c := range []struct {
		keys    map[string]string
		backing string
		want    string
	}{
		{map[string]string{"adapter_type": "scsi"}, "", "invalid parameter value: scsi"},
		{map[string]string{"subformat": "vmfs"}, "", "invalid parameter value: vmfs"},
		{map[string]string{"compat6": "on", "hwversion": "7"}, "", "compat6 cannot be enabled with hwversion set"},
		{map[string]string{"subformat": "monolithicFlat", "zeroed_grain": "on"}, "", "Flat image can't enable zeroed grain"},
		{map[string]string{"subformat": "twoGbMaxExtentFlat"}, "base.vmdk", "Flat image can't have backing file"},
		{map[string]string{"zeroed_grain": "maybe"}, "", "Parameter 'zeroed_grain' expects 'on' or 'off'"},
		{map[string]string{"cluster_size": "4k"}, "", "Invalid parameter 'cluster_size'"},
	} {
		dir := t.TempDir()
		p := filepath.Join(dir, "d.vmdk")
		err := Create(p, driver.CreateOptions{Size: 1 << 20, Keys: c.keys, BackingFile: c.backing})
		if !errors.Is(err, driver.ErrBadOption) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want %q", c.keys, err, c.want)
		}
		if names, _ := os.ReadDir(dir); len(names) != 0 {
			t.Errorf("%v: files made although refused: %v", c.keys, names)
		}
	}
}

// TestVmdkOverlappingDirectoriesRefuseWrites: an image whose redundant
// grain table lies on a primary one (each directory sound by itself, so
// it reads) is refused for writing in one line: a write would put one
// table's entry into the other.
func TestVmdkOverlappingDirectoriesRefuseWrites(t *testing.T) {
	for name, mut := range map[string]func(b []byte){
		"redundant table on a table":       func(b []byte) { le32(b, tRGD*512, tGT0) },
		"redundant directory on a table":   func(b []byte) { le64(b, 48, tGT1) },
		"redundant table on the directory": func(b []byte) { le32(b, tRGD*512+4, tGD) },
	} {
		t.Run(name, func(t *testing.T) {
			b := craft(false).b
			mut(b)
			p := writeTemp(t, t.TempDir(), "x.vmdk", b)
			img, err := open(t, p, Options{})
			if err != nil {
				t.Fatalf("read-only open: %v", err)
			}
			img.Close()
			img, err = openWritable(t, p)
			if err == nil {
				img.Close()
				t.Fatal("opened writable")
			}
			if !errors.Is(err, ErrCorrupt) || strings.Contains(err.Error(), "\n") {
				t.Fatalf("writable open: %v, want one line of ErrCorrupt", err)
			}
		})
	}
}
