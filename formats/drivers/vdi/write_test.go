package vdi

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/driver"
)

// errKilled is a write that did not happen because the process died.
var errKilled = errors.New("killed")

// killedFile lets the first n writes through and drops the rest, as a
// process killed (SIGKILL) after its n-th write leaves the file: each
// write is one pwrite, which a kill does not cut.
type killedFile struct {
	aio.File
	n, writes int
}

func (k *killedFile) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	if k.writes >= k.n {
		return 0, errKilled
	}
	k.writes++
	return k.File.WriteAt(ctx, p, off)
}

func (k *killedFile) WritevAt(ctx context.Context, iov [][]byte, off int64) (int, error) {
	return k.WriteAt(ctx, bytes.Join(iov, nil), off)
}

func createImage(t *testing.T, size int64, static bool) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "w.vdi")
	o := driver.CreateOptions{Size: size}
	if static {
		o.Keys = map[string]string{"static": "on"}
	}
	if err := Create(p, o); err != nil {
		t.Fatal(err)
	}
	return p
}

func openWritable(t *testing.T, f aio.File) (*Image, error) {
	img, err := New(context.Background(), f, Options{Writable: true})
	if err == nil {
		t.Cleanup(func() { img.Close() })
	}
	return img, err
}

func openFile(t *testing.T, p string) aio.File {
	t.Helper()
	f, err := aio.Open(p, aio.Options{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// qemuCheck runs qemu-img check and returns its exit status and ERROR lines.
func qemuCheck(t *testing.T, p string) (int, []string) {
	t.Helper()
	out, err := exec.Command("qemu-img", "check", "-f", "vdi", p).CombinedOutput()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("qemu-img check (apt-get install -y qemu-utils): %v", err)
	}
	var errs []string
	for _, l := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(l, "ERROR") {
			errs = append(errs, l)
		}
	}
	return code, errs
}

// TestCreateLaysOutAsQemuImg: the header (UUIDs aside), the block map and
// the file's size are qemu-img create's, dynamic and static, for sizes
// from nothing to a map past one sector and an odd size rounded up.
func TestCreateLaysOutAsQemuImg(t *testing.T) {
	for _, size := range []int64{0, 512, 1000, 3 << 20, 200<<20 + 512, 1 << 30} {
		for _, static := range []bool{false, true} {
			ours := createImage(t, size, static)
			theirs := filepath.Join(t.TempDir(), "q.vdi")
			args := []string{"create", "-q", "-f", "vdi", "-o", "static=off", theirs, strconv.FormatInt(size, 10)}
			if static {
				args[5] = "static=on"
			}
			if out, err := exec.Command("qemu-img", args...).CombinedOutput(); err != nil {
				t.Fatalf("qemu-img %v: %v\n%s", args, err, out)
			}
			// The data of a static image is a hole: the header and map
			// are what differ, and the file's size.
			a, b := readHead(t, ours), readHead(t, theirs)
			if len(a) != len(b) {
				t.Fatalf("size %d static %v: file of %d bytes, qemu-img's %d", size, static, len(a), len(b))
			}
			uuids := [2]int{offBmapField + 52, offBmapField + 84} // image and last-snapshot UUIDs
			if !bytes.Equal(a[:uuids[0]], b[:uuids[0]]) || !bytes.Equal(a[uuids[1]:], b[uuids[1]:]) {
				t.Fatalf("size %d static %v: the image differs from qemu-img's beyond the UUIDs", size, static)
			}
			if bytes.Equal(a[uuids[0]:uuids[1]], make([]byte, 32)) {
				t.Fatal("UUIDs left null")
			}
			if code, errs := qemuCheck(t, ours); code != 0 {
				t.Fatalf("qemu-img check: exit %d %v", code, errs)
			}
		}
	}
}

// readHead is the file's first MiB, its length the file's size there.
func readHead(t *testing.T, p string) []byte {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, min(fi.Size(), 1<<20))
	if _, err := f.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	return append(b, []byte(strconv.FormatInt(fi.Size(), 10))...)
}

