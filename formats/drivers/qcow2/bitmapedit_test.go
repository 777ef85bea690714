package qcow2

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
)

// openForEdit opens img writable as the bitmap verb does, on f (nil:
// img's own file).
func openForEdit(t *testing.T, img string, f aio.File) *Image {
	t.Helper()
	if f == nil {
		var err error
		if f, err = openTestFile(img, testOpts{Writable: true, Backend: aio.Threads}); err != nil {
			t.Fatal(err)
		}
	}
	q, err := New(context.Background(), f, Options{Writable: true, EditBitmaps: true,
		OpenBacking: func(path, _ string) (formats.Image, error) { return openTest(path, testOpts{Backend: aio.Threads}) }})
	if err != nil {
		t.Fatalf("open %s to edit its bitmaps: %v", img, err)
	}
	return q
}

// errWriteCut is the write a simulated crash never made.
var errWriteCut = errors.New("write cut off by the simulated crash")

// cutFile lets the first writes through and refuses every write after
// (writes, vectored writes, fallocate): the file is as a process killed
// at that instant left it.
type cutFile struct {
	aio.File
	left atomic.Int64
}

func (f *cutFile) pass() bool { return f.left.Add(-1) >= 0 }

func (f *cutFile) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	if !f.pass() {
		return 0, errWriteCut
	}
	return f.File.WriteAt(ctx, p, off)
}

func (f *cutFile) WritevAt(ctx context.Context, iov [][]byte, off int64) (int, error) {
	if !f.pass() {
		return 0, errWriteCut
	}
	return f.File.WritevAt(ctx, iov, off)
}

func (f *cutFile) TryWriteAt([]byte, int64) (bool, error) { return false, nil }

func (f *cutFile) Fallocate(ctx context.Context, mode uint32, off, n int64) error {
	if !f.pass() {
		return errWriteCut
	}
	return f.File.Fallocate(ctx, mode, off, n)
}

// bitmapsSeen is the bitmaps of img and the dirty blocks of those not in
// use, as QEMU's tools see them.
func bitmapsSeen(t *testing.T, img string) string {
	t.Helper()
	b := qemuBitmaps(t, img)
	s := ""
	for _, name := range []string{"bm0", "bm1", "bm2", "new"} {
		if x, ok := b[name]; ok {
			s += fmt.Sprintf("%s %v %d", name, x.Flags, x.Granularity)
			if !strings.Contains(fmt.Sprint(x.Flags), "in-use") {
				s += fmt.Sprintf(" %v", qemuDirtyRanges(t, img, name))
			}
			s += "\n"
		}
	}
	return s
}

