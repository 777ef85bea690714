package fuse

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/null"
	"github.com/blockexport/blockexport/formats/registry"
)

var ctx = context.Background()

// These tests call the handlers directly, the way any serve loop does, to
// pin the errno rules that the kernel would otherwise intercept first (a
// read-only mount refuses write opens before a WRITE can reach us).

func newNull(t *testing.T, size int64) formats.Image {
	img, err := null.New("null", size, true)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

func TestWriteOnReadOnlyExportIsEACCES(t *testing.T) {
	e := New(newNull(t, 1<<20), Options{})
	if _, st := e.Write(ctx, &fuse.WriteIn{Offset: 0}, make([]byte, 512)); st != fuse.EACCES {
		t.Fatalf("write: %v, want EACCES", st)
	}
	if st := e.Fallocate(ctx, &fuse.FallocateIn{Length: 4096, Mode: unix.FALLOC_FL_PUNCH_HOLE | unix.FALLOC_FL_KEEP_SIZE}); st != fuse.EACCES {
		t.Fatalf("fallocate: %v, want EACCES", st)
	}
	in := &fuse.SetAttrIn{}
	in.Valid = fuse.FATTR_SIZE
	in.Size = 4096
	if st := e.SetAttr(ctx, in, &fuse.AttrOut{}); st != fuse.EACCES {
		t.Fatalf("truncate: %v, want EACCES", st)
	}
	in.Valid, in.Mode = fuse.FATTR_MODE, 0o600
	if st := e.SetAttr(ctx, in, &fuse.AttrOut{}); st != fuse.EROFS {
		t.Fatalf("chmod u+w: %v, want EROFS", st)
	}
}

func TestWriteClampingAndGrowth(t *testing.T) {
	img := newNull(t, 10000)
	e := New(img, Options{Writable: true})
	n, st := e.Write(ctx, &fuse.WriteIn{Offset: 9000}, make([]byte, 2048))
	if st != fuse.OK || n != 1000 {
		t.Fatalf("write across EOF: %d %v, want 1000 OK", n, st)
	}
	if _, st := e.Write(ctx, &fuse.WriteIn{Offset: 10000}, make([]byte, 1)); st != fuse.Status(unix.ENOSPC) {
		t.Fatalf("write at EOF: %v, want ENOSPC", st)
	}
	g := New(img, Options{Writable: true, Growable: true})
	n, st = g.Write(ctx, &fuse.WriteIn{Offset: 20000}, make([]byte, 150))
	if st != fuse.OK || n != 150 || img.Size() != 20150 {
		t.Fatalf("growable write: %d %v size %d", n, st, img.Size())
	}
}

// readInto serves a READ as a goroutine does: worked out, then read into
// buf, which must hold it.
func readInto(e *Export, in *fuse.ReadIn, buf []byte) (int, fuse.Status) {
	r, _ := e.planRead(in, false)
	defer e.endRead()
	return e.read(ctx, r, buf[:r.size()])
}

// tryReadInto serves a READ as the loop tries it; false: it would wait.
func tryReadInto(e *Export, in *fuse.ReadIn, buf []byte) (int, bool) {
	r, ok := e.planRead(in, true)
	if !ok {
		return 0, false
	}
	defer e.endRead()
	return e.tryRead(r, buf)
}

// lendFromCache serves a READ as a goroutine does, lent from the image's
// cache; false: not lent.
func lendFromCache(e *Export, in *fuse.ReadIn) ([][]byte, func(), fuse.Status, bool) {
	r, _ := e.planRead(in, false)
	defer e.endRead()
	return e.lendCache(ctx, r)
}

func TestReadClamping(t *testing.T) {
	e := New(newNull(t, 10000), Options{})
	buf := make([]byte, 4096)
	n, st := readInto(e, &fuse.ReadIn{Offset: 8000, Size: 4096}, buf)
	if st != fuse.OK || n != 2000 {
		t.Fatalf("read across EOF: %v size %d", st, n)
	}
	n, st = readInto(e, &fuse.ReadIn{Offset: 20000, Size: 4096}, buf)
	if st != fuse.OK || n != 0 {
		t.Fatalf("read past EOF: %v size %d", st, n)
	}
}

func TestLseekRules(t *testing.T) {
	e := New(newNull(t, 1<<20), Options{})
	var out fuse.LseekOut
	if st := e.Lseek(ctx, &fuse.LseekIn{Whence: 0}, &out); st != fuse.EINVAL {
		t.Fatalf("SEEK_SET: %v, want EINVAL", st)
	}
	if st := e.Lseek(ctx, &fuse.LseekIn{Offset: 100, Whence: unix.SEEK_DATA}, &out); st != fuse.Status(unix.ENXIO) {
		t.Fatalf("SEEK_DATA on an all-hole device: %v, want ENXIO", st)
	}
	if st := e.Lseek(ctx, &fuse.LseekIn{Offset: 100, Whence: unix.SEEK_HOLE}, &out); st != fuse.OK || out.Offset != 100 {
		t.Fatalf("SEEK_HOLE: %v %d", st, out.Offset)
	}
	if st := e.Lseek(ctx, &fuse.LseekIn{Offset: 1 << 20, Whence: unix.SEEK_HOLE}, &out); st != fuse.OK || out.Offset != 1<<20 {
		t.Fatalf("SEEK_HOLE at EOF: %v %d", st, out.Offset)
	}
	if st := e.Lseek(ctx, &fuse.LseekIn{Offset: 2 << 20, Whence: unix.SEEK_HOLE}, &out); st != fuse.Status(unix.ENXIO) {
		t.Fatalf("SEEK_HOLE past EOF: %v, want ENXIO", st)
	}
}

func TestSetattrSupportedBits(t *testing.T) {
	e := New(newNull(t, 1<<20), Options{Writable: true})
	in := &fuse.SetAttrIn{}
	in.Valid = fuse.FATTR_MTIME
	if st := e.SetAttr(ctx, in, &fuse.AttrOut{}); st != fuse.Status(unix.ENOTSUP) {
		t.Fatalf("mtime: %v, want ENOTSUP", st)
	}
	in.Valid = fuse.FATTR_UID
	if st := e.SetAttr(ctx, in, &fuse.AttrOut{}); st != fuse.Status(unix.ENOTSUP) {
		t.Fatalf("uid without allow_other: %v, want ENOTSUP", st)
	}
	e.allowOther.Store(true)
	in.Valid, in.Uid = fuse.FATTR_UID|fuse.FATTR_FH|fuse.FATTR_LOCKOWNER, 42
	var out fuse.AttrOut
	if st := e.SetAttr(ctx, in, &out); st != fuse.OK || out.Uid != 42 {
		t.Fatalf("uid with allow_other: %v uid %d", st, out.Uid)
	}
	in.Valid, in.Size = fuse.FATTR_SIZE, 4096
	if st := e.SetAttr(ctx, in, &out); st != fuse.OK || out.Size != 4096 {
		t.Fatalf("resize: %v size %d", st, out.Size)
	}
}

func TestErrnoMapping(t *testing.T) {
	cases := []struct {
		err  error
		want fuse.Status
	}{
		{nil, fuse.OK},
		{fmt.Errorf("wrapped: %w", formats.ErrReadOnly), fuse.EACCES},
		{formats.ErrNotSupported, fuse.Status(syscall.EOPNOTSUPP)},
		{&os.PathError{Op: "pwrite", Path: "x", Err: syscall.ENOSPC}, fuse.Status(syscall.ENOSPC)},
		{context.Canceled, fuse.EINTR},
		{errors.New("anything else"), fuse.EIO},
	}
	for _, c := range cases {
		if got := errno(c.err); got != c.want {
			t.Errorf("errno(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}

// TestClosedImageIsEIO: I/O on an image closed underneath (a shutdown race)
// is an error reply, not a hang, a panic or a read of a recycled fd.
func TestClosedImageIsEIO(t *testing.T) {
	path := filepath.Join(t.TempDir(), "img")
	os.WriteFile(path, make([]byte, 8192), 0o644)
	opened, err := registry.Open(path, registry.Options{Format: registry.Raw, Writable: true, Backend: "threads"})
	if err != nil {
		t.Fatal(err)
	}
	img := opened.Image
	e := New(img, Options{Writable: true})
	img.Close()
	if _, st := readInto(e, &fuse.ReadIn{Size: 4096}, make([]byte, 4096)); st != fuse.EIO {
		t.Fatalf("read from a closed image: %v, want EIO", st)
	}
}