// TestCreateRefusesBeforeMakingAFile: what qemu-img refuses is refused
// in its words, and no file is left.
func TestCreateRefusesBeforeMakingAFile(t *testing.T) {
	for _, c := range []struct {
		keys map[string]string
		size int64
		want string
	}{
		{map[string]string{"static": "maybe"}, 1 << 20, "Parameter 'static' expects 'on' or 'off'"},
		{map[string]string{"cluster_size": "2M"}, 1 << 20, "Invalid parameter 'cluster_size'"},
		{map[string]string{"preallocation": "metadata"}, 1 << 20, "Unsupported preallocation mode: metadata"},
		{map[string]string{"preallocation": "foo"}, 1 << 20, "invalid parameter value: foo"},
		{map[string]string{"nocow": "x"}, 1 << 20, "Parameter 'nocow' expects 'on' or 'off'"},
		{map[string]string{"extent_size_hint": "abc"}, 1 << 20, "Parameter 'extent_size_hint' expects"},
		{nil, maxDiskSize + 512, "Unsupported VDI image size (size is 0x1fffff8000200, max supported is 0x1fffff8000000)"},
	} {
		p := filepath.Join(t.TempDir(), "x.vdi")
		err := Create(p, driver.CreateOptions{Size: c.size, Keys: c.keys})
		if err == nil || !errors.Is(err, driver.ErrBadOption) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want %q", c.keys, err, c.want)
		}
		if _, err := os.Stat(p); err == nil {
			t.Errorf("%v: a file was left", c.keys)
		}
	}
}

// writeOp is a write, a zero write or a discard, each followed by a flush.
type writeOp struct {
	off  int64
	n    int64
	fill byte // 0 with zero: a zero write
	zero bool
	dis  bool
}

func (w writeOp) do(ctx context.Context, img *Image) error {
	var err error
	switch {
	case w.zero:
		err = img.WriteZeroes(ctx, w.off, w.n, true)
	case w.dis:
		err = img.Discard(ctx, w.off, w.n)
	default:
		_, err = img.WriteAt(ctx, bytes.Repeat([]byte{w.fill}, int(w.n)), w.off)
	}
	if err != nil {
		return err
	}
	return img.Flush(ctx)
}

// apply is the disk after w, as read; a discard leaves it as it was.
func (w writeOp) apply(disk []byte) {
	switch {
	case w.dis:
	case w.zero:
		clear(disk[w.off : w.off+w.n])
	default:
		for i := w.off; i < w.off+w.n; i++ {
			disk[i] = w.fill
		}
	}
}