// TestBitmapEditCutShortAtEveryWriteLeavesBitmapsBeforeOrAfter cuts each
// edit off before its first write, its second, ... until it completes:
// each time qemu-img check finds no corruption (leaked clusters at most)
// and the bitmaps are exactly as before or as after.
func TestBitmapEditCutShortAtEveryWriteLeavesBitmapsBeforeOrAfter(t *testing.T) {
	fixture := bitmapFixture(t)
	edits := map[string]func(ctx context.Context, e *BitmapEdit) error{
		"add":    func(_ context.Context, e *BitmapEdit) error { return e.Add("new", 4096, false) },
		"remove": func(_ context.Context, e *BitmapEdit) error { return e.Remove("bm2") },
		"merge and disable": func(ctx context.Context, e *BitmapEdit) error {
			if err := e.Merge(ctx, "bm0", nil, "bm1"); err != nil {
				return err
			}
			return e.Disable("bm0")
		},
		"remove all": func(_ context.Context, e *BitmapEdit) error {
			for _, n := range []string{"bm0", "bm1", "bm2"} {
				if err := e.Remove(n); err != nil {
					return err
				}
			}
			return nil
		},
	}
	before := bitmapsSeen(t, fixture)
	for name, edit := range edits {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			var want string
			states := map[string]int{}
			for n := int64(0); ; n++ {
				if n > 200 {
					t.Fatal("the edit still writes after 200 writes")
				}
				img := filepath.Join(t.TempDir(), "cut.qcow2")
				copyFileForTest(t, fixture, img)
				raw, err := openTestFile(img, testOpts{Writable: true, Backend: aio.Threads})
				if err != nil {
					t.Fatal(err)
				}
				f := &cutFile{File: raw}
				f.left.Store(1 << 40)
				q := openForEdit(t, img, f)
				e, err := q.EditBitmaps(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if err := edit(ctx, e); err != nil {
					t.Fatal(err)
				}
				f.left.Store(n)
				err = e.Commit(ctx)
				if err == nil {
					err = q.Close() // the frees are written at close
				} else {
					raw.Close() // the crash: nothing more reaches the file
				}
				if err != nil && !errors.Is(err, errWriteCut) {
					t.Fatalf("cut after %d writes: %v", n, err)
				}
				out, cerr := execOut("qemu-img", "check", img)
				var ee *exec.ExitError
				if cerr != nil && !(errors.As(cerr, &ee) && ee.ExitCode() == 3) {
					t.Fatalf("cut after %d writes: qemu-img check: %v\n%s", n, cerr, out)
				}
				got := bitmapsSeen(t, img)
				if err == nil {
					if cerr != nil {
						t.Fatalf("the completed edit leaks:\n%s", out)
					}
					want = got
					if want == before {
						t.Fatal("the edit changes nothing qemu-img sees")
					}
					states["after"]++
					break
				}
				switch got {
				case before:
					states["before"]++
				default:
					// It can only be "after": checked once the whole edit
					// has shown what after is.
					states[got]++
				}
			}
			for s, k := range states {
				switch s {
				case "before", "after":
				case want:
					states["after"] += k
					delete(states, s)
				default:
					t.Errorf("%d cuts left the bitmaps\n%s\nneither as before\n%s\nnor as after\n%s", k, s, before, want)
				}
			}
			t.Logf("cut at every write: %v", states)
			if states["before"] == 0 {
				t.Errorf("no cut left the bitmaps as before: %v", states)
			}
		})
	}
}

// TestBitmapAddRefusesAsQemu: names and granularities at and past QEMU's
// limits, accepted or refused as qemu-img bitmap --add accepts or refuses
// them, in its words.
func TestBitmapAddRefusesAsQemu(t *testing.T) {
	img := filepath.Join(t.TempDir(), "limits.qcow2")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", img, "64M")
	q := openForEdit(t, img, nil)
	defer q.Close()
	e, err := q.EditBitmaps(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	persist := "Can't make bitmap '%s' persistent in '" + img + "': "
	long := strings.Repeat("x", 1024)
	for _, c := range []struct {
		name string
		gran int64
		want string // "" accepted
	}{
		{"", 0, "Bitmap name cannot be empty"},
		{strings.Repeat("y", 1023), 0, ""},
		{long, 0, fmt.Sprintf(persist, long) + "Name length exceeds maximum (1023 characters)"},
		{"g256", 256, "Granularity must be power of 2 and at least 512"},
		{"g512", 512, ""},
		{"g3000", 3000, "Granularity must be power of 2 and at least 512"},
		{"g2^31", 1 << 31, ""},
		{"g2^32", 1 << 32, "Granularity must be power of 2 and at least 512"},
		{"gneg", -1, "Granularity must be power of 2 and at least 512"},
		{"g512", 1024, "Bitmap already exists: g512"},
	} {
		err := e.Add(c.name, c.gran, false)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("add %.20q -g %d: %v", c.name, c.gran, err)
		case c.want != "" && (err == nil || err.Error() != c.want || !errors.Is(err, ErrBitmapOp)):
			t.Errorf("add %.20q -g %d: %v; want %q", c.name, c.gran, err, c.want)
		}
	}
	e.dirSize = maxBitmapDirectorySize - 24
	if err := e.Add("full", 0, false); err == nil || err.Error() != fmt.Sprintf(persist, "full")+"Not enough space in the bitmap directory" {
		t.Errorf("add to a full directory: %v", err)
	}
}

