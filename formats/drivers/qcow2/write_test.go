package qcow2

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/blockexport/blockexport/aio"
)

// checkClean runs qemu-img check, which exits non-zero on corruption and
// on leaks alike.
func checkClean(t *testing.T, img string) {
	t.Helper()
	out, err := exec.Command("qemu-img", "check", "-f", "qcow2", img).CombinedOutput()
	if err != nil {
		t.Fatalf("qemu-img check %s: %v\n%s", img, err, out)
	}
}

// compareRaw asserts that the qcow2 image reads (through QEMU) as mirror.
func compareRaw(t *testing.T, img string, mirror []byte) {
	t.Helper()
	raw := filepath.Join(t.TempDir(), "mirror.raw")
	if err := os.WriteFile(raw, mirror, 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("qemu-img", "compare", "-f", "qcow2", "-F", "raw", img, raw).CombinedOutput()
	if err != nil {
		t.Fatalf("qemu-img compare: %v\n%s", err, out)
	}
}

func openRW(t *testing.T, img string, direct ...bool) *Image {
	t.Helper()
	q, err := openTest(img, testOpts{Writable: true, Backend: aio.Threads, Direct: len(direct) > 0 && direct[0]})
	if err != nil {
		t.Fatalf("open %s writable: %v", img, err)
	}
	return q
}

// randomWrites applies count random writes (and some zeroings and
// discards) to q and to mirror, from several goroutines on disjoint
// stripes, so that the outcome is defined.
func randomWrites(t *testing.T, q *Image, mirror []byte, count int, seed uint64) {
	t.Helper()
	ctx := context.Background()
	const workers = 4
	size := int64(len(mirror))
	stripe := size / workers
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(seed, uint64(w)))
			base := int64(w) * stripe
			for range count {
				n := 1 + r.Int64N(min(stripe, 200_000))
				off := base + r.Int64N(stripe-n+1)
				switch r.IntN(10) {
				case 0:
					if err := q.WriteZeroes(ctx, off, n, r.IntN(2) == 0); err != nil {
						errs <- err
						return
					}
					clear(mirror[off : off+n])
				default:
					p := make([]byte, n)
					fill(r, p)
					if _, err := q.WriteAt(ctx, p, off); err != nil {
						errs <- err
						return
					}
					copy(mirror[off:], p)
				}
				if r.IntN(20) == 0 {
					if err := q.Flush(ctx); err != nil {
						errs <- err
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

func readAll(t *testing.T, q *Image) []byte {
	t.Helper()
	got := make([]byte, q.Size())
	if _, err := q.ReadAt(context.Background(), got, 0); err != nil {
		t.Fatal(err)
	}
	return got
}

func TestWritesKeepTheImageConsistent(t *testing.T) {
	type setup struct {
		name   string
		create func(t *testing.T, dir string) (img string, initial []byte)
		// noZeroRange: copy-on-write from zeroes writes zero bytes, as on
		// a file system without FALLOC_FL_ZERO_RANGE.
		noZeroRange bool
		direct      bool // O_DIRECT (--cache none)
	}
	const size = 8 << 20
	plain := func(opts string) func(t *testing.T, dir string) (string, []byte) {
		return func(t *testing.T, dir string) (string, []byte) {
			p := filepath.Join(dir, "t.qcow2")
			tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", opts, p, strconv.Itoa(size))
			return p, make([]byte, size)
		}
	}
	setups := []setup{
		{name: "cluster64k", create: plain("cluster_size=65536")},
		{name: "cluster512", create: plain("cluster_size=512")},
		{name: "cluster64k-without-zero-range", create: plain("cluster_size=65536"), noZeroRange: true},
		{name: "cluster64k-direct", create: plain("cluster_size=65536"), direct: true},
		{name: "cluster512-direct", create: plain("cluster_size=512"), direct: true},
		{name: "cluster4k-refcount1", create: plain("cluster_size=4096,refcount_bits=1")},
		{name: "cluster2m-refcount64", create: plain("cluster_size=2097152,refcount_bits=64")},
		{name: "compat0.10", create: plain("compat=0.10")},
		{name: "overlay", create: func(t *testing.T, dir string) (string, []byte) {
			base := filepath.Join(dir, "base.raw")
			initial := make([]byte, size)
			fill(rand.New(rand.NewPCG(7, 7)), initial)
			if err := os.WriteFile(base, initial[:size-1<<20], 0o644); err != nil {
				t.Fatal(err)
			}
			clear(initial[size-1<<20:]) // past the backing file: zeroes
			p := filepath.Join(dir, "over.qcow2")
			tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "raw", "-o", "cluster_size=65536", p, strconv.Itoa(size))
			return p, initial
		}},
		{name: "compressed", create: func(t *testing.T, dir string) (string, []byte) {
			src := filepath.Join(dir, "src.raw")
			initial := bytes.Repeat([]byte("compressible data, cluster after cluster. "), size/42+1)[:size]
			if err := os.WriteFile(src, initial, 0o644); err != nil {
				t.Fatal(err)
			}
			p := filepath.Join(dir, "c.qcow2")
			tool(t, "qemu-img", "convert", "-q", "-c", "-f", "raw", "-O", "qcow2", src, p)
			return p, initial
		}},
	}
	for _, s := range setups {
		t.Run(s.name, func(t *testing.T) {
			dir := t.TempDir()
			img, mirror := s.create(t, dir)
			q := openRW(t, img, s.direct)
			q.w.noZeroRange.Store(s.noZeroRange)
			randomWrites(t, q, mirror, 60, 1)
			if got := readAll(t, q); !bytes.Equal(got, mirror) {
				t.Fatalf("read back differs from what was written at byte %d", firstDiff(got, mirror))
			}
			if err := q.Close(); err != nil {
				t.Fatal(err)
			}
			checkClean(t, img)
			compareRaw(t, img, mirror)
			// A second session on the same image, then again.
			q = openRW(t, img, s.direct)
			randomWrites(t, q, mirror, 30, 2)
			if err := q.Close(); err != nil {
				t.Fatal(err)
			}
			checkClean(t, img)
			compareRaw(t, img, mirror)
		})
	}
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

func TestRefcountTableGrows(t *testing.T) {
	// 512-byte clusters with 64-bit refcounts: one refcount block counts 64
	// clusters and the first table 64 blocks, so 4 MiB of writes need a
	// bigger table, more than once.
	dir := t.TempDir()
	img := filepath.Join(dir, "t.qcow2")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=512,refcount_bits=64", img, "16M")
	q := openRW(t, img)
	mirror := make([]byte, 16<<20)
	p := make([]byte, 1<<20)
	r := rand.New(rand.NewPCG(3, 3))
	for i := range 6 {
		fill(r, p)
		off := int64(i) * (2 << 20)
		if _, err := q.WriteAt(context.Background(), p, off); err != nil {
			t.Fatal(err)
		}
		copy(mirror[off:], p)
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	checkClean(t, img)
	compareRaw(t, img, mirror)
	out := tool(t, "qemu-img", "info", img)
	if !strings.Contains(out, "virtual size: 16 MiB") {
		t.Fatalf("qemu-img info:\n%s", out)
	}
}

func TestOverlayWritesLeaveTheBackingFileAlone(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", base, "4M")
	qio(t, base, "write -P 0x5a 0 4M")
	before, err := os.ReadFile(base)
	if err != nil {
		t.Fatal(err)
	}
	over := filepath.Join(dir, "over.qcow2")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", over)
	q := openRW(t, over)
	mirror := bytes.Repeat([]byte{0x5a}, 4<<20)
	randomWrites(t, q, mirror, 40, 4)
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	after, err := os.ReadFile(base)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(before, after) {
		t.Fatal("writes to the overlay changed the backing file")
	}
	checkClean(t, over)
	compareRaw(t, over, mirror)
}

func TestResize(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	base := filepath.Join(dir, "base.raw")
	if err := os.WriteFile(base, bytes.Repeat([]byte{0xbb}, 3<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(dir, "t.qcow2")
	// 512-byte clusters: one L1 entry maps 32 KiB, so growth moves the L1.
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "raw", "-o", "cluster_size=512", img, "1M")
	q := openRW(t, img)
	mirror := bytes.Repeat([]byte{0xbb}, 1<<20)
	if _, err := q.WriteAt(ctx, []byte("end"), 1<<20-3); err != nil {
		t.Fatal(err)
	}
	copy(mirror[1<<20-3:], "end")
	// Grow to 5 MiB + 100 bytes: rounded up to 512; the part the backing
	// file covers must read as zeroes, not 0xbb.
	if err := q.Resize(ctx, 5<<20+100); err != nil {
		t.Fatal(err)
	}
	if q.Size() != 5<<20+512 {
		t.Fatalf("size %d after growing to 5 MiB + 100", q.Size())
	}
	mirror = append(mirror, make([]byte, 4<<20+512)...)
	if _, err := q.WriteAt(ctx, []byte("tail"), q.Size()-4); err != nil {
		t.Fatal(err)
	}
	copy(mirror[len(mirror)-4:], "tail")
	if got := readAll(t, q); !bytes.Equal(got, mirror) {
		t.Fatalf("after growing, byte %d differs", firstDiff(got, mirror))
	}
	// Shrink into the middle of a cluster, then grow again: the cut-off
	// part must come back as zeroes.
	if err := q.Resize(ctx, 1<<20-1024); err != nil {
		t.Fatal(err)
	}
	if err := q.Resize(ctx, 2<<20); err != nil {
		t.Fatal(err)
	}
	mirror = append(mirror[:1<<20-1024], make([]byte, 1<<20+1024)...)
	if got := readAll(t, q); !bytes.Equal(got, mirror) {
		t.Fatalf("after shrinking and growing, byte %d differs", firstDiff(got, mirror))
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	checkClean(t, img)
	compareRaw(t, img, mirror)
}

// TestWritesWithInternalSnapshots: writing an image with a snapshot
// copies the shared L2 tables and data clusters; the snapshot still holds
// the old data (qemu-img snapshot -a brings it back), both states check
// clean. Shrinking, allowed as in QEMU 7.2 (v3), frees only the active
// layer's references: the snapshot keeps its clusters.
func TestWritesWithInternalSnapshots(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "snap.qcow2")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=4096", img, "4M")
	qio(t, img, "write -c -P 0x6b 1M 64k", "write -P 0x5a 0 1M", "write -P 0x5a 1088k 3008k")
	tool(t, "qemu-img", "snapshot", "-c", "before", img)
	before := make([]byte, 4<<20)
	for i := range before {
		before[i] = 0x5a
	}
	copy(before[1<<20:], bytes.Repeat([]byte{0x6b}, 64<<10))

	q := openRW(t, img)
	mirror := slices.Clone(before)
	randomWrites(t, q, mirror, 40, 11)
	ctx := context.Background()
	if err := q.Resize(ctx, 2<<20); err != nil {
		t.Fatalf("shrinking an image with snapshots: %v", err)
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	checkClean(t, img)
	if out := tool(t, "qemu-img", "info", "--output=json", img); !strings.Contains(out, `"virtual-size": 2097152`) {
		t.Fatalf("the shrunk image's size:\n%s", out)
	}
	compareRaw(t, img, mirror[:2<<20])
	if out := tool(t, "qemu-img", "snapshot", "-l", img); !strings.Contains(out, "before") {
		t.Fatalf("the snapshot is gone:\n%s", out)
	}
	tool(t, "qemu-img", "snapshot", "-a", "before", img)
	checkClean(t, img)
	compareRaw(t, img, before)
}

func fill(r *rand.Rand, p []byte) {
	for i := range p {
		p[i] = byte(r.Uint32())
	}
}

func TestTryWriteAtOnlyWritesOwnedClusters(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "t.qcow2")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", img, "4M")
	qio(t, img, "write -P 0x11 0 192k", "write -c -P 0x22 1M 64k", "write -z 2M 64k")
	q := openRW(t, img)
	ctx := context.Background()
	mirror := readAll(t, q) // also caches the L2 table
	p := bytes.Repeat([]byte{0x77}, 100_000)
	for _, c := range []struct {
		what string
		off  int64
		want bool
	}{
		{"allocated clusters (three, host-contiguous)", 30_000, true},
		{"past the allocated clusters", 150_000, false},
		{"a compressed cluster", 1 << 20, false},
		{"a zero cluster", 2 << 20, false},
		{"unallocated", 3 << 20, false},
	} {
		done, err := q.TryWriteAt(p, c.off)
		if done != c.want || err != nil {
			t.Fatalf("%s: done %v, %v; want done %v", c.what, done, err, c.want)
		}
		if !done {
			// The slow path does it.
			if _, err := q.WriteAt(ctx, p, c.off); err != nil {
				t.Fatal(err)
			}
		}
		copy(mirror[c.off:], p)
	}
	if got := readAll(t, q); !bytes.Equal(got, mirror) {
		t.Fatalf("byte %d differs", firstDiff(got, mirror))
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	checkClean(t, img)
	compareRaw(t, img, mirror)
}

func TestGrowAnEmptyImage(t *testing.T) {
	for _, cs := range []int64{512, 65536} {
		img := filepath.Join(t.TempDir(), "empty.qcow2")
		if err := Create(img, CreateOptions{Size: 0, ClusterSize: cs}); err != nil {
			t.Fatal(err)
		}
		checkClean(t, img)
		q := openRW(t, img)
		ctx := context.Background()
		if err := q.Resize(ctx, 3<<20); err != nil {
			t.Fatal(err)
		}
		p := bytes.Repeat([]byte{0x42}, 100_000)
		if _, err := q.WriteAt(ctx, p, 2<<20); err != nil {
			t.Fatal(err)
		}
		if err := q.Close(); err != nil {
			t.Fatal(err)
		}
		checkClean(t, img)
		mirror := make([]byte, 3<<20)
		copy(mirror[2<<20:], p)
		compareRaw(t, img, mirror)
	}
}

// TestMissingCopiedFlags: tables and clusters with refcount one but
// without the COPIED flag (as older tools leave them) are still written:
// the L1 entry gets its flag back, the data cluster is copied once.
func TestMissingCopiedFlags(t *testing.T) {
	img := filepath.Join(t.TempDir(), "t.qcow2")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", img, "4M")
	qio(t, img, "write -P 0x31 0 128k")
	raw, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	l1 := int64(binary.BigEndian.Uint64(raw[40:]))
	l1e := binary.BigEndian.Uint64(raw[l1:])
	l2 := int64(l1e & l1OffsetMask)
	l2e := binary.BigEndian.Uint64(raw[l2:])
	patch(t, img, l1, be64(l1e&^oflagCopied))
	patch(t, img, l2, be64(l2e&^oflagCopied))
	q := openRW(t, img)
	if _, err := q.WriteAt(context.Background(), []byte("hello"), 100); err != nil {
		t.Fatalf("write under a table without COPIED: %v", err)
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	checkClean(t, img)
	mirror := make([]byte, 4<<20)
	copy(mirror, bytes.Repeat([]byte{0x31}, 128<<10))
	copy(mirror[100:], "hello")
	compareRaw(t, img, mirror)
}

// TestGrowKeepsWritesThatRaceIt: growing an overlay whose backing file is
// longer zeroes the new part; a writer that sees the new size before that
// zeroing is done (the FUSE export grows on a write past the end while
// other writes run) must not have its data zeroed after it returned. The
// export's fsx found this: the tail of a kernel write-back WRITE read as
// zeroes after a second write-back WRITE grew the image past it.
func TestGrowKeepsWritesThatRaceIt(t *testing.T) {
	for _, compat := range []string{"0.10", "1.1"} {
		t.Run("compat="+compat, func(t *testing.T) {
			dir := t.TempDir()
			ctx := context.Background()
			base := filepath.Join(dir, "base.raw")
			if err := os.WriteFile(base, nil, 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(base, 8<<20); err != nil {
				t.Fatal(err)
			}
			for round := range 4 {
				img := filepath.Join(dir, fmt.Sprintf("t%d.qcow2", round))
				// 512-byte clusters: zeroing the new part takes many steps.
				tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "raw",
					"-o", "cluster_size=512,compat="+compat, img, "1M")
				q := openRW(t, img)
				want := bytes.Repeat([]byte{0x5c}, 4096)
				off := int64(8<<20 - 8192)
				errc := make(chan error, 1)
				go func() {
					// As a write that finds the image already long enough.
					for q.Size() < off+int64(len(want)) {
						runtime.Gosched()
					}
					_, err := q.WriteAt(ctx, want, off)
					errc <- err
				}()
				if err := q.Resize(ctx, 8<<20); err != nil {
					t.Fatal(err)
				}
				if err := <-errc; err != nil {
					t.Fatal(err)
				}
				got := make([]byte, len(want))
				if _, err := q.ReadAt(ctx, got, off); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, want) {
					t.Fatalf("round %d: a write made once the image had grown reads back as %#x... (the grow's zeroing overwrote it)", round, got[:8])
				}
				if err := q.Close(); err != nil {
					t.Fatal(err)
				}
				checkClean(t, img)
			}
		})
	}
}

// TestRefcountTableHeldWithoutItsZeros: a writable image holds its
// refcount table without the trailing zero entries (a small image's
// table is a whole cluster of them); writes that need new refcount blocks
// still fill the file's table in place, without moving it, and the image
// checks clean and reads back as written.
func TestRefcountTableHeldWithoutItsZeros(t *testing.T) {
	// 512-byte clusters, 16-bit refcounts: a block counts 256 clusters, the
	// one-cluster table has 64 entries, of which a new image uses one.
	img := filepath.Join(t.TempDir(), "t.qcow2")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=512", img, "4M")
	tableAt := func() uint64 {
		b, err := os.ReadFile(img)
		if err != nil {
			t.Fatal(err)
		}
		return binary.BigEndian.Uint64(b[48:])
	}
	before := tableAt()
	q := openRW(t, img)
	if len(q.w.rtable) != 1 || q.w.rtEntries != 64 {
		t.Fatalf("refcount table held as %d entries of the file's %d, want 1 of 64", len(q.w.rtable), q.w.rtEntries)
	}
	mirror := make([]byte, 4<<20)
	p := make([]byte, 1<<20)
	r := rand.New(rand.NewPCG(4, 4))
	for _, off := range []int64{0, 2 << 20} {
		fill(r, p)
		if _, err := q.WriteAt(context.Background(), p, off); err != nil {
			t.Fatal(err)
		}
		copy(mirror[off:], p)
	}
	if n := len(q.w.rtable); n < 8 || q.w.rtEntries != 64 {
		t.Fatalf("after 2 MiB of writes the refcount table holds %d entries of %d, want at least 8 of 64", n, q.w.rtEntries)
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	if after := tableAt(); after != before {
		t.Fatalf("the refcount table moved from %#x to %#x: the file's table had room", before, after)
	}
	checkClean(t, img)
	compareRaw(t, img, mirror)
}