// TestAllocationKilledAfterEveryWrite: a writer killed after each of its
// writes (data, the count and the entry, in place) leaves an image qemu-img
// check finds clean, where every write flushed before the kill reads back
// and that opens for writing again and takes more.
// Blocks far into a big disk, whose entries lie past the header's write,
// may leave one leaked block (the count ahead of the entries), which
// qemu-img counts as an "allocated blocks mismatch" and nothing else; the
// next allocation takes it, and the image is clean again.
func TestAllocationKilledAfterEveryWrite(t *testing.T) {
	const mib = 1 << 20
	for _, c := range []struct {
		name string
		size int64
		base int64 // where the writes go
		// leakOK: a kill between the count and the entry may leave a leak.
		leakOK bool
	}{
		{"entries in the header's write", 8 * mib, 0, false},
		{"entries past it", 20 << 30, 20000 * mib, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			ops := []writeOp{
				{off: c.base + 4096, n: 8192, fill: 0x11},               // allocates block 0
				{off: c.base + 100, n: 50, fill: 0x22},                  // in place
				{off: c.base + 2*mib - 512, n: 4096, fill: 0x33},        // allocates two blocks
				{off: c.base + 4096, n: 4096, zero: true},               // zeroes written in place
				{off: c.base + 5*mib, n: mib, zero: true},               // zeroes over nothing: nothing
				{off: c.base + mib, n: mib, dis: true},                  // discard: nothing
				{off: c.base + 6*mib + 77, n: 3 * 4096, fill: 0x44},     // one more
				{off: c.base + 2*mib - 512, n: 1024, fill: 0x55},        // in place, across blocks
				{off: c.base + 3*mib + mib/2, n: 4096, fill: 0x66},      // allocates
				{off: c.base + 7*mib + 4096, n: mib - 8192, fill: 0x77}, // allocates the last
			}
			orig := createImage(t, c.size, false)
			// The writes a whole run makes.
			full := copyFile(t, orig)
			k := &killedFile{File: openFile(t, full), n: 1 << 30}
			img, err := openWritable(t, k)
			if err != nil {
				t.Fatal(err)
			}
			img.SetNoFlush(true)
			for _, w := range ops {
				if err := w.do(context.Background(), img); err != nil {
					t.Fatal(err)
				}
			}
			total := k.writes
			window := int64(8 * mib)
			leaks := 0
			for n := 0; n <= total; n++ {
				p := copyFile(t, orig)
				k := &killedFile{File: openFile(t, p), n: n}
				img, err := openWritable(t, k)
				if err != nil {
					t.Fatal(err)
				}
				// A killed process loses no write it made: the syncs (which
				// order writes for a power loss) change nothing here but the
				// time taken.
				img.SetNoFlush(true)
				want := make([]byte, window)
				var inFlight *writeOp
				for i, w := range ops {
					if err := w.do(context.Background(), img); err != nil {
						if !errors.Is(err, errKilled) {
							t.Fatalf("kill after %d writes: op %d: %v", n, i, err)
						}
						inFlight = &ops[i]
						break
					}
					w.off -= c.base
					w.apply(want)
				}
				img.Close()
				code, errs := qemuCheck(t, p)
				leak := code == 2 && len(errs) == 1 && strings.Contains(errs[0], "allocated blocks mismatch")
				if leak {
					leaks++
				}
				if code != 0 && !(c.leakOK && leak) {
					t.Fatalf("kill after %d of %d writes: qemu-img check exit %d: %v", n, total, code, errs)
				}
				got := ourRead(t, p, c.base, window)
				if inFlight != nil { // either state is right for the bytes in flight
					lo, hi := inFlight.off-c.base, inFlight.off-c.base+inFlight.n
					copy(got[lo:hi], want[lo:hi])
				}
				if !bytes.Equal(got, want) {
					t.Fatalf("kill after %d of %d writes: a flushed write does not read back", n, total)
				}
				if !leak && n%4 != 0 {
					continue // the reopening below is tried on a few
				}
				// It opens for writing again and takes a leaked block first.
				img2, err := openWritable(t, openFile(t, p))
				if err != nil {
					t.Fatalf("kill after %d writes: reopen: %v", n, err)
				}
				more := writeOp{off: c.base + 5*mib + 512, n: 512, fill: 0x99}
				if err := more.do(context.Background(), img2); err != nil {
					t.Fatal(err)
				}
				img2.Close()
				// The new block is the leaked one, if any: the image is clean.
				if code2, errs2 := qemuCheck(t, p); code2 != 0 {
					t.Fatalf("kill after %d writes: a write after reopening: qemu-img check exit %d %v (was %d %v)", n, code2, errs2, code, errs)
				}
			}
			if c.leakOK && leaks == 0 {
				t.Fatal("no kill came between the count and the entry")
			}
			t.Logf("killed after each of %d writes; %d left a leaked block", total, leaks)
		})
	}
}

func copyFile(t *testing.T, p string) string {
	t.Helper()
	q := filepath.Join(t.TempDir(), "copy.vdi")
	if out, err := exec.Command("cp", "--sparse=always", p, q).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v\n%s", err, out)
	}
	return q
}

// ourRead is n bytes of the disk at off as a fresh read-only open reads
// them (the reader is checked against qemu-img elsewhere).
func ourRead(t *testing.T, p string, off, n int64) []byte {
	t.Helper()
	img, err := openPath(t, p)
	if err != nil {
		t.Fatalf("open after the kill: %v", err)
	}
	defer img.Close()
	b := make([]byte, n)
	if _, err := img.ReadAt(context.Background(), b, off); err != nil {
		t.Fatal(err)
	}
	return b
}

// qemuRead is n bytes of the disk at off as qemu-img reads them.
func qemuRead(t *testing.T, p string, off, n int64) []byte {
	t.Helper()
	raw := filepath.Join(t.TempDir(), "r.raw")
	if out, err := exec.Command("qemu-img", "convert", "-f", "vdi", "-O", "raw", p, raw).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img convert: %v\n%s", err, out)
	}
	f, err := os.Open(raw)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestWritesOnStaticAndDynamicImagesReadBack: writes, zeroes and discards