// TestBitmapEditKeepsTheBackingFileName: the header is rewritten with the
// extension added and removed; the backing file name that follows the
// extensions moves with them.
func TestBitmapEditKeepsTheBackingFileName(t *testing.T) {
	dir := t.TempDir()
	base, img := filepath.Join(dir, "base.qcow2"), filepath.Join(dir, "overlay.qcow2")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", base, "8M")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", img)
	ctx := context.Background()
	for _, step := range []func(e *BitmapEdit) error{
		func(e *BitmapEdit) error { return e.Add("bm", 0, false) },
		func(e *BitmapEdit) error { return e.Remove("bm") },
	} {
		q := openForEdit(t, img, nil)
		e, err := q.EditBitmaps(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := step(e); err != nil {
			t.Fatal(err)
		}
		if err := e.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if err := q.Close(); err != nil {
			t.Fatal(err)
		}
		info := tool(t, "qemu-img", "info", img)
		if !strings.Contains(info, "backing file: "+base) || !strings.Contains(info, "backing file format: qcow2") {
			t.Fatalf("the backing file is lost:\n%s", info)
		}
		tool(t, "qemu-img", "check", img)
	}
	if b := qemuBitmaps(t, img); len(b) != 0 {
		t.Errorf("bitmaps %+v after the removal", b)
	}
}

// TestBitmapEditRefusesThe65536thBitmap: 65535 bitmaps, QEMU's most, are
// stored, read back and checked clean; one more is refused in QEMU's
// words. (qemu-img itself takes many minutes to open so many: its own
// refusal is checked on a directory the extension claims is full.)
func TestBitmapEditRefusesThe65536thBitmap(t *testing.T) {
	img := filepath.Join(t.TempDir(), "many.qcow2")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=512", img, "1M")
	ctx := context.Background()
	q := openForEdit(t, img, nil)
	e, err := q.EditBitmaps(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i := range maxBitmaps {
		if err := e.Add(fmt.Sprintf("b%d", i), 0, i%2 == 0); err != nil {
			t.Fatalf("bitmap %d: %v", i, err)
		}
	}
	if err := e.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	want := "Maximum number of persistent bitmaps is already reached"
	if err := e.Add("one-more", 0, false); err == nil || !strings.HasSuffix(err.Error(), want) {
		t.Errorf("the 65536th bitmap: %v; want %q", err, want)
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	res, err := checkImage(t, img, RepairNone)
	if err != nil || res.Corruptions != 0 || res.Leaks != 0 {
		t.Fatalf("check of 65535 bitmaps: %+v, %v", res, err)
	}
	q = openForEdit(t, img, nil)
	defer q.Close()
	e, err = q.EditBitmaps(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(e.bitmaps) != maxBitmaps || e.find("b65534") == nil || e.find("b65534").entry.flags != 0 || e.find("b65533").entry.flags != bmFlagAuto {
		t.Fatalf("read back %d bitmaps", len(e.bitmaps))
	}
	if err := e.Add("one-more", 0, false); err == nil || !strings.HasSuffix(err.Error(), want) {
		t.Errorf("the 65536th bitmap after a reopen: %v; want %q", err, want)
	}
}

// TestBitmapDefaultGranularityIsQemus: --add without -g takes the
// granularity qemu-img's does, for clusters below, inside and above its
// 4 KiB to 64 KiB range.
func TestBitmapDefaultGranularityIsQemus(t *testing.T) {
	for _, cs := range []string{"512", "4096", "65536", "2M"} {
		img := filepath.Join(t.TempDir(), "default.qcow2")
		tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size="+cs, img, "64M")
		tool(t, "qemu-img", "bitmap", "--add", img, "theirs")
		q, err := openTest(img, testOpts{Backend: aio.Threads})
		if err != nil {
			t.Fatal(err)
		}
		ours := q.DefaultBitmapGranularity()
		q.Close()
		if theirs := qemuBitmaps(t, img)["theirs"].Granularity; ours != theirs {
			t.Errorf("clusters of %s: default granularity %d, qemu-img's %d", cs, ours, theirs)
		}
	}
}
