package vhdx

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/driver"
)

// TestNewImageReadsBackWhatWasWritten: writes across block boundaries,
// into the short last block, and zero writes over written and unwritten
// blocks, into a new dynamic and fixed image (what convert -O vhdx writes): after Close, our reader and
// qemu-img read the bytes written (and zeroes elsewhere), and qemu-img
// check finds the image clean.
func TestNewImageReadsBackWhatWasWritten(t *testing.T) {
	ctx := context.Background()
	const size = 5<<20 + 512
	for _, keys := range []map[string]string{
		{"block_size": "1M"},
		{"block_size": "1M", "subformat": "fixed"},
		{"block_size": "2M", "subformat": "fixed", "block_state_zero": "off"},
		{"block_size": "1M", "block_state_zero": "off"},
	} {
		path := filepath.Join(t.TempDir(), "fresh.vhdx")
		if err := Create(path, driver.CreateOptions{Size: size, Keys: keys}); err != nil {
			t.Fatal(err)
		}
		f, err := aio.Open(path, aio.Options{Backend: aio.Threads, Writable: true})
		if err != nil {
			t.Fatal(err)
		}
		w, err := OpenWriter(ctx, f, Options{})
		if err != nil {
			t.Fatalf("%v: %v", keys, err)
		}
		want := make([]byte, size)
		write := func(fill byte, off, n int) {
			p := bytes.Repeat([]byte{fill}, n)
			if _, err := w.WriteAt(ctx, p, int64(off)); err != nil {
				t.Fatalf("%v: write at %d: %v", keys, off, err)
			}
			copy(want[off:], p)
		}
		write(1, 1<<20-100, 300)     // across blocks 0 and 1
		write(2, 4<<20+7, 1<<20+505) // to the end of the disk
		write(3, 3<<20, 512)         // one sector of block 3
		if err := w.WriteZeroes(ctx, 4<<20+100, 50, true); err != nil {
			t.Fatal(err)
		}
		clear(want[4<<20+100 : 4<<20+150])
		if err := w.WriteZeroes(ctx, 2<<20, 1<<20, true); err != nil { // never written
			t.Fatal(err)
		}
		if _, err := w.WriteAt(ctx, []byte{1}, size); err == nil {
			t.Errorf("%v: a write past the end was taken", keys)
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		img := createAndOpenExisting(t, path)
		got := make([]byte, size)
		if _, err := img.ReadAt(ctx, got, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%v: our reader reads other bytes than written", keys)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if got, ok := qemuReads(t, b); !ok || !bytes.Equal(got, want) {
			t.Errorf("%v: qemu-img reads other bytes than written", keys)
		}
		if out, err := exec.Command("qemu-img", "check", "-f", "vhdx", path).CombinedOutput(); err != nil {
			t.Errorf("%v: qemu-img check: %v\n%s", keys, err, out)
		}
	}
}

// createAndOpenExisting opens the image at path with the reader.
func createAndOpenExisting(t *testing.T, path string) *Image {
	t.Helper()
	f, err := aio.Open(path, aio.Options{Backend: aio.Threads})
	if err != nil {
		t.Fatal(err)
	}
	img, err := New(context.Background(), f, Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { img.Close() })
	return img
}

// openWriterAt opens the image at path for writing through f (a wrapper
// of the file: a failing one cuts the session).
func openWriterAt(t *testing.T, path string, wrap func(aio.File) aio.File, o Options) (*Writer, aio.File, error) {
	t.Helper()
	f, err := aio.Open(path, aio.Options{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	var file aio.File = f
	if wrap != nil {
		file = wrap(f)
	}
	w, err := OpenWriter(context.Background(), file, o)
	return w, f, err
}

// writeOp is one step of a write session on an 8 MiB disk of 1 MiB blocks.
type writeOp struct {
	fill    byte // 0: zeroes (WriteZeroes); else a write of this byte
	off, n  int64
	discard bool
	flush   bool
}

// writeSession is a session that allocates blocks, writes in place,
// across blocks and into the short last block, zeroes whole and part
// blocks, discards one, and flushes twice.
var writeSession = []writeOp{
	{fill: 1, off: 100, n: 5000},
	{fill: 2, off: 3<<20 - 700, n: 1400},
	{flush: true},
	{fill: 3, off: 50, n: 512},
	{fill: 4, off: 5 << 20, n: 1 << 20},
	{off: 3 << 20, n: 1 << 20},
	{fill: 5, off: 7<<20 + 4096, n: 8192},
	{flush: true},
	{discard: true, off: 5 << 20, n: 1 << 20},
	{fill: 6, off: 6<<20 + 1, n: 3},
	{off: 100, n: 100},
}

// runSession runs ops on w and returns the disk after each step (the
// model: a discard of whole blocks reads zeroes, UNMAPPED) and the last step after which a
// flush succeeded (-1: none); it stops at the first error.
func runSession(w *Writer, base []byte, ops []writeOp) (states [][]byte, flushed int, err error) {
	ctx := context.Background()
	cur := bytes.Clone(base)
	flushed = -1
	for i, op := range ops {
		switch {
		case op.flush:
			err = w.Flush(ctx)
		case op.discard:
			err = w.Discard(ctx, op.off, op.n)
			clear(cur[op.off : op.off+op.n])
		case op.fill == 0:
			err = w.WriteZeroes(ctx, op.off, op.n, false)
			clear(cur[op.off : op.off+op.n])
		default:
			p := bytes.Repeat([]byte{op.fill}, int(op.n))
			_, err = w.WriteAt(ctx, p, op.off)
			copy(cur[op.off:], p)
		}
		states = append(states, bytes.Clone(cur))
		if err != nil {
			return states, flushed, err
		}
		if op.flush {
			flushed = i
		}
	}
	return states, flushed, nil
}

// countingFile counts the writes that reach the file.
type countingFile struct {
	aio.File
	n int
}

func (f *countingFile) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	f.n++
	return f.File.WriteAt(ctx, p, off)
}

// sectorsFromStates checks that every 512-byte sector of got holds what
// one of states holds there (the last flushed state or a later one).
func sectorsFromStates(got []byte, states [][]byte) (int, bool) {
	for s := 0; s < len(got); s += 512 {
		ok := false
		for _, st := range states {
			if bytes.Equal(got[s:s+512], st[s:s+512]) {
				ok = true
				break
			}
		}
		if !ok {
			return s, false
		}
	}
	return 0, true
}

// TestWriterCutAfterEveryWriteLeavesAConsistentImage: a write session
// (allocations, writes in place, zeroes, a discard, two flushes) on a
// dynamic image qemu-img made, cut after each of its file writes as a
// kill -9 cuts it (what reached the file stays): the image replays (our
// writable open; qemu-img check -r all on a copy), qemu-img check then
// finds it clean, and every sector reads what it held at the last
// completed flush or what a later step wrote, through our reader and
// qemu-img's. Uncut, the session leaves a clean log and the final bytes.
func TestWriterCutAfterEveryWriteLeavesAConsistentImage(t *testing.T) {
	const size = 8 << 20
	dir := t.TempDir()
	base := filepath.Join(dir, "base.vhdx")
	raw := filepath.Join(dir, "base.raw")
	baseBytes := bytes.Repeat([]byte{0x77}, 2<<20) // blocks 0 and 1 present
	if err := os.WriteFile(raw, append(baseBytes, make([]byte, size-len(baseBytes))...), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("qemu-img", "convert", "-f", "raw", "-O", "vhdx", "-o", "block_size=1M", raw, base).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img (apt package qemu-utils): %v\n%s", err, out)
	}
	baseDisk, _ := os.ReadFile(raw)
	orig, _ := os.ReadFile(base)

	// Uncut: the number of writes, and the final state.
	ref := filepath.Join(dir, "ref.vhdx")
	os.WriteFile(ref, orig, 0o644)
	var counter *countingFile
	w, _, err := openWriterAt(t, ref, func(f aio.File) aio.File { counter = &countingFile{File: f}; return counter }, Options{})
	if err != nil {
		t.Fatal(err)
	}
	states, _, err := runSession(w, baseDisk, writeSession)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	total := counter.n
	t.Logf("%d writes in the session", total)
	final := states[len(states)-1]
	refBytes, _ := os.ReadFile(ref)
	if got, ok := qemuReads(t, refBytes); !ok || !bytes.Equal(got, final) {
		at, _ := sectorsFromStates(got, [][]byte{final})
		t.Fatalf("uncut session: qemu-img reads other bytes than written (first at %d)", at)
	}
	if out, err := exec.Command("qemu-img", "check", "-f", "vhdx", ref).CombinedOutput(); err != nil {
		t.Fatalf("uncut session: qemu-img check: %v\n%s", err, out)
	}
	h, err := readHeadersOf(t, refBytes)
	if err != nil || h.logGUID != ([16]byte{}) {
		t.Fatalf("uncut session: log GUID %x (%v), want zero", h.logGUID, err)
	}

	dirty := 0
	for cut := 0; cut < total; cut++ {
		p := filepath.Join(dir, "cut.vhdx")
		os.WriteFile(p, orig, 0o644)
		w, f, err := openWriterAt(t, p, func(f aio.File) aio.File { return &failingFile{File: f, left: cut} }, Options{})
		var flushed int
		if err == nil {
			states, flushed, err = runSession(w, baseDisk, writeSession)
			if err == nil {
				err = w.Close()
			}
		}
		f.Close() // a kill: nothing more reaches the file
		if err == nil {
			t.Fatalf("cut after %d of %d writes: no error", cut, total)
		}
		allowed := [][]byte{baseDisk}
		if flushed >= 0 {
			allowed = states[flushed:]
		} else {
			allowed = append(allowed, states...)
		}
		cutBytes, _ := os.ReadFile(p)
		if _, err := openBytes(t, cutBytes); errors.Is(err, ErrDirtyLog) {
			dirty++
		}
		// QEMU replays our log (check -r all: it opens read-write), and
		// its check after that finds nothing (exit 0).
		q := filepath.Join(dir, "q.vhdx")
		os.WriteFile(q, cutBytes, 0o644)
		if out, err := exec.Command("qemu-img", "check", "-r", "all", "-f", "vhdx", q).CombinedOutput(); err != nil {
			t.Fatalf("cut after %d writes: qemu-img check -r all: %v\n%s", cut, err, out)
		}
		qb, _ := os.ReadFile(q)
		got, ok := qemuReads(t, qb)
		if !ok {
			t.Fatalf("cut after %d writes: qemu-img does not read it after its replay", cut)
		}
		if at, ok := sectorsFromStates(got, allowed); !ok {
			t.Fatalf("cut after %d writes (last flush after step %d): qemu-img reads at %d what no step left there", cut, flushed, at)
		}
		// We replay it at a writable open, and close at once.
		w, _, err = openWriterAt(t, p, nil, Options{})
		if err != nil {
			t.Fatalf("cut after %d writes: writable open: %v", cut, err)
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command("qemu-img", "check", "-f", "vhdx", p).CombinedOutput(); err != nil {
			t.Fatalf("cut after %d writes, replayed by us: qemu-img check: %v\n%s", cut, err, out)
		}
		img := createAndOpenExisting(t, p)
		ours := make([]byte, size)
		if _, err := img.ReadAt(context.Background(), ours, 0); err != nil {
			t.Fatal(err)
		}
		img.Close()
		if at, ok := sectorsFromStates(ours, allowed); !ok {
			t.Fatalf("cut after %d writes (last flush after step %d): we read at %d what no step left there", cut, flushed, at)
		}
	}
	if dirty == 0 {
		t.Fatal("no cut left a log to replay: the log is not written, or not where a cut finds it")
	}
	t.Logf("%d cuts left a log to replay", dirty)
}

// readHeadersOf is the active header of the image b.
func readHeadersOf(t *testing.T, b []byte) (header, error) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "h.vhdx")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := aio.Open(path, aio.Options{Backend: aio.Threads})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	_, h, err := readHeaders(context.Background(), f, nil)
	return h, err
}

// TestWriterDifferencingKeepsTheParentsSectors: writes into a
// differencing disk (unaligned, into a block its parent holds, whose
// chunk's bitmap has stale bits for it; into a partially present block;
// zeroes over part of a parent's block, and a whole one) read back
// through our reader after a close, the sectors not written still the
// parent's; the parent's file is untouched and the log is clean.
func TestWriterDifferencingKeepsTheParentsSectors(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	child := diffChild(guidString(vhdxParentGUID))
	bm := make([]byte, 2048)
	copy(bm, child.raw[dataBase+2*mib])
	bm[(4*2048+8)/8] = 0xFF // stale bits of block 4, which the parent holds
	child.raw[dataBase+2*mib] = bm
	parentBytes := diffParent().bytes()
	for name, b := range map[string][]byte{"parent.vhdx": parentBytes, "child.vhdx": child.bytes()} {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	openParent := func(name string) (formats.Image, string, error) {
		p := filepath.Join(dir, name)
		f, err := aio.Open(p, aio.Options{Backend: aio.Threads})
		if err != nil {
			return nil, p, err
		}
		img, err := New(ctx, f, Options{})
		return img, p, err
	}
	path := filepath.Join(dir, "child.vhdx")
	read := func() []byte {
		f, err := aio.Open(path, aio.Options{Backend: aio.Threads})
		if err != nil {
			t.Fatal(err)
		}
		img, err := New(ctx, f, Options{OpenParent: openParent})
		if err != nil {
			t.Fatal(err)
		}
		defer img.Close()
		got := make([]byte, img.Size())
		if _, err := img.ReadAt(ctx, got, 0); err != nil {
			t.Fatal(err)
		}
		return got
	}
	want := read()
	w, _, err := openWriterAt(t, path, nil, Options{OpenParent: openParent})
	if err != nil {
		t.Fatal(err)
	}
	write := func(fill byte, off, n int64) {
		p := bytes.Repeat([]byte{fill}, int(n))
		if _, err := w.WriteAt(ctx, p, off); err != nil {
			t.Fatalf("write at %d: %v", off, err)
		}
		copy(want[off:], p)
	}
	write(0x41, 4*mib+1000, 100)    // block 4: the parent's, stale bits
	write(0x42, mib+60*512+3, 1000) // block 1: partially present
	write(0x43, 7*mib-10, 10)       // block 6: the parent's (zeroes), to its end
	if err := w.WriteZeroes(ctx, 4*mib+3000, 5000, false); err != nil {
		t.Fatal(err)
	}
	clear(want[4*mib+3000 : 4*mib+8000])
	if err := w.WriteZeroes(ctx, 0, mib, false); err != nil { // block 0, whole
		t.Fatal(err)
	}
	clear(want[:mib])
	got := make([]byte, len(want))
	if _, err := w.ReadAt(ctx, got, 0); err != nil {
		t.Fatal(err)
	}
	if at, ok := sectorsFromStates(got, [][]byte{want}); !ok {
		t.Fatalf("before the close: the sector at %d differs", at)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if at, ok := sectorsFromStates(read(), [][]byte{want}); !ok {
		t.Fatalf("after the close: the sector at %d differs", at)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "parent.vhdx")); !bytes.Equal(b, parentBytes) {
		t.Fatal("the parent changed")
	}
	b, _ := os.ReadFile(path)
	if h, err := readHeadersOf(t, b); err != nil || h.logGUID != ([16]byte{}) {
		t.Fatalf("log GUID %x (%v) after the close, want zero", h.logGUID, err)
	}
}

// TestWriterReplaysAForeignLogFirst: a writable open of an image whose
// log holds an entry (written by someone else) replays it to the file
// before anything else; the write that follows lands beside it.
func TestWriterReplaysAForeignLogFirst(t *testing.T) {
	b, target, ds, _ := dirtyImage()
	path := filepath.Join(t.TempDir(), "d.vhdx")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	w, _, err := openWriterAt(t, path, nil, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.WriteAt(context.Background(), []byte{9}, 2*mib+5); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(path)
	logged := append(append([]byte("LEADING!"), ds[8:4092]...), "TAIL"...)
	if !bytes.Equal(got[target:target+logSector], logged) {
		t.Fatal("the foreign log was not replayed before the write")
	}
	img := createAndOpenExisting(t, path)
	p := make([]byte, 1)
	if _, err := img.ReadAt(context.Background(), p, 2*mib+5); err != nil || p[0] != 9 {
		t.Fatalf("read back %v %v, want 9", p, err)
	}
}

// TestWriterRefusesHostileImagesUntouched: every crafted file the reader
// refuses is refused for writing too, in one line, and left as it was
// (a replay that is refused writes nothing).
func TestWriterRefusesHostileImagesUntouched(t *testing.T) {
	for name, mutate := range hostileCases() {
		s := goodSpec()
		b := mutate(&s)
		if b == nil {
			b = s.bytes()
		}
		path := filepath.Join(t.TempDir(), "h.vhdx")
		if err := os.WriteFile(path, b, 0o644); err != nil {
			t.Fatal(err)
		}
		w, _, err := openWriterAt(t, path, nil, Options{})
		if err == nil {
			w.Close()
			t.Errorf("%s: opened for writing", name)
			continue
		}
		if strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: refusal of more than one line: %v", name, err)
		}
		if after, _ := os.ReadFile(path); !bytes.Equal(after, b) {
			t.Errorf("%s: refused (%v), but the file changed", name, err)
		}
	}
}

// TestWriterCommitsMoreThanTheLogHolds: a flush that changes more BAT
// sectors than one entry of a 1 MiB log holds (260 sectors: one byte in
// every 512th block of a 130 GiB disk) writes them as several entries,
// one after the other at the log's start; all read back, here and in
// qemu-img, check clean.
func TestWriterCommitsMoreThanTheLogHolds(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "big.vhdx")
	if err := Create(path, driver.CreateOptions{Size: 130 << 30, Keys: map[string]string{"block_size": "1M"}}); err != nil {
		t.Fatal(err)
	}
	w, _, err := openWriterAt(t, path, nil, Options{})
	if err != nil {
		t.Fatal(err)
	}
	const n = 260
	if per := logEntrySectors(w.logLen); per >= n {
		t.Fatalf("one entry holds %d sectors: the test needs more", per)
	}
	for i := range n {
		if _, err := w.WriteAt(ctx, []byte{byte(i) | 1}, int64(i)*512*mib+int64(i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("qemu-img", "check", "-f", "vhdx", path).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img check: %v\n%s", err, out)
	}
	img := createAndOpenExisting(t, path)
	var args []string
	for i := range n {
		p := make([]byte, 2)
		off := int64(i)*512*mib + int64(i)
		if _, err := img.ReadAt(ctx, p, off); err != nil || p[0] != byte(i)|1 || p[1] != 0 {
			t.Fatalf("block %d reads %v (%v)", i*512, p, err)
		}
		if i%37 == 0 {
			args = append(args, "-c", fmt.Sprintf("read -P %d %d 1", byte(i)|1, off))
		}
	}
	if out, err := exec.Command("qemu-io", append([]string{"-f", "vhdx", "-r"}, append(args, path)...)...).CombinedOutput(); err != nil || strings.Contains(string(out), "Pattern verification failed") {
		t.Fatalf("qemu-io reads other bytes: %v\n%s", err, out)
	}
}

// TestWriterWritesFourKiBSectors: an image of 4096-byte logical sectors
// (Hyper-V makes them; QEMU 7.2 refuses them) is written, unaligned, and
// reads back.
func TestWriterWritesFourKiBSectors(t *testing.T) {
	ctx := context.Background()
	s := goodSpec()
	s.logicalSector = 4096
	path := filepath.Join(t.TempDir(), "4k.vhdx")
	if err := os.WriteFile(path, s.bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	img := createAndOpenExisting(t, path)
	want := make([]byte, img.Size())
	if _, err := img.ReadAt(ctx, want, 0); err != nil {
		t.Fatal(err)
	}
	img.Close()
	w, _, err := openWriterAt(t, path, nil, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range [][2]int64{{100, 5000}, {mib - 3, 10}, {6*mib + 4095, 2}} {
		p := bytes.Repeat([]byte{byte(0x31 + i)}, int(r[1]))
		if _, err := w.WriteAt(ctx, p, r[0]); err != nil {
			t.Fatal(err)
		}
		copy(want[r[0]:], p)
	}
	closeAndReadBack(t, w, path, want)
}

// TestWriterAllocatesPastAShortLastBlock: a file that ends with the disk's
// last bytes, inside its last block (2 MiB blocks, the last one holding
// 512 bytes of disk: files of other tools end there, and QEMU reads
// them), gets new blocks after the whole of that block, not over its
// tail: the image reopens and reads what was written.
func TestWriterAllocatesPastAShortLastBlock(t *testing.T) {
	ctx := context.Background()
	s := goodSpec()
	s.blockSize = 2 * mib
	s.virtualSize = 6*mib + 512
	s.bat = []uint64{dataBase | blockFullyPresent, blockNotPresent, blockZero, (dataBase + 2*mib) | blockFullyPresent}
	s.blocks = map[uint64]byte{dataBase: 0xA1, dataBase + 2*mib: 0xB2}
	s.fileSize = dataBase + 2*mib + 512
	path := filepath.Join(t.TempDir(), "short.vhdx")
	if err := os.WriteFile(path, s.bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, s.virtualSize)
	if _, err := createAndOpenExisting(t, path).ReadAt(ctx, want, 0); err != nil {
		t.Fatal(err)
	}
	w, _, err := openWriterAt(t, path, nil, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for i, off := range []int64{2*mib + 100, 4 * mib, 6 * mib} {
		p := bytes.Repeat([]byte{byte(0x51 + i)}, 300)
		if _, err := w.WriteAt(ctx, p, off); err != nil {
			t.Fatal(err)
		}
		copy(want[off:], p)
	}
	closeAndReadBack(t, w, path, want)
}

// TestWriterConcurrentWritesFlushesAndReads: goroutines write, zero and
// read their own parts of a dynamic disk while another flushes: each
// reads back what it wrote at once, and after the close every part holds
// its last bytes (run with -race, the locking of the BAT, the pending
// sectors and the allocations is checked too).
func TestWriterConcurrentWritesFlushesAndReads(t *testing.T) {
	ctx := context.Background()
	const size = 16 << 20
	path := filepath.Join(t.TempDir(), "c.vhdx")
	if err := Create(path, driver.CreateOptions{Size: size, Keys: map[string]string{"block_size": "1M"}}); err != nil {
		t.Fatal(err)
	}
	w, _, err := openWriterAt(t, path, nil, Options{})
	if err != nil {
		t.Fatal(err)
	}
	want := make([]byte, size)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 40 {
				// Part g: every 4th 256 KiB run, so that the parts share blocks.
				off := int64((i%16)*4+g)*256<<10 + int64(i*7)
				p := bytes.Repeat([]byte{byte(g*40 + i + 1)}, 3000)
				if i%9 == 8 {
					if err := w.WriteZeroes(ctx, off, int64(len(p)), false); err != nil {
						errs <- err
						return
					}
					clear(p)
				} else if _, err := w.WriteAt(ctx, p, off); err != nil {
					errs <- err
					return
				}
				copy(want[off:], p)
				got := make([]byte, len(p))
				if _, err := w.ReadAt(ctx, got, off); err != nil || !bytes.Equal(got, p) {
					errs <- fmt.Errorf("part %d, step %d: read back differs (%v)", g, i, err)
					return
				}
			}
		}()
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range 20 {
			if err := w.Flush(ctx); err != nil {
				errs <- err
				return
			}
		}
	}()
	wg.Wait()
	<-done
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, size)
	if _, err := createAndOpenExisting(t, path).ReadAt(ctx, got, 0); err != nil {
		t.Fatal(err)
	}
	if at, ok := sectorsFromStates(got, [][]byte{want}); !ok {
		t.Fatalf("after the close: the sector at %d differs", at)
	}
}

// closeAndReadBack closes w, opens path again and wants it to read want.
func closeAndReadBack(t *testing.T, w io.Closer, path string, want []byte) {
	t.Helper()
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(want))
	if _, err := createAndOpenExisting(t, path).ReadAt(context.Background(), got, 0); err != nil {
		t.Fatal(err)
	}
	if at, ok := sectorsFromStates(got, [][]byte{want}); !ok {
		t.Fatalf("the sector at %d differs", at)
	}
}