// on a static and a dynamic image read back; a static image allocates
// nothing more, a dynamic one allocates only blocks given data, in the
// order written; resize is refused as QEMU refuses it.
func TestWritesOnStaticAndDynamicImagesReadBack(t *testing.T) {
	ctx := context.Background()
	for _, static := range []bool{false, true} {
		p := createImage(t, 5<<20, static)
		img, err := openWritable(t, openFile(t, p))
		if err != nil {
			t.Fatal(err)
		}
		want := make([]byte, 5<<20)
		for _, w := range []writeOp{
			{off: 3 << 20, n: 4096, fill: 1}, {off: 1<<20 - 10, n: 20, fill: 2}, {off: 0, n: 4096, zero: true},
			{off: 2 << 20, n: 1 << 20, zero: true}, {off: 3 << 20, n: 1024, dis: true}, {off: 5<<20 - 512, n: 512, fill: 3},
		} {
			if err := w.do(ctx, img); err != nil {
				t.Fatal(err)
			}
			w.apply(want)
		}
		got := make([]byte, len(want))
		if _, err := img.ReadAt(ctx, got, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("static %v: reads differ from the writes", static)
		}
		if err := img.Resize(ctx, 10<<20); !errors.Is(err, formats.ErrNotSupported) {
			t.Fatalf("resize: %v", err)
		}
		if static {
			if img.alloc.count != 5 {
				t.Fatalf("static image: %d blocks allocated", img.alloc.count)
			}
		} else if got := img.bmap; !equalU32(got, []uint32{1, 2, unallocated, 0, 3}) {
			t.Fatalf("block map %x, want blocks 3, 0, 1, 4 allocated in that order", got)
		}
		img.Close()
		if code, errs := qemuCheck(t, p); code != 0 {
			t.Fatalf("qemu-img check: %d %v", code, errs)
		}
		if !bytes.Equal(qemuRead(t, p, 0, 5<<20), want) {
			t.Fatal("qemu-img reads differently")
		}
	}
}

func equalU32(a, b []uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestHostileImagesOpenedWritable: every crafted image the reader refuses
// is refused for writing too, in one line; one whose map a writer cannot
// extend safely is refused for writing; every other one takes a write in
// each block that reads back, with the header and map changed only in
// the count and in entries that were unallocated, and qemu-img check as
// clean after as before.
func TestHostileImagesOpenedWritable(t *testing.T) {
	ctx := context.Background()
	for _, c := range hostileCases() {
		t.Run(c.name, func(t *testing.T) {
			s := goodSpec()
			c.mod(&s)
			path := s.build(t)
			before := readHead(t, path)
			// qemu-img check reads the header's whole map (up to 2 GiB):
			// only where it is small.
			qemuChecks := !c.qemuRefuses && c.want == nil && s.blocksInImage < 1<<16
			qcode := 0
			if qemuChecks {
				qcode, _ = qemuCheck(t, path)
			}
			img, err := openWritable(t, openFile(t, path))
			switch {
			case c.want != nil && err == nil:
				t.Fatal("opens for writing; the reader refuses it")
			case err != nil && strings.Contains(err.Error(), "\n"):
				t.Fatalf("refusal is not one line: %q", err)
			case c.want != nil:
				return
			case err != nil:
				if !errors.Is(err, ErrDamaged) {
					t.Fatalf("refused: %v", err)
				}
				t.Logf("refused for writing: %v", err)
				return
			}
			want := make([]byte, img.Size())
			if _, err := img.ReadAt(ctx, want, 0); err != nil {
				t.Fatal(err)
			}
			for off := int64(512); off < img.Size() && off < 8*blockSize; off += blockSize {
				w := writeOp{off: off, n: min(4096, img.Size()-off), fill: byte(off>>20) + 0xa0}
				if err := w.do(ctx, img); err != nil {
					t.Fatalf("write at %d: %v", off, err)
				}
				w.apply(want)
			}
			img.Close()
			back, err := openPath(t, path)
			if err != nil {
				t.Fatalf("reopen: %v", err)
			}
			got := make([]byte, back.Size())
			if _, err := back.ReadAt(ctx, got, 0); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatal("the writes do not read back")
			}
			after := readHead(t, path)
			le := binary.LittleEndian
			mapAt := int(s.offBmap)
			for i := 0; i < min(mapAt, len(before)-20); i++ {
				if (i < allocatedField || i >= allocatedField+4) && before[i] != after[i] {
					t.Fatalf("header byte %#x changed", i)
				}
			}
			for i := range s.bmap {
				at := mapAt + 4*i
				if at+4 > len(before)-20 {
					break
				}
				if old := le.Uint32(before[at:]); old < discarded && old != le.Uint32(after[at:]) {
					t.Fatalf("entry %d of an allocated block changed", i)
				}
			}
			if qemuChecks && qcode == 0 {
				if code, errs := qemuCheck(t, path); code != 0 {
					t.Fatalf("qemu-img check after the writes: %d %v", code, errs)
				}
			}
		})
	}
}

