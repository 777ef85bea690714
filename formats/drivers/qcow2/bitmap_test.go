package qcow2

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"math"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/driver"
)

// The tests of persistent dirty bitmaps judge what QEMU's own tools see:
// qemu-img check and info, and the dirty blocks qemu-nbd exports.

// qemuBitmap is one bitmap as `qemu-img info --output=json` lists it.
type qemuBitmap struct {
	Name        string   `json:"name"`
	Flags       []string `json:"flags"`
	Granularity int64    `json:"granularity"`
}

// qemuBitmaps lists img's bitmaps as qemu-img info sees them.
func qemuBitmaps(t *testing.T, img string) map[string]qemuBitmap {
	t.Helper()
	var info struct {
		FormatSpecific struct {
			Data struct {
				Bitmaps []qemuBitmap `json:"bitmaps"`
			} `json:"data"`
		} `json:"format-specific"`
	}
	if err := json.Unmarshal([]byte(tool(t, "qemu-img", "info", "-U", "--output=json", img)), &info); err != nil {
		t.Fatal(err)
	}
	m := map[string]qemuBitmap{}
	for _, b := range info.FormatSpecific.Data.Bitmaps {
		m[b.Name] = b
	}
	return m
}

// qemuDirtyRanges is the dirty blocks of bitmap in img as qemu-nbd
// exports them (nbdinfo --map), merged into sorted [start, end) runs.
func qemuDirtyRanges(t *testing.T, img, bitmap string) [][2]int64 {
	t.Helper()
	for _, tool := range [][2]string{{"qemu-nbd", "qemu-utils"}, {"nbdinfo", "libnbd-bin"}} {
		if _, err := exec.LookPath(tool[0]); err != nil {
			t.Fatalf("%s is missing: apt-get install %s", tool[0], tool[1])
		}
	}
	sock := filepath.Join(t.TempDir(), "nbd.sock")
	// --persistent: the connect that sees it listen (the socket file
	// exists from bind, before listen) must not end it.
	srv := exec.Command("qemu-nbd", "-t", "-r", "-f", "qcow2", "-B", bitmap, "-k", sock, img)
	var log bytes.Buffer
	srv.Stdout, srv.Stderr = &log, &log
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- srv.Wait() }()
	defer func() {
		srv.Process.Kill()
		<-exited
	}()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			break
		}
		select {
		case err := <-exited:
			exited <- err
			t.Fatalf("qemu-nbd -B %s exited: %v\n%s", bitmap, err, log.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("qemu-nbd did not listen in time\n%s", log.String())
		}
	}
	out := tool(t, "nbdinfo", "--map=qemu:dirty-bitmap:"+bitmap, "nbd+unix:///?socket="+sock)
	var runs [][2]int64
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 3 || f[2] != "1" {
			continue
		}
		start, err1 := strconv.ParseInt(f[0], 10, 64)
		n, err2 := strconv.ParseInt(f[1], 10, 64)
		if err1 != nil || err2 != nil {
			t.Fatalf("nbdinfo line %q", sc.Text())
		}
		if k := len(runs) - 1; k >= 0 && runs[k][1] == start {
			runs[k][1] += n
		} else {
			runs = append(runs, [2]int64{start, start + n})
		}
	}
	return runs
}

// dirtyRuns is what a bitmap of granularity gran over size bytes holds
// after writes to ranges ([off, n) pairs): each rounded out to whole
// blocks, merged.
func dirtyRuns(size, gran int64, ranges ...[2]int64) [][2]int64 {
	dirty := make([]bool, (size+gran-1)/gran)
	for _, r := range ranges {
		for b := r[0] / gran; b <= (r[0]+r[1]-1)/gran; b++ {
			dirty[b] = true
		}
	}
	var runs [][2]int64
	for b, d := range dirty {
		if !d {
			continue
		}
		start, end := int64(b)*gran, min(int64(b+1)*gran, size)
		if k := len(runs) - 1; k >= 0 && runs[k][1] == start {
			runs[k][1] = end
		} else {
			runs = append(runs, [2]int64{start, end})
		}
	}
	return runs
}

// bitmapFixture is an 8 MiB image with data, a snapshot and three
// bitmaps: bm1 disabled with 5M+64k dirty, bm0 (64 KiB granularity) and
// bm2 (512 bytes) enabled with 6M+4k dirty; all marked by qemu-io.
func bitmapFixture(t *testing.T) string {
	t.Helper()
	img := filepath.Join(t.TempDir(), "bitmaps.qcow2")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", img, "8M")
	qio(t, img, "write -P 0xaa 0 1M")
	tool(t, "qemu-img", "snapshot", "-c", "s1", img)
	tool(t, "qemu-img", "bitmap", "--add", img, "bm1")
	qio(t, img, "write -P 0x11 5M 64k")
	tool(t, "qemu-img", "bitmap", "--disable", img, "bm1")
	tool(t, "qemu-img", "bitmap", "--add", img, "bm0")
	tool(t, "qemu-img", "bitmap", "--add", "-g", "512", img, "bm2")
	qio(t, img, "write -P 0x22 6M 4k")
	return img
}

