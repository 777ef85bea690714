package qcow2

import (
	"context"
	"encoding/binary"
	"errors"
	"slices"
	"sync"
	"testing"

	"github.com/blockexport/blockexport/aio"
)

// TestBitmapResizeKilledBeforeTheCloseLeavesThemInUse: a resize makes
// every bitmap, the disabled one too, in use on disk before the size
// changes, so a crash before the close leaves them all inconsistent (QEMU
// opens the image and distrusts them) rather than tables of the wrong
// size, which QEMU would refuse to open; a clean close stores them at
// the new size with their flags as before.
func TestBitmapResizeKilledBeforeTheCloseLeavesThemInUse(t *testing.T) {
	for _, size := range []int64{16 << 20, 4 << 20} {
		img := bitmapFixture(t)
		q, err := openTest(img, testOpts{Backend: aio.Threads, Writable: true})
		if err != nil {
			t.Fatal(err)
		}
		if err := q.Resize(context.Background(), size); err != nil {
			t.Fatal(err)
		}
		q.f.Close() // the process dies: nothing more is written
		tool(t, "qemu-img", "check", img)
		b := qemuBitmaps(t, img)
		for _, name := range []string{"bm0", "bm1", "bm2"} {
			if !slices.Contains(b[name].Flags, "in-use") {
				t.Errorf("resize to %d, then a crash: %s has flags %q, want it in use", size, name, b[name].Flags)
			}
		}

		img = bitmapFixture(t)
		if q, err = openTest(img, testOpts{Backend: aio.Threads, Writable: true}); err != nil {
			t.Fatal(err)
		}
		if err := q.Resize(context.Background(), size); err != nil {
			t.Fatal(err)
		}
		if err := q.Close(); err != nil {
			t.Fatal(err)
		}
		tool(t, "qemu-img", "check", img)
		b = qemuBitmaps(t, img)
		if !slices.Equal(b["bm0"].Flags, []string{"auto"}) || len(b["bm1"].Flags) != 0 || !slices.Equal(b["bm2"].Flags, []string{"auto"}) {
			t.Errorf("resize to %d: bitmaps %+v, want bm0 and bm2 auto, bm1 disabled", size, b)
		}
		gran := map[string]int64{"bm0": 64 << 10, "bm1": 64 << 10, "bm2": 512}
		for name, dirty := range map[string][][2]int64{"bm1": {{5 << 20, 64 << 10}}, "bm0": {{6 << 20, 4096}}, "bm2": {{6 << 20, 4096}}} {
			var in [][2]int64
			for _, r := range dirty {
				if r[0] < size {
					in = append(in, r)
				}
			}
			if got, want := qemuDirtyRanges(t, img, name), dirtyRuns(size, gran[name], in...); !slices.Equal(got, want) {
				t.Errorf("resize to %d: %s dirty %v, want %v", size, name, got, want)
			}
		}
	}
}

// TestBitmapResizeRefusesAnInconsistentBitmap: a bitmap in use at open
// refuses a resize in QEMU's words, and nothing changes.
func TestBitmapResizeRefusesAnInconsistentBitmap(t *testing.T) {
	img := bitmapFixture(t)
	e, _ := directoryEntry(t, img, "bm2")
	x := bitmapsExt(t, img)
	patch(t, img, int64(binary.BigEndian.Uint64(fileHead(t, img)[x+16:]))+e.pos+12, be32(bmFlagInUse|bmFlagAuto))
	q, err := openTest(img, testOpts{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	var inconsistent *BitmapInconsistentError
	if err := q.ResizeAllowed(); !errors.As(err, &inconsistent) || inconsistent.Name != "bm2" {
		t.Errorf("ResizeAllowed: %v, want bm2 inconsistent", err)
	}
	if err := q.Resize(context.Background(), 16<<20); !errors.As(err, &inconsistent) {
		t.Errorf("Resize: %v, want bm2 inconsistent", err)
	}
	if q.Size() != 8<<20 {
		t.Errorf("size %d after a refused resize", q.Size())
	}
}

// TestBitmapResizeWhileWritesMark: writes that mark the bitmaps while
// another goroutine grows the image (as the FUSE export grows it under
// writes in flight) lose no mark and race with nothing (-race).
func TestBitmapResizeWhileWritesMark(t *testing.T) {
	img := bitmapFixture(t)
	q, err := openTest(img, testOpts{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for g := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 64 {
				if _, err := q.WriteAt(context.Background(), make([]byte, 512), int64(g*64+i)<<16); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	for size := int64(9 << 20); size <= 16<<20; size += 1 << 20 {
		if err := q.Resize(context.Background(), size); err != nil {
			t.Fatal(err)
		}
	}
	wg.Wait()
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	tool(t, "qemu-img", "check", img)
	var writes [][2]int64
	for b := range int64(128) {
		writes = append(writes, [2]int64{b << 16, 512})
	}
	writes = append(writes, [2]int64{6 << 20, 4096})
	if got, want := qemuDirtyRanges(t, img, "bm0"), dirtyRuns(16<<20, 64<<10, writes...); !slices.Equal(got, want) {
		t.Errorf("bm0 dirty %v, want %v", got, want)
	}
}