// TestConcurrentWritesAllocateEachBlockOnce: writers racing on the same
// unallocated blocks (each its own 4 KiB of them) allocate each block
// once, every write reads back, and readers meanwhile see either zeroes
// or the written bytes, never another block's.
func TestConcurrentWritesAllocateEachBlockOnce(t *testing.T) {
	ctx := context.Background()
	p := createImage(t, 8<<20, false)
	img, err := openWritable(t, openFile(t, p))
	if err != nil {
		t.Fatal(err)
	}
	const writers = 16
	errs := make(chan error, 2*writers)
	for w := range writers {
		go func() {
			buf := bytes.Repeat([]byte{byte(w + 1)}, 4096)
			var err error
			for b := int64(0); b < 4 && err == nil; b++ {
				_, err = img.WriteAt(ctx, buf, b<<20+int64(w)*4096)
			}
			errs <- err
		}()
		go func() {
			got := make([]byte, 4096)
			var err error
			for b := int64(0); b < 4 && err == nil; b++ {
				if _, err = img.ReadAt(ctx, got, b<<20+int64(w)*4096); err == nil {
					if s := strings.Trim(string(got), string([]byte{0, byte(w + 1)})); s != "" {
						err = errors.New("a read saw bytes no write put there")
					}
				}
			}
			errs <- err
		}()
	}
	for range 2 * writers {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if err := img.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if img.alloc.count != 4 {
		t.Fatalf("%d blocks allocated for 4 written", img.alloc.count)
	}
	got := make([]byte, 4096)
	for b := int64(0); b < 4; b++ {
		for w := range writers {
			if _, err := img.ReadAt(ctx, got, b<<20+int64(w)*4096); err != nil || !bytes.Equal(got, bytes.Repeat([]byte{byte(w + 1)}, 4096)) {
				t.Fatalf("block %d, writer %d: the write does not read back (%v)", b, w, err)
			}
		}
	}
	img.Close()
	if code, errs := qemuCheck(t, p); code != 0 {
		t.Fatalf("qemu-img check: %d %v", code, errs)
	}
}

// TestMetadataWritesNeverReachData: a metadata write that would end past
// the block map, into the data, is refused and writes nothing.
func TestMetadataWritesNeverReachData(t *testing.T) {
	p := createImage(t, 3<<20, false)
	img, err := openWritable(t, openFile(t, p))
	if err != nil {
		t.Fatal(err)
	}
	before := readHead(t, p)
	for _, off := range []int64{int64(img.h.OffsetData) - 2, img.alloc.metaEnd, -1, 1 << 40} {
		if err := img.writeMeta(context.Background(), make([]byte, 4), off, "a test entry"); err == nil || !strings.Contains(err.Error(), "overlap the data") {
			t.Errorf("metadata write at %#x: %v", off, err)
		}
	}
	if !bytes.Equal(readHead(t, p), before) {
		t.Fatal("a refused metadata write changed the file")
	}
	// TryWriteAt writes in place only: an unallocated block waits.
	if done, _ := img.TryWriteAt(make([]byte, 512), 0); done {
		t.Fatal("TryWriteAt allocated a block")
	}
	if _, err := img.WriteAt(context.Background(), []byte{1}, 0); err != nil {
		t.Fatal(err)
	}
	if done, err := img.TryWriteAt([]byte{2}, 1); !done || err != nil {
		t.Fatalf("TryWriteAt in an allocated, cached block: %v %v", done, err)
	}
	got := make([]byte, 2)
	img.ReadAt(context.Background(), got, 0)
	if !bytes.Equal(got, []byte{1, 2}) {
		t.Fatalf("read %v", got)
	}
}