// directoryEntry finds bitmap name in img's directory as the file has it.
func directoryEntry(t *testing.T, img, name string) (bitmapEntry, []byte) {
	t.Helper()
	q, err := openTest(img, testOpts{Backend: aio.Threads})
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	_, entries, err := q.readBitmapDirectory(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.name == name {
			raw := make([]byte, e.tableSize*8)
			if _, err := q.f.ReadAt(context.Background(), raw, e.tableOff); err != nil {
				t.Fatal(err)
			}
			return e, raw
		}
	}
	t.Fatalf("no bitmap %q in %s", name, img)
	return bitmapEntry{}, nil
}

// TestBitmapSurvivesAWriteSession: writes, write-zeroes and discards
// through a writable open mark the enabled bitmaps, and a clean close
// stores them so that qemu-img check finds no leak, info no bitmap in
// use, and qemu-nbd exactly the written blocks; the disabled one comes
// back as it was.
func TestBitmapSurvivesAWriteSession(t *testing.T) {
	img := bitmapFixture(t)
	bm1Before := qemuDirtyRanges(t, img, "bm1")
	if want := [][2]int64{{5 << 20, 5<<20 + 64<<10}}; !slices.Equal(bm1Before, want) {
		t.Fatalf("bm1 before the session: %v, want %v", bm1Before, want)
	}
	entry1, table1 := directoryEntry(t, img, "bm1")

	q, err := openTest(img, testOpts{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	if b := qemuBitmaps(t, img); !slices.Equal(b["bm0"].Flags, []string{"in-use", "auto"}) || !slices.Equal(b["bm1"].Flags, []string{}) {
		t.Errorf("while open for writing, qemu-img info shows %+v; want bm0 in use, bm1 untouched", b)
	}
	ctx := context.Background()
	written := [][2]int64{{100_000, 50_000}, {2<<20 + 10, 70_000}, {3 << 20, 128 << 10}, {7<<20 + 4096, 512}}
	if _, err := q.WriteAt(ctx, bytes.Repeat([]byte{0x5a}, 50_000), 100_000); err != nil {
		t.Fatal(err)
	}
	if err := q.WriteZeroes(ctx, 2<<20+10, 70_000, false); err != nil {
		t.Fatal(err)
	}
	if err := q.Discard(ctx, 3<<20, 128<<10); err != nil {
		t.Fatal(err)
	}
	if _, err := q.WriteAt(ctx, bytes.Repeat([]byte{0x6b}, 512), 7<<20+4096); err != nil {
		t.Fatal(err)
	}
	// The non-blocking path: a cluster the image owns (written after the
	// snapshot), its L2 table and pages cached by the read before.
	if _, err := q.ReadAt(ctx, make([]byte, 64<<10), 6<<20); err != nil {
		t.Fatal(err)
	}
	if done, err := q.TryWriteAt(bytes.Repeat([]byte{0x7c}, 512), 6<<20+8192); err != nil || !done {
		t.Fatalf("TryWriteAt into an owned, cached cluster: done %v, %v", done, err)
	}
	written = append(written, [2]int64{6<<20 + 8192, 512})
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}

	if out, err := execOut("qemu-img", "check", img); err != nil || strings.Contains(out, "leaked") {
		t.Fatalf("qemu-img check after the session: %v\n%s", err, out)
	}
	b := qemuBitmaps(t, img)
	for name, flags := range map[string][]string{"bm0": {"auto"}, "bm1": {}, "bm2": {"auto"}} {
		if !slices.Equal(b[name].Flags, flags) {
			t.Errorf("bitmap %s flags %q after close, want %q", name, b[name].Flags, flags)
		}
	}
	pre := [2]int64{6 << 20, 4096}
	for name, gran := range map[string]int64{"bm0": 64 << 10, "bm2": 512} {
		want := dirtyRuns(8<<20, gran, append(written, pre)...)
		if got := qemuDirtyRanges(t, img, name); !slices.Equal(got, want) {
			t.Errorf("%s dirty blocks %v, want %v", name, got, want)
		}
	}
	if got := qemuDirtyRanges(t, img, "bm1"); !slices.Equal(got, bm1Before) {
		t.Errorf("disabled bm1 dirty blocks %v, want %v as before", got, bm1Before)
	}
	entry1After, table1After := directoryEntry(t, img, "bm1")
	if entry1After.tableOff != entry1.tableOff || entry1After.flags != entry1.flags || !bytes.Equal(table1, table1After) {
		t.Errorf("disabled bm1 changed: %+v %x, was %+v %x", entry1After, table1After, entry1, table1)
	}
	// Our own check agrees: bitmap clusters are references, not leaks.
	if res, err := checkImage(t, img, RepairNone); err != nil || res.Leaks != 0 || res.Corruptions != 0 {
		t.Errorf("our check: %+v %v", res, err)
	}
	// A second session stores again over what the first stored.
	q, err = openTest(img, testOpts{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := q.WriteAt(ctx, []byte{1}, 8<<20-1); err != nil {
		t.Fatal(err)
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	tool(t, "qemu-img", "check", img)
	want := dirtyRuns(8<<20, 64<<10, append(written, pre, [2]int64{8<<20 - 1, 1})...)
	if got := qemuDirtyRanges(t, img, "bm0"); !slices.Equal(got, want) {
		t.Errorf("after a second session bm0 dirty blocks %v, want %v", got, want)
	}
}

// TestBitmapStaysInUseAfterACrash: a writer that dies after a write
// leaves the enabled bitmap marked in use, so that no tool trusts it.
func TestBitmapStaysInUseAfterACrash(t *testing.T) {
	img := bitmapFixture(t)
	q, err := openTest(img, testOpts{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := q.WriteAt(context.Background(), make([]byte, 4096), 0); err != nil {
		t.Fatal(err)
	}
	q.f.Close() // the process dies: nothing more is written
	b := qemuBitmaps(t, img)
	if !slices.Equal(b["bm0"].Flags, []string{"in-use", "auto"}) || !slices.Equal(b["bm2"].Flags, []string{"in-use", "auto"}) {
		t.Errorf("after a crash qemu-img info shows %+v; want bm0 and bm2 in use", b)
	}
	if out, err := execOut("qemu-nbd", "-r", "-f", "qcow2", "-B", "bm0", "-k", filepath.Join(t.TempDir(), "s"), img); err == nil ||
		!strings.Contains(out, "inconsistent") {
		t.Errorf("qemu-nbd -B bm0 after a crash: %v, want it refused as inconsistent\n%s", err, out)
	}
}

// TestBitmapInUseAtOpenIsLeftAlone: a bitmap already in use (it missed
// writes before) is neither loaded nor stored nor cleared, as QEMU
// leaves it; the image still opens for writing, as in QEMU.
func TestBitmapInUseAtOpenIsLeftAlone(t *testing.T) {
	img := bitmapFixture(t)
	e, table := directoryEntry(t, img, "bm0")
	x := bitmapsExt(t, img)
	dirOff := int64(binary.BigEndian.Uint64(fileHead(t, img)[x+16:]))
	patch(t, img, dirOff+e.pos+12, be32(bmFlagInUse|bmFlagAuto))
	q, err := openTest(img, testOpts{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := q.WriteAt(context.Background(), make([]byte, 4096), 0); err != nil {
		t.Fatal(err)
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	tool(t, "qemu-img", "check", img)
	after, tableAfter := directoryEntry(t, img, "bm0")
	if after.flags != bmFlagInUse|bmFlagAuto || after.tableOff != e.tableOff || !bytes.Equal(table, tableAfter) {
		t.Errorf("in-use bm0 became %+v (table %x), want it as it was, %#x at %#x (table %x)", after, tableAfter, bmFlagInUse|bmFlagAuto, e.tableOff, table)
	}
	if b := qemuBitmaps(t, img); !slices.Equal(b["bm2"].Flags, []string{"auto"}) {
		t.Errorf("bm2 flags %q, want it stored", b["bm2"].Flags)
	}
}

// TestBitmapClustersAreMetadata: a data write that an L2 entry sends onto
// a bitmap's data cluster is refused as a metadata overlap, and the
// bitmaps stay in use (the session is not clean).
func TestBitmapClustersAreMetadata(t *testing.T) {
	img := bitmapFixture(t)
	e, table := directoryEntry(t, img, "bm0")
	data := int64(binary.BigEndian.Uint64(table) & bmTableOffsetMask)
	if data == 0 {
		t.Fatalf("bm0's first table entry has no data cluster: %x", table)
	}
	l := readLayout(t, img)
	q, err := openTest(img, testOpts{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	for _, off := range []int64{int64(binary.BigEndian.Uint64(fileHead(t, img)[bitmapsExt(t, img)+16:])), e.tableOff, data} {
		q.meta.RLock()
		k := q.w.metaMap.overlap(off/l.cs, off/l.cs+1, metaNone)
		q.meta.RUnlock()
		if k != metaBitmap {
			t.Errorf("host cluster %#x counts as %v, want %v", off, k, metaBitmap)
		}
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}

	// The close stored bm0 anew: point guest cluster 0 at its new data.
	_, table = directoryEntry(t, img, "bm0")
	data = int64(binary.BigEndian.Uint64(table) & bmTableOffsetMask)
	patch(t, img, l.l2, be64(uint64(data)|oflagCopied))
	q, err = openTest(img, testOpts{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	_, err = q.WriteAt(context.Background(), make([]byte, 512), 0)
	if err == nil || !strings.Contains(err.Error(), "persistent dirty bitmap") {
		t.Errorf("write onto a bitmap data cluster: %v, want it refused naming the bitmap", err)
	}
	q.Close()
	if b := qemuBitmaps(t, img); !slices.Contains(b["bm0"].Flags, "in-use") {
		t.Errorf("bm0 flags %q after a refused session, want in-use", b["bm0"].Flags)
	}
}

// TestBitmapArithmetic: the sizes derived from a disk's size and a
// granularity hold up to 2^63, where a product would overflow.
func TestBitmapArithmetic(t *testing.T) {
	for _, size := range []int64{0, 1, 511, 512, 513, 64 << 20, 1 << 61, math.MaxInt64 - 1, math.MaxInt64} {
		for _, gran := range []uint8{9, 16, 30, 31} {
			for _, cs := range []int64{512, 65536, 2 << 20} {
				s, g := big.NewInt(size), new(big.Int).Lsh(big.NewInt(1), uint(gran))
				ceil := func(a, b *big.Int) *big.Int {
					return new(big.Int).Div(new(big.Int).Add(a, new(big.Int).Sub(b, big.NewInt(1))), b)
				}
				bits := ceil(s, g)
				byteCount := ceil(bits, big.NewInt(8))
				entries := ceil(byteCount, big.NewInt(cs))
				if got := bitmapBits(size, gran); got != bits.Uint64() {
					t.Errorf("bitmapBits(%d, %d) = %d, want %v", size, gran, got, bits)
				}
				if got := bitmapTableEntries(size, gran, cs); got != entries.Uint64() {
					t.Errorf("bitmapTableEntries(%d, %d, %d) = %d, want %v", size, gran, cs, got, entries)
				}
				// A consistent bitmap's table has exactly the entries the
				// disk needs (QEMU's load_bitmap_data), within the limits;
				// an in-use one may have any number within them.
				fits := entries.Sign() > 0 && entries.Cmp(big.NewInt(bmMaxPhysBytes/cs)) <= 0
				for _, n := range []int64{entries.Int64() - 1, entries.Int64(), entries.Int64() + 1, bmMaxPhysBytes / cs} {
					if !entries.IsInt64() {
						n = bmMaxPhysBytes / cs
					}
					if n < 0 {
						continue
					}
					e := bitmapEntry{name: "b", tableOff: cs, tableSize: n, granBits: gran}
					ok := fits && n == entries.Int64()
					if err := e.check(bmTypeDirty, 1, cs, size, math.MaxInt64); (err == nil) != ok {
						t.Errorf("size %d granularity 2^%d clusters %d table %d: check says %v, want ok %v", size, gran, cs, n, err, ok)
					}
					e.flags = bmFlagInUse
					inUseOK := n > 0 && n <= bmMaxPhysBytes/cs
					if err := e.check(bmTypeDirty, 1, cs, size, math.MaxInt64); (err == nil) != inUseOK {
						t.Errorf("in use, size %d granularity 2^%d table %d: check says %v, want ok %v", size, gran, n, err, inUseOK)
					}
				}
			}
		}
	}
	// Marking near the end of the largest disk sets the last bit only.
	b := &liveBitmap{granBits: 31, nbits: bitmapBits(math.MaxInt64, 31)}
	b.words = make([]atomic.Uint64, (b.nbits+63)/64)
	b.mark(math.MaxInt64-1, 1)
	last := b.nbits - 1
	for i := range b.words {
		want := uint64(0)
		if uint64(i) == last/64 {
			want = 1 << (last % 64)
		}
		if got := b.words[i].Load(); got != want {
			t.Errorf("word %d = %#x, want %#x", i, got, want)
		}
	}
}

// FuzzBitmapDirectory: any directory bytes parse or are refused, never a
// panic; what parses is within every limit and encodes back to itself.
func FuzzBitmapDirectory(f *testing.F) {
	good := encodeBitmapDirectory([]bitmapEntry{{name: "bm0", tableOff: 0x30000, tableSize: 1, flags: bmFlagAuto, granBits: 16},
		{name: "b1", tableOff: 0x40000, tableSize: 1, granBits: 9}})
	f.Add(good, uint32(2), uint8(16), int64(64<<20))
	f.Add(good[:40], uint32(2), uint8(16), int64(64<<20))
	f.Add(good, uint32(1), uint8(9), int64(math.MaxInt64))
	f.Fuzz(func(t *testing.T, dir []byte, count uint32, clusterBits uint8, size int64) {
		cs := int64(1) << (minClusterBits + clusterBits%(maxClusterBits-minClusterBits+1))
		entries, err := parseBitmapDirectory(dir, count, cs, size, 1<<40)
		if err != nil {
			return
		}
		if uint32(len(entries)) != count {
			t.Fatalf("%d entries for a count of %d", len(entries), count)
		}
		for _, e := range entries {
			if e.tableOff <= 0 || e.tableOff%cs != 0 || e.tableSize <= 0 || e.tableSize*cs > bmMaxPhysBytes ||
				e.granBits < bmMinGranularity || e.granBits > bmMaxGranularity || len(e.name) == 0 || len(e.name) > bmMaxNameSize {
				t.Fatalf("accepted an entry out of bounds: %+v", e)
			}
		}
		again, err := parseBitmapDirectory(encodeBitmapDirectory(slices.Clone(entries)), count, cs, size, 1<<40)
		if err != nil {
			t.Fatalf("the encoding of what parsed does not parse: %v", err)
		}
		for i := range entries {
			a, b := entries[i], again[i]
			a.pos, b.pos = 0, 0
			if a != b {
				t.Fatalf("entry %d: %+v encodes back as %+v", i, a, b)
			}
		}
	})
}

// checkImage runs our check on img.
func checkImage(t *testing.T, img string, repair int) (formats.CheckResult, error) {
	t.Helper()
	f, err := openTestFile(img, testOpts{Backend: aio.Threads, Writable: repair != RepairNone})
	if err != nil {
		t.Fatal(err)
	}
	return Check(context.Background(), f, driver.Options{}, repair)
}

// craftedEntry is a bitmap directory entry as a test writes it, every
// field free.
type craftedEntry struct {
	tableOff  uint64
	tableSize uint32
	flags     uint32
	typ, gran uint8
	name      string
	nameLen   int // -1: len(name)
	extra     []byte
}

func (e craftedEntry) encode() []byte {
	be := binary.BigEndian
	b := be.AppendUint64(nil, e.tableOff)
	b = be.AppendUint32(b, e.tableSize)
	b = be.AppendUint32(b, e.flags)
	n := e.nameLen
	if n < 0 {
		n = len(e.name)
	}
	b = append(b, e.typ, e.gran)
	b = be.AppendUint16(b, uint16(n))
	b = be.AppendUint32(b, uint32(len(e.extra)))
	b = append(append(b, e.extra...), e.name...)
	for len(b)%8 != 0 {
		b = append(b, 0)
	}
	return b
}

// craftedLayout is where a crafted-directory fixture keeps things.
type craftedLayout struct {
	layout
	ext, dirOff int64
	entry       craftedEntry // bm0 as qemu-img wrote it
	data        int64        // bm0's first data cluster
}

// writeDirectory replaces img's directory with entries, the extension
// saying count bitmaps in size bytes (-1: the entries' length).
func writeDirectory(t *testing.T, img string, l craftedLayout, count uint32, size int64, entries ...craftedEntry) {
	t.Helper()
	var dir []byte
	for _, e := range entries {
		dir = append(dir, e.encode()...)
	}
	if int64(len(dir)) > l.cs {
		t.Fatalf("crafted directory of %d bytes does not fit its cluster", len(dir))
	}
	if size < 0 {
		size = int64(len(dir))
	}
	patch(t, img, l.dirOff, dir)
	patch(t, img, l.ext, be32(count))
	patch(t, img, l.ext+8, be64(uint64(size)))
}

// TestBitmapDirectoryCraftedFieldsRefuseWritableOpen: each field of a
// directory entry at zero, at its limit and one past: what QEMU refuses
// to open for writing, a writable open refuses too, with an error that
// names the fault (and more: what overlaps other metadata); nothing
// panics; and a read-only open still reads the disk.
func TestBitmapDirectoryCraftedFieldsRefuseWritableOpen(t *testing.T) {
	base := filepath.Join(t.TempDir(), "base.qcow2")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=4096", base, "64M")
	qio(t, base, "write -P 0xaa 0 1M")
	tool(t, "qemu-img", "bitmap", "--add", "-g", "512", base, "bm0")
	qio(t, base, "write -P 0xbb 0 4k")
	want := bytes.Repeat([]byte{0xbb}, 4096)
	want = append(want, bytes.Repeat([]byte{0xaa}, 1<<20-4096)...)
	l := craftedLayout{layout: readLayout(t, base), ext: bitmapsExt(t, base)}
	head := fileHead(t, base)
	l.dirOff = int64(binary.BigEndian.Uint64(head[l.ext+16:]))
	dir := make([]byte, 32)
	f, err := os.Open(base)
	if err != nil {
		t.Fatal(err)
	}
	f.ReadAt(dir, l.dirOff)
	be := binary.BigEndian
	l.entry = craftedEntry{tableOff: be.Uint64(dir), tableSize: be.Uint32(dir[8:]), flags: be.Uint32(dir[12:]),
		typ: dir[16], gran: dir[17], name: "bm0", nameLen: -1}
	first := make([]byte, 8)
	f.ReadAt(first, int64(l.entry.tableOff))
	f.Close()
	l.data = int64(be.Uint64(first) & bmTableOffsetMask)
	if l.entry.tableSize != 4 || l.entry.flags != bmFlagAuto || l.data == 0 {
		t.Fatalf("fixture: bm0 is %+v with data at %#x; want an enabled bitmap of 4 entries with data", l.entry, l.data)
	}

	with := func(mutate func(e *craftedEntry)) func(t *testing.T, img string) {
		return func(t *testing.T, img string) {
			e := l.entry
			mutate(&e)
			writeDirectory(t, img, l, 1, -1, e)
		}
	}
	cs := uint64(l.cs)
	cases := []struct {
		name  string
		craft func(t *testing.T, img string)
		ours  string // what a writable open's error says; "": it opens
		qemu  bool   // qemu-io refuses to open it for writing
	}{
		{"table offset 0", with(func(e *craftedEntry) { e.tableOff = 0 }), "bitmap table offset 0x0", true},
		{"table offset unaligned", with(func(e *craftedEntry) { e.tableOff += 512 }), "not cluster-aligned", true},
		{"table offset at the end of the file", with(func(e *craftedEntry) { e.tableOff = uint64(fileLen(t, base)+l.cs-1) &^ (cs - 1) }), "beyond the end of the file", false},
		{"table offset max", with(func(e *craftedEntry) { e.tableOff = math.MaxUint64 &^ (cs - 1) }), "bitmap table offset", true},
		{"table offset on the refcount table", with(func(e *craftedEntry) { e.tableOff = uint64(l.rt) }), "overlaps the refcount table", false},
		{"table offset on the L1 table", with(func(e *craftedEntry) { e.tableOff = uint64(l.l1) }), "overlaps the active L1 table", true},
		{"table size 0", with(func(e *craftedEntry) { e.tableSize = 0 }), "empty bitmap table", true},
		{"table size one short of the disk", with(func(e *craftedEntry) { e.tableSize = 3 }), "needs 4", true},
		{"table size one more than the disk needs", with(func(e *craftedEntry) { e.tableSize = 5 }), "needs 4", true},
		{"table size max", with(func(e *craftedEntry) { e.tableSize = bmMaxTableEntries }), "addresses", true},
		{"table size one past max", with(func(e *craftedEntry) { e.tableSize = bmMaxTableEntries + 1 }), "at most", true},
		{"flags 0 (disabled)", with(func(e *craftedEntry) { e.flags = 0 }), "", false},
		{"flags in use", with(func(e *craftedEntry) { e.flags = bmFlagInUse | bmFlagAuto }), "", false},
		{"flags first reserved bit", with(func(e *craftedEntry) { e.flags |= 4 }), "reserved flags", true},
		{"flags all set", with(func(e *craftedEntry) { e.flags = math.MaxUint32 }), "reserved flags", true},
		{"type 0", with(func(e *craftedEntry) { e.typ = 0 }), "type 0", true},
		{"type 2", with(func(e *craftedEntry) { e.typ = 2 }), "type 2", true},
		{"type max", with(func(e *craftedEntry) { e.typ = 255 }), "type 255", true},
		{"granularity 0", with(func(e *craftedEntry) { e.gran = 0 }), "granularity 2^0", true},
		{"granularity one under min", with(func(e *craftedEntry) { e.gran = 8 }), "granularity 2^8", true},
		{"granularity min", with(func(e *craftedEntry) { e.gran = 9 }), "", false},
		{"granularity max", with(func(e *craftedEntry) { e.gran, e.tableSize = 31, 1 }), "", false},
		{"granularity max, table sized for 2^9", with(func(e *craftedEntry) { e.gran = 31 }), "needs 1", true},
		{"granularity one past max", with(func(e *craftedEntry) { e.gran = 32 }), "granularity 2^32", true},
		{"granularity 255", with(func(e *craftedEntry) { e.gran = 255 }), "granularity 2^255", true},
		{"name empty", with(func(e *craftedEntry) { e.name = "" }), "empty name", false},
		{"name max", with(func(e *craftedEntry) { e.name = strings.Repeat("n", bmMaxNameSize) }), "", false},
		{"name one past max", with(func(e *craftedEntry) { e.name = strings.Repeat("n", bmMaxNameSize+1) }), "name of 1024 bytes", true},
		{"name length past the directory", with(func(e *craftedEntry) { e.nameLen = 0xffff }), "broken bitmap directory", true},
		{"extra data", with(func(e *craftedEntry) { e.extra = make([]byte, 8) }), "extra data", true},
		{"two bitmaps, one name", func(t *testing.T, img string) {
			e := l.entry
			e.flags = 0
			writeDirectory(t, img, l, 2, -1, l.entry, e)
		}, "two bitmaps are named", true},
		{"count 0 past the entries", func(t *testing.T, img string) { writeDirectory(t, img, l, 2, -1, l.entry) }, "header extension says 2", true},
		{"count short of the entries", func(t *testing.T, img string) {
			e := l.entry
			e.name = "bm1"
			writeDirectory(t, img, l, 1, -1, l.entry, e)
		}, "more bitmaps", true},
		{"directory size 0", func(t *testing.T, img string) { writeDirectory(t, img, l, 1, 0, l.entry) }, "zero bytes", true},
		{"directory size cuts the entry", func(t *testing.T, img string) { writeDirectory(t, img, l, 1, 16, l.entry) }, "broken bitmap directory", true},
		{"directory size past the file", func(t *testing.T, img string) {
			writeDirectory(t, img, l, 1, int64(maxBitmapDirectorySize)&^7, l.entry)
		}, "beyond the end of the file", true},
		{"table entry with reserved bits", func(t *testing.T, img string) {
			patch(t, img, int64(l.entry.tableOff), be64(uint64(l.data)|2))
		}, "table entry 0", true},
		{"table entry all ones with an offset", func(t *testing.T, img string) {
			patch(t, img, int64(l.entry.tableOff), be64(uint64(l.data)|bmTableAllOnes))
		}, "table entry 0", true},
		{"table entry past the file", func(t *testing.T, img string) {
			patch(t, img, int64(l.entry.tableOff), be64(uint64(fileLen(t, base)+l.cs-1)&^(cs-1)))
		}, "table entry 0", false},
		{"data cluster on an L2 table", func(t *testing.T, img string) {
			patch(t, img, int64(l.entry.tableOff), be64(uint64(l.l2)))
		}, "overlaps the active L2 table", false},
		{"data cluster on the bitmap's own table", func(t *testing.T, img string) {
			patch(t, img, int64(l.entry.tableOff), be64(l.entry.tableOff))
		}, "overlaps the persistent dirty bitmap", false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			img := filepath.Join(t.TempDir(), "crafted.qcow2")
			copyFileForTest(t, base, img)
			c.craft(t, img)

			qemuCopy := img + ".qemu"
			copyFileForTest(t, img, qemuCopy)
			out, err := execOut("qemu-io", "-f", "qcow2", "-c", "write 2M 512", qemuCopy)
			if qemuRefused := err != nil; qemuRefused != c.qemu {
				t.Errorf("qemu-io refuses the image for writing: %v (want %v)\n%s", qemuRefused, c.qemu, out)
			}

			q, err := openWithin(t, img, 10*time.Second)
			if err != nil {
				t.Fatalf("read-only open: %v", err)
			}
			got := make([]byte, len(want))
			if _, err := q.ReadAt(context.Background(), got, 0); err != nil || !bytes.Equal(got, want) {
				t.Errorf("read-only open reads the disk wrong: %v", err)
			}
			info := q.Info()
			q.Close()
			if c.ours != "" && !slices.ContainsFunc(info.FormatSpecific.Lines, func(s string) bool { return strings.HasPrefix(s, "bitmaps: unreadable") }) {
				// A fault in a table is found only by a writable open.
				if !strings.HasPrefix(c.name, "table entry") && !strings.HasPrefix(c.name, "data cluster") && !strings.Contains(c.ours, "overlaps") {
					t.Errorf("info lines %q do not say the bitmaps are unreadable", info.FormatSpecific.Lines)
				}
			}

			before, err := os.ReadFile(img)
			if err != nil {
				t.Fatal(err)
			}
			w, err := openTest(img, testOpts{Backend: aio.Threads, Writable: true})
			if c.ours == "" {
				if err != nil {
					t.Fatalf("writable open: %v, want it to open", err)
				}
				if _, err := w.WriteAt(context.Background(), make([]byte, 512), 2<<20); err != nil {
					t.Fatal(err)
				}
				if err := w.Close(); err != nil {
					t.Fatal(err)
				}
				tool(t, "qemu-img", "check", img)
				return
			}
			if err == nil {
				w.Close()
				t.Fatalf("writable open succeeded, want an error saying %q", c.ours)
			}
			if !strings.Contains(err.Error(), c.ours) {
				t.Errorf("writable open: %v\nwant it to say %q", err, c.ours)
			}
			// Refused before anything was written.
			if after, err := os.ReadFile(img); err != nil || !bytes.Equal(after, before) {
				t.Errorf("a refused writable open changed the file (%v)", err)
			}
		})
	}
}

func fileLen(t *testing.T, p string) int64 {
	t.Helper()
	st, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	return st.Size()
}

func copyFileForTest(t *testing.T, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestBitmapMemoryIsBounded: enabled bitmaps that would take more memory
// than maxLiveBitmapBytes refuse a writable open before any is loaded,
// while a read-only open still works.
func TestBitmapMemoryIsBounded(t *testing.T) {
	img := filepath.Join(t.TempDir(), "large.qcow2")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", img, "1T")
	tool(t, "qemu-img", "bitmap", "--add", img, "bm0")
	l := craftedLayout{ext: bitmapsExt(t, img)}
	l.cs = 65536
	l.dirOff = int64(binary.BigEndian.Uint64(fileHead(t, img)[l.ext+16:]))
	e, _ := directoryEntry(t, img, "bm0")
	// Five bitmaps of 512-byte granularity over 1 TiB: 256 MiB each.
	var entries []craftedEntry
	for i := range 5 {
		entries = append(entries, craftedEntry{tableOff: uint64(e.tableOff), tableSize: 4096, flags: bmFlagAuto,
			typ: bmTypeDirty, gran: 9, name: "b" + strconv.Itoa(i), nameLen: -1})
	}
	writeDirectory(t, img, l, 5, -1, entries...)
	if _, err := openTest(img, testOpts{Backend: aio.Threads, Writable: true}); err == nil || !strings.Contains(err.Error(), "bytes of memory") {
		t.Fatalf("writable open: %v, want it refused for the memory the bitmaps take", err)
	}
	q, err := openTest(img, testOpts{Backend: aio.Threads})
	if err != nil {
		t.Fatalf("read-only open: %v", err)
	}
	q.Close()
}

// TestBitmapMarksCompressedWrites: a compressed cluster written (as
// convert -c does) marks the bitmaps like any write.
func TestBitmapMarksCompressedWrites(t *testing.T) {
	img := bitmapFixture(t)
	q, err := openTest(img, testOpts{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	comp, ok, err := q.CompressCluster(bytes.Repeat([]byte("compressible "), 65536/13+1)[:65536])
	if err != nil || !ok {
		t.Fatalf("compress a cluster: %v %v", ok, err)
	}
	if err := q.WriteCompressed(context.Background(), comp, 4<<20); err != nil {
		t.Fatal(err)
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	tool(t, "qemu-img", "check", img)
	want := dirtyRuns(8<<20, 512, [2]int64{4 << 20, 64 << 10}, [2]int64{6 << 20, 4096})
	if got := qemuDirtyRanges(t, img, "bm2"); !slices.Equal(got, want) {
		t.Errorf("bm2 dirty blocks %v, want %v", got, want)
	}
}

// TestBitmapSurvivesDroppingTheBackingFile: dropping the backing file
// (block-stream's end) moves the header extensions that follow the
// backing format's; the bitmaps are stored where their extension is then.
func TestBitmapSurvivesDroppingTheBackingFile(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	base := filepath.Join(dir, "base.raw")
	if err := os.WriteFile(base, bytes.Repeat([]byte{0x42}, 4<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(dir, "over.qcow2")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "raw", img, "4M")
	tool(t, "qemu-img", "bitmap", "--add", img, "bm0")
	q, err := openTest(img, testOpts{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := q.Populate(ctx, 0, q.Size()); err != nil {
		t.Fatal(err)
	}
	if err := q.DropBacking(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := q.WriteAt(ctx, make([]byte, 4096), 1<<20); err != nil {
		t.Fatal(err)
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	if out, err := execOut("qemu-img", "check", img); err != nil || strings.Contains(out, "eaked") {
		t.Fatalf("qemu-img check: %v\n%s", err, out)
	}
	if b := qemuBitmaps(t, img); !slices.Equal(b["bm0"].Flags, []string{"auto"}) {
		t.Fatalf("bm0 after the backing file was dropped: %+v", b)
	}
	if got, want := qemuDirtyRanges(t, img, "bm0"), [][2]int64{{1 << 20, 1<<20 + 64<<10}}; !slices.Equal(got, want) {
		t.Errorf("bm0 dirty blocks %v, want %v", got, want)
	}
}
