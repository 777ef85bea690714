package stream

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/null"
	"github.com/blockexport/blockexport/formats/drivers/qcow2"
	"github.com/blockexport/blockexport/formats/filters/copyonread"
	"github.com/blockexport/blockexport/formats/registry"
)

// dataImage is a backing image of nonzero bytes (each byte its offset's
// low byte) that fails reads at or past failAt, and counts reads.
type dataImage struct {
	formats.Image
	failAt int64
	reads  atomic.Int64
}

var errBacking = errors.New("backing read failed")

func (d *dataImage) ReadAt(_ context.Context, p []byte, off int64) (int, error) {
	d.reads.Add(1)
	if off+int64(len(p)) > d.failAt {
		return 0, errBacking
	}
	for i := range p {
		p[i] = byte(off+int64(i)) | 1
	}
	return len(p), nil
}

func (d *dataImage) Extent(_ context.Context, off, n int64) (formats.Extent, error) {
	return formats.Extent{Start: off, Length: n, Data: true, Present: true}, nil
}

// overlay makes a qcow2 overlay of size bytes whose backing file is a
// dataImage failing at failAt, and opens it writable.
func overlay(t *testing.T, size, failAt int64) (*qcow2.Image, *dataImage, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "over.qcow2")
	if err := qcow2.Create(path, qcow2.CreateOptions{Size: size, ClusterSize: 65536, BackingFile: "base.raw", BackingFormat: "raw"}); err != nil {
		t.Fatal(err)
	}
	// A file for qemu-img check to open as the backing file; we read
	// the dataImage instead.
	if err := os.WriteFile(filepath.Join(filepath.Dir(path), "base.raw"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	n, err := null.New("base", size, true)
	if err != nil {
		t.Fatal(err)
	}
	d := &dataImage{Image: n, failAt: failAt}
	f, err := aio.Open(path, aio.Options{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	q, err := qcow2.New(context.Background(), f, qcow2.Options{Writable: true, OpenBacking: func(string, string) (formats.Image, error) { return d, nil }})
	if err != nil {
		t.Fatal(err)
	}
	return q, d, path
}

func qemuCheck(t *testing.T, path string) string {
	t.Helper()
	out, err := exec.Command("qemu-img", "check", "-U", "-f", "qcow2", "--output=json", path).CombinedOutput()
	if err != nil {
		t.Fatalf("qemu-img check: %v\n%s", err, out)
	}
	return string(out)
}

// TestStreamStopsAtABackingError: a backing read that fails midway ends
// the stream with that error; the copies so far are flushed (the image
// checks clean), the backing file is still named, and a rerun with a
// healthy backing file copies only the rest.
func TestStreamStopsAtABackingError(t *testing.T) {
	const size = 8 << 20
	q, d, path := overlay(t, size, 5<<20)
	var last int64
	err := Stream(context.Background(), q, StreamOptions{Parallel: 2, Progress: func(_, _, done, _, _ int64) { last = done }})
	if !errors.Is(err, errBacking) {
		t.Fatalf("stream over a failing backing file: %v", err)
	}
	if q.Backing() == nil {
		t.Fatal("the backing file was dropped after a failed copy")
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	qemuCheck(t, path)
	if last <= 0 || last >= size {
		t.Fatalf("progress said %d bytes done before the failure", last)
	}

	// Again, healthy: only what is missing is planned.
	d.failAt = 1 << 62
	f, err := aio.Open(path, aio.Options{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	q, err = qcow2.New(context.Background(), f, qcow2.Options{Writable: true, OpenBacking: func(string, string) (formats.Image, error) { return d, nil }})
	if err != nil {
		t.Fatal(err)
	}
	var planned int64
	if err := Stream(context.Background(), q, StreamOptions{Planned: func(n int64) { planned = n }}); err != nil {
		t.Fatal(err)
	}
	if planned <= 0 || planned > size-last {
		t.Fatalf("the rerun planned %d bytes; %d were copied before", planned, last)
	}
	if q.Backing() != nil {
		t.Fatal("the backing file is still there after the stream")
	}
	buf := make([]byte, size)
	if _, err := q.ReadAt(context.Background(), buf, 0); err != nil {
		t.Fatal(err)
	}
	for i, b := range buf {
		if b != byte(i)|1 {
			t.Fatalf("byte %d is %#x after the stream, want %#x", i, b, byte(i)|1)
		}
	}
	q.Close()
	if out := qemuCheck(t, path); strings.Contains(out, "backing") {
		t.Fatalf("qemu-img check still sees a backing file:\n%s", out)
	}
}

// TestStreamCancelled: a cancelled stream returns the context's error,
// flushed and still layered.
func TestStreamCancelled(t *testing.T) {
	q, _, path := overlay(t, 16<<20, 1<<62)
	ctx, cancel := context.WithCancel(context.Background())
	err := Stream(ctx, q, StreamOptions{Parallel: 3, Progress: func(_, _, done, _, _ int64) {
		if done >= 4<<20 {
			cancel()
		}
	}})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("a cancelled stream: %v", err)
	}
	if q.Backing() == nil {
		t.Fatal("a cancelled stream dropped the backing file")
	}
	q.Close()
	qemuCheck(t, path)
}

// TestCopyOnReadAndStreamNeedABackingFile: copy-on-read needs a layer that
// copies and a backing file; a stream needs a backing file.
func TestCopyOnReadAndStreamNeedABackingFile(t *testing.T) {
	n, _ := null.New("x", 1<<20, true)
	if _, err := copyonread.New(n, "null"); err == nil || !strings.Contains(err.Error(), "qcow2") {
		t.Fatalf("New over a null image: %v", err)
	}
	path := filepath.Join(t.TempDir(), "plain.qcow2")
	if err := qcow2.Create(path, qcow2.CreateOptions{Size: 1 << 20, ClusterSize: 65536}); err != nil {
		t.Fatal(err)
	}
	f, err := aio.Open(path, aio.Options{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	q, err := qcow2.New(context.Background(), f, qcow2.Options{Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	if _, err := copyonread.New(q, "qcow2"); !errors.Is(err, copyonread.ErrNoBacking) {
		t.Fatalf("New over a qcow2 image with no backing file: %v", err)
	}
	if err := Stream(context.Background(), q, StreamOptions{}); !errors.Is(err, ErrNoBackingFile) {
		t.Fatalf("Stream of an image with no backing file: %v", err)
	}
}

// TestStreamToABaseCopiesOnlyTheLayersAboveIt streams top <- mid <- base
// down to mid's backing file at depth 2 (Base), keeping the backing file
// named: top then holds what mid held, still reads as before, and what
// only base holds is still read from base (depth 2), not copied.
func TestStreamToABaseCopiesOnlyTheLayersAboveIt(t *testing.T) {
	dir := t.TempDir()
	run := func(args ...string) {
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out)
		}
	}
	base, mid, top := filepath.Join(dir, "base.qcow2"), filepath.Join(dir, "mid.qcow2"), filepath.Join(dir, "top.qcow2")
	run("qemu-img", "create", "-q", "-f", "qcow2", base, "4M")
	run("qemu-io", "-c", "write -P 1 0 2M", base)
	run("qemu-img", "create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", mid)
	run("qemu-io", "-c", "write -P 2 1M 2M", mid)
	run("qemu-img", "create", "-q", "-f", "qcow2", "-b", "mid.qcow2", "-F", "qcow2", top)
	run("qemu-io", "-c", "write -P 3 2560k 512k", top)
	want := make([]byte, 4<<20)
	for i := range want {
		switch {
		case i >= 2560<<10 && i < 3<<20:
			want[i] = 3
		case i >= 1<<20 && i < 3<<20:
			want[i] = 2
		case i < 2<<20:
			want[i] = 1
		}
	}
	o, err := registry.Open(top, registry.Options{Format: registry.QCOW2, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Image.Close()
	var planned int64
	if err := Stream(t.Context(), o.Image, StreamOptions{Base: 2, Planned: func(n int64) { planned = n }}); err != nil {
		t.Fatal(err)
	}
	if planned != 1536<<10 {
		t.Fatalf("the stream planned %d bytes, want mid's 1.5 MiB under top's own", planned)
	}
	if l, ok := o.Image.(formats.Layered); !ok || l.Backing() == nil || o.Image.Info().BackingFilename != "mid.qcow2" {
		t.Fatal("a stream to a base dropped or changed the backing file")
	}
	got := make([]byte, len(want))
	if _, err := o.Image.ReadAt(t.Context(), got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the image reads other bytes after a stream to a base")
	}
	for _, c := range []struct {
		off   int64
		depth int
	}{{0, 2}, {1 << 20, 0}, {2560 << 10, 0}} {
		e, err := o.Image.Extent(t.Context(), c.off, 4096)
		if err != nil || !e.Present || e.Depth != c.depth {
			t.Fatalf("extent at %d after the stream: %+v, %v; want depth %d", c.off, e, err, c.depth)
		}
	}
}
