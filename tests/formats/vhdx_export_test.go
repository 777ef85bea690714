package formats

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
	"unicode/utf16"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// vhdxRawWithHoles makes a 64 MiB raw image of random data with punched
// holes (one unaligned) and runs of written zeroes.
func vhdxRawWithHoles(t *testing.T, dir string) string {
	t.Helper()
	img := harness.RandomImage(t, dir, 64<<20, 29)
	f, err := os.OpenFile(img, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, h := range [][2]int64{{2 << 20, 6 << 20}, {20<<20 + 12345, 9 << 20}, {56 << 20, 8 << 20}} {
		if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, h[0], h[1]); err != nil {
			t.Fatal(err)
		}
	}
	for _, z := range [][2]int64{{10 << 20, 3 << 20}, {33<<20 + 4096, 2 << 20}, {40<<20 + 700, 100}} {
		if _, err := f.WriteAt(make([]byte, z[1]), z[0]); err != nil {
			t.Fatal(err)
		}
	}
	return img
}

// vhdxMapMatches checks our map of img against the raw src it was made
// from, and qemu-img's. The one difference is by design: QEMU 7.2's vhdx
// driver has no block-status callback, so qemu-img maps the whole disk as
// one data extent with no offset (asserted here, so that a QEMU that
// learns block status shows up); we map what the BAT says (present blocks
// as data at their file offset, ZERO blocks as zeroes, the rest as
// holes), which SEEK_DATA/SEEK_HOLE through the export follow. So: ours
// covers the disk in order, and every extent not marked data reads as
// zeroes in src.
func vhdxMapMatches(t *testing.T, img, src string, size int64, wantHoles bool) {
	t.Helper()
	want := []any{map[string]any{"start": 0.0, "length": float64(size), "depth": 0.0, "present": true, "zero": false, "data": true}}
	if got := harness.JSONOf(t, "qemu-img", "map", "--output=json", img); !reflect.DeepEqual(got, want) {
		t.Fatalf("qemu-img map is no longer one data extent (QEMU has block status for vhdx now: compare maps exactly):\n%v", got)
	}
	raw, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	exts, ok := harness.JSONOf(t, harness.Bin, "map", "--output=json", img).([]any)
	if !ok || len(exts) == 0 {
		t.Fatalf("map: %v", exts)
	}
	next, holes := 0.0, 0
	for _, x := range exts {
		e := x.(map[string]any)
		start, length := e["start"].(float64), e["length"].(float64)
		if start != next {
			t.Fatalf("map extent at %v, want %v: %v", start, next, exts)
		}
		next = start + length
		if e["data"] == false {
			holes++
			if e["zero"] != true || !bytes.Equal(raw[int64(start):int64(next)], make([]byte, int64(length))) {
				t.Fatalf("map extent %v is not data but does not read as zeroes in the source", e)
			}
		}
	}
	if next != float64(size) || holes == 0 && wantHoles {
		t.Fatalf("map covers %v of %d bytes with %d hole/zero extents (the source has holes)", next, size, holes)
	}
}

// vhdxSeeksFollowTheBAT: through the export of a 1 MiB-block image of
// vhdxRawWithHoles, the blocks of its last 8 MiB hole are not data
// (SEEK_HOLE stays, SEEK_DATA finds nothing after), and its first MiB
// is.
func vhdxSeeksFollowTheBAT(t *testing.T, mnt string) {
	t.Helper()
	f, err := os.Open(mnt)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fd := int(f.Fd())
	if off, err := unix.Seek(fd, 0, unix.SEEK_DATA); err != nil || off != 0 {
		t.Fatalf("SEEK_DATA from 0: %d, %v (want 0)", off, err)
	}
	if off, err := unix.Seek(fd, 56<<20, unix.SEEK_HOLE); err != nil || off != 56<<20 {
		t.Fatalf("SEEK_HOLE from 56 MiB: %d, %v (want 56 MiB)", off, err)
	}
	if off, err := unix.Seek(fd, 56<<20, unix.SEEK_DATA); err != unix.ENXIO {
		t.Fatalf("SEEK_DATA from 56 MiB: %d, %v (want ENXIO)", off, err)
	}
}

// TestVhdxConvertedImagesExportAsQemuReadsThem: qemu-img's VHDX images
// (dynamic, fixed, 1 MiB and 32 MiB blocks, blocks not zeroed) of a raw
// disk with holes and zero runs read back byte for byte through the FUSE
// export (format probed) and over NBD, info equals qemu-img's, map differs only as
// vhdxMapMatches says, a copy written in place (fuse -w, nbd -w) equals
// a raw copy written the same way (vhdxWritesEqualARawCopy), and a qcow2
// overlay exports read-write (fio verifies its writes) with the VHDX
// unchanged.
func TestVhdxConvertedImagesExportAsQemuReadsThem(t *testing.T) {
	dir := t.TempDir()
	src := vhdxRawWithHoles(t, dir)
	for name, opts := range map[string]string{
		"dynamic":        "subformat=dynamic",
		"fixed":          "subformat=fixed",
		"block_size=1M":  "block_size=1M",
		"block_size=32M": "block_size=32M",
		"no zero state":  "block_state_zero=off,block_size=2M",
	} {
		t.Run(name, func(t *testing.T) {
			d := t.TempDir()
			img := filepath.Join(d, "d.vhdx")
			harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vhdx", "-o", opts, src, img)
			mnt := filepath.Join(d, "mnt")
			harness.StartExport(t, img, mnt)
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", mnt, src)
			if name == "block_size=1M" {
				vhdxSeeksFollowTheBAT(t, mnt)
			}
			srv := harness.StartNBD(t, img, false)
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", srv.URI, src)
			cmd := []string{"info", "--output=json", img}
			if got, want := harness.JSONOf(t, harness.Bin, cmd...), harness.JSONOf(t, "qemu-img", cmd...); !reflect.DeepEqual(got, want) {
				t.Errorf("info differs from qemu-img's\n got %v\nwant %v", got, want)
			}
			// Fixed images may allocate every block, and 32 MiB blocks all hold data.
			vhdxMapMatches(t, img, src, 64<<20, name != "fixed" && name != "block_size=32M")

			vhdxWritesEqualARawCopy(t, img, src)

			ov := filepath.Join(d, "ov.qcow2")
			harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", img, "-F", "vhdx", ov)
			omnt := filepath.Join(d, "omnt")
			e := harness.StartExport(t, ov, omnt, "-w")
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", omnt, src)
			harness.Run(t, "fio", append(harness.FioJob("vhdx", "4k", "0", "64M", 29), "--io_size=8M", "--filename="+omnt)...)
			e.StopClean()
			harness.Run(t, "qemu-img", "compare", "-f", "vhdx", "-F", "raw", img, src)
		})
	}
}

// vhdxTry runs a command that may fail and returns its output.
func vhdxTry(name string, args ...string) (string, error) {
	out, err := exec.Command(name, args...).CombinedOutput()
	return string(out), err
}

// vhdxPutCRC stores the CRC-32C of b at b[4:8], computed with it zero.
func vhdxPutCRC(b []byte) {
	binary.LittleEndian.PutUint32(b[4:], 0)
	binary.LittleEndian.PutUint32(b[4:], crc32.Checksum(b, crc32.MakeTable(crc32.Castagnoli)))
}

// TestVhdxHostileRefusedWhereQemuReadsWrongData: a BAT region moved past
// the end of the file (in both region tables, checksums right): QEMU 7.2
// opens it and reads zeroes for every block; we refuse it in one line,
// for reading and for writing (the file untouched). And a dirty log (a
// valid entry under the headers' log GUID): both refuse the read-only
// open, ours in one line naming qemu-img check -r all; a writable export
// replays it first, and after either replay the disk reads right.
func TestVhdxHostileRefusedWhereQemuReadsWrongData(t *testing.T) {
	dir := t.TempDir()
	src := harness.RandomImage(t, dir, 8<<20, 30)
	img := filepath.Join(dir, "d.vhdx")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vhdx", "-o", "block_size=1M", src, img)
	good, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	write := func(t *testing.T, b []byte) string {
		p := filepath.Join(t.TempDir(), "h.vhdx")
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}

	t.Run("BAT region past the end", func(t *testing.T) {
		b := append([]byte(nil), good...)
		batGUID := []byte{0x66, 0x77, 0xc2, 0x2d, 0x23, 0xf6, 0x00, 0x42}
		moved := 0
		for _, rt := range []int{192 << 10, 256 << 10} {
			n := int(binary.LittleEndian.Uint32(b[rt+8:]))
			for i := range n {
				e := b[rt+16+32*i:]
				if bytes.HasPrefix(e, batGUID) {
					binary.LittleEndian.PutUint64(e[16:], uint64(len(b))+64<<20)
					moved++
				}
			}
			vhdxPutCRC(b[rt : rt+64<<10])
		}
		if moved != 2 {
			t.Fatalf("found the BAT entry %d times in the region tables", moved)
		}
		p := write(t, b)
		harness.Run(t, "qemu-img", "info", p) // QEMU opens it...
		if out, err := vhdxTry("qemu-img", "compare", "-f", "vhdx", "-F", "raw", p, src); err == nil {
			t.Fatalf("qemu-img now reads the right data (or refuses quietly): %s", out)
		}
		code, out := harness.RunBlockexport(t, "info", p)
		if code == 0 || strings.Count(strings.TrimSpace(out), "\n") != 0 || !strings.Contains(out, "BAT region") {
			t.Fatalf("blockexport info: exit %d, want a one-line refusal naming the BAT region:\n%s", code, out)
		}
		// Refused for writing too, in one line, the file untouched.
		mnt := filepath.Join(t.TempDir(), "mnt")
		if code, out := harness.TryExport(t, mnt, "-w", p); code == 0 || strings.Count(strings.TrimSpace(out), "\n") != 0 || !strings.Contains(out, "BAT region") {
			t.Fatalf("fuse -w: exit %d, want a one-line refusal naming the BAT region:\n%s", code, out)
		}
		harness.MustEqualBytes(t, "the image after a refused fuse -w", harness.ReadAll(t, p), b)
	})

	t.Run("dirty log", func(t *testing.T) {
		b := append([]byte(nil), good...)
		guid := []byte("vhdx-dirty-log-1")
		logOff := binary.LittleEndian.Uint64(b[64<<10+72:])
		for _, h := range []int{64 << 10, 128 << 10} {
			copy(b[h+48:], guid)
			vhdxPutCRC(b[h : h+4096])
		}
		e := b[logOff : logOff+4096]
		clear(e)
		copy(e, "loge")
		binary.LittleEndian.PutUint32(e[8:], 4096) // entry length
		binary.LittleEndian.PutUint64(e[16:], 1)   // sequence number
		copy(e[32:], guid)
		binary.LittleEndian.PutUint64(e[48:], uint64(len(b))) // flushed file offset
		binary.LittleEndian.PutUint64(e[56:], uint64(len(b))) // last file offset
		vhdxPutCRC(e)
		p := write(t, b)
		if out, err := vhdxTry("qemu-img", "info", p); err == nil || !strings.Contains(out, "log that needs to be replayed") {
			t.Fatalf("qemu-img info on a dirty log: %v\n%s", err, out)
		}
		code, out := harness.RunBlockexport(t, "info", p)
		if code == 0 || strings.Count(strings.TrimSpace(out), "\n") != 0 || !strings.Contains(out, "qemu-img check -r all") {
			t.Fatalf("blockexport info: exit %d, want one line saying how to replay the log:\n%s", code, out)
		}
		mnt := filepath.Join(t.TempDir(), "mnt")
		if code, out := harness.TryExport(t, mnt, p); code == 0 || !strings.Contains(out, "replay") {
			t.Fatalf("export of a dirty log: exit %d\n%s", code, out)
		}
		// A writable export replays it first, as QEMU's read-write open.
		wp := write(t, b)
		wmnt := filepath.Join(t.TempDir(), "wmnt")
		d := harness.StartExport(t, wp, wmnt, "-w")
		harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", wmnt, src)
		d.StopClean()
		harness.Run(t, "qemu-img", "check", "-f", "vhdx", wp)
		harness.Run(t, "qemu-img", "check", "-q", "-r", "all", p)
		harness.StartExport(t, p, mnt)
		harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", mnt, src)
	})
}

// vhdxGUIDString formats an on-disk MS GUID as a parent locator writes it.
func vhdxGUIDString(g []byte) string {
	return fmt.Sprintf("{%08x-%04x-%04x-%x-%x}", binary.LittleEndian.Uint32(g[0:]), binary.LittleEndian.Uint16(g[4:]),
		binary.LittleEndian.Uint16(g[6:]), g[8:10], g[10:16])
}

// vhdxDataWriteGUID is the data write GUID of the VHDX at path (of its
// header with the higher sequence number).
func vhdxDataWriteGUID(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	h := b[64<<10:]
	if h2 := b[128<<10:]; binary.LittleEndian.Uint64(h2[8:]) > binary.LittleEndian.Uint64(h[8:]) {
		h = h2
	}
	return vhdxGUIDString(h[32:48])
}

// vhdxMakeChild turns the qemu-made VHDX at path (1 MiB blocks) into a
// differencing image: has_parent set, a parent locator of kv added to its
// metadata, and the BAT entries of the blocks in absent made NOT_PRESENT,
// so that those read from the parent. (qemu-img makes no differencing
// VHDX; this is the layout MS-VHDX gives, and a non-differencing BAT of
// fewer than 4096 blocks has its payload entries where a differencing
// one has them.)
func vhdxMakeChild(t *testing.T, path string, kv [][2]string, absent []int) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var metaOff, batOff uint64
	rt := b[192<<10:]
	for i := range int(binary.LittleEndian.Uint32(rt[8:])) {
		e := rt[16+32*i:]
		switch binary.LittleEndian.Uint32(e) {
		case 0x2dc27766:
			batOff = binary.LittleEndian.Uint64(e[16:])
		case 0x8b7ca206:
			metaOff = binary.LittleEndian.Uint64(e[16:])
		}
	}
	m := b[metaOff:]
	n := int(binary.LittleEndian.Uint16(m[10:]))
	for i := range n {
		e := m[32+32*i:]
		if binary.LittleEndian.Uint32(e) == 0xcaa16737 { // file parameters
			item := m[binary.LittleEndian.Uint32(e[16:]):]
			binary.LittleEndian.PutUint32(item[4:], binary.LittleEndian.Uint32(item[4:])|2)
		}
	}
	loc := make([]byte, 20+12*len(kv))
	copy(loc, []byte{0xb7, 0xef, 0x4a, 0xb0, 0x9e, 0xd1, 0x81, 0x4a, 0xb7, 0x89, 0x25, 0xb8, 0xe9, 0x44, 0x59, 0x13})
	binary.LittleEndian.PutUint16(loc[18:], uint16(len(kv)))
	for i, p := range kv {
		for j, s := range p {
			var u []byte
			for _, c := range utf16.Encode([]rune(s)) {
				u = binary.LittleEndian.AppendUint16(u, c)
			}
			binary.LittleEndian.PutUint32(loc[20+12*i+4*j:], uint32(len(loc)))
			binary.LittleEndian.PutUint16(loc[20+12*i+8+2*j:], uint16(len(u)))
			loc = append(loc, u...)
		}
	}
	const locOff = 256 << 10
	copy(m[locOff:], loc)
	e := m[32+32*n:]
	copy(e, []byte{0x2d, 0x5f, 0xd3, 0xa8, 0x0b, 0xb3, 0x4d, 0x45, 0xab, 0xf7, 0xd3, 0xd8, 0x48, 0x34, 0xab, 0x0c})
	binary.LittleEndian.PutUint32(e[16:], locOff)
	binary.LittleEndian.PutUint32(e[20:], uint32(len(loc)))
	binary.LittleEndian.PutUint32(e[24:], 4) // required
	binary.LittleEndian.PutUint16(m[10:], uint16(n+1))
	for _, blk := range absent {
		binary.LittleEndian.PutUint64(b[batOff+8*uint64(blk):], 0)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// vhdxTryFor runs blockexport with a deadline (a FIFO must not hang it).
func vhdxTryFor(t *testing.T, args ...string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, harness.Bin, args...).CombinedOutput()
	if ctx.Err() != nil {
		t.Fatalf("blockexport %v did not return in 30 s (hung on what the image names?)\n%s", args, out)
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode(), string(out)
	}
	if err != nil {
		t.Fatal(err)
	}
	return 0, string(out)
}

// TestVhdxDifferencingChainsAndConfinedParents: a differencing VHDX
// (which QEMU 7.2 refuses to open) over a qemu-made parent reads, through
// the FUSE export, its own blocks where it has them and the parent's
// elsewhere; a qcow2 overlay on it exports read-write under fio verify,
// and a copy of it written in place reads what a raw copy written the
// same way reads, its parent untouched.
// Parent locators naming /etc/passwd (absolute, by ../, or as a Win32
// path), /dev/zero, a FIFO, the child itself, or a parent whose data
// write GUID is not the linkage, are each refused in one line, without
// hanging.
func TestVhdxDifferencingChainsAndConfinedParents(t *testing.T) {
	dir := t.TempDir()
	praw, craw := filepath.Join(dir, "parent.raw"), filepath.Join(dir, "child.raw")
	for i, p := range []string{praw, craw} { // RandomImage writes disk.img
		if err := os.Rename(harness.RandomImage(t, dir, 8<<20, uint64(31+i)), p); err != nil {
			t.Fatal(err)
		}
	}
	parent := filepath.Join(dir, "parent.vhdx")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vhdx", "-o", "block_size=1M", praw, parent)
	link := vhdxDataWriteGUID(t, parent)
	pb, _ := os.ReadFile(praw)
	want, _ := os.ReadFile(craw)
	absent := []int{1, 4, 5, 7}
	for _, blk := range absent {
		copy(want[blk<<20:(blk+1)<<20], pb[blk<<20:])
	}
	wantPath := filepath.Join(dir, "want.raw")
	if err := os.WriteFile(wantPath, want, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mkfifo(filepath.Join(dir, "fifo"), 0o644); err != nil {
		t.Fatal(err)
	}
	makeChild := func(t *testing.T, name string, kv [][2]string) string {
		child := filepath.Join(dir, name)
		harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vhdx", "-o", "block_size=1M", craw, child)
		vhdxMakeChild(t, child, kv, absent)
		return child
	}

	child := makeChild(t, "child.vhdx", [][2]string{{"parent_linkage", link}, {"relative_path", `.\parent.vhdx`}})
	if out, err := vhdxTry("qemu-img", "info", child); err == nil {
		t.Fatalf("qemu-img reads differencing VHDX now (compare with it):\n%s", out)
	}
	mnt := filepath.Join(dir, "mnt")
	harness.StartExport(t, child, mnt)
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", mnt, wantPath)
	if inf, ok := harness.JSONOf(t, harness.Bin, "info", "--output=json", child).(map[string]any); !ok || !strings.HasSuffix(fmt.Sprint(inf["backing-filename"]), "parent.vhdx") {
		t.Fatalf("info names no parent: %v", inf)
	}
	ov := filepath.Join(dir, "ov.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", child, "-F", "vhdx", "-o", "size=8M", ov)
	omnt := filepath.Join(dir, "omnt")
	e := harness.StartExport(t, ov, omnt, "-w")
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", omnt, wantPath)
	harness.Run(t, "fio", append(harness.FioJob("vhdxdiff", "4k", "0", "8M", 31), "--io_size=4M", "--filename="+omnt)...)
	e.StopClean()

	// Written in place (fuse -w): into blocks the parent holds (unaligned:
	// the sectors around come from the parent), its own blocks, zeroes
	// over part of a parent's block and a whole one; a raw copy written
	// the same way reads the same, and the parent is untouched.
	wchild, wraw := filepath.Join(dir, "wchild.vhdx"), filepath.Join(dir, "wchild.raw")
	vhdxCopy(t, child, wchild)
	vhdxCopy(t, wantPath, wraw)
	parentBefore := harness.ReadAll(t, parent)
	wmnt := filepath.Join(dir, "wmnt")
	d := harness.StartExport(t, wchild, wmnt, "-w")
	for _, op := range []string{"write -P 0x71 1049000 3000", "write -P 0x72 7M 512", "write -P 0x73 2097000 200", "write -z 4200000 10000", "write -z 5M 1M"} {
		harness.Run(t, "qemu-io", "-f", "raw", "-c", op, wmnt)
		harness.Run(t, "qemu-io", "-f", "raw", "-c", op, wraw)
	}
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", wmnt, wraw)
	d.StopClean()
	rmnt := filepath.Join(dir, "rmnt")
	harness.StartExport(t, wchild, rmnt)
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", rmnt, wraw)
	harness.MustEqualBytes(t, "the parent after its child was written", harness.ReadAll(t, parent), parentBefore)

	for name, kv := range map[string][][2]string{
		"absolute /etc/passwd":     {{"parent_linkage", link}, {"relative_path", "/etc/passwd"}},
		"../ to /etc/passwd":       {{"parent_linkage", link}, {"relative_path", `..\..\..\..\..\..\..\..\etc\passwd`}},
		"win32 path /etc/passwd":   {{"parent_linkage", link}, {"absolute_win32_path", `C:\etc\passwd`}},
		"/dev/zero":                {{"parent_linkage", link}, {"relative_path", "/dev/zero"}},
		"a FIFO":                   {{"parent_linkage", link}, {"relative_path", "fifo"}},
		"itself":                   {{"parent_linkage", link}, {"relative_path", "self.vhdx"}},
		"another parent (linkage)": {{"parent_linkage", "{01234567-89ab-cdef-0123-456789abcdef}"}, {"relative_path", "parent.vhdx"}},
	} {
		t.Run(name, func(t *testing.T) {
			c := makeChild(t, "self.vhdx", kv)
			code, out := vhdxTryFor(t, "map", c) // info opens no parent, as qemu-img info
			if code == 0 || strings.Count(strings.TrimSpace(out), "\n") != 0 {
				t.Fatalf("blockexport map: exit %d, want a one-line refusal:\n%s", code, out)
			}
			t.Log(strings.TrimSpace(out))
		})
	}
}

// vhdxCheckOf runs `check --output=json ARGS` with prog and returns its
// exit status and its JSON object (nil when stdout holds none).
func vhdxCheckOf(t *testing.T, prog string, args ...string) (int, map[string]any) {
	t.Helper()
	cmd := exec.Command(prog, append([]string{"check", "--output=json"}, args...)...)
	out, err := cmd.Output()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if json.Unmarshal(out, &m) != nil {
		m = nil
	}
	return code, m
}

// TestVhdxCheckAsQemuImg: check's exit status and JSON equal qemu-img's
// on a clean image (also under -r leaks and -r all), one truncated so
// that two present blocks lie past its end (corruptions, exit 2). The
// one difference is by design: a BAT region past
// the end of the file, which qemu-img checks clean (and then reads as
// zeroes), fails the check here (exit 1).
func TestVhdxCheckAsQemuImg(t *testing.T) {
	dir := t.TempDir()
	src := harness.RandomImage(t, dir, 8<<20, 33)
	clean := filepath.Join(dir, "clean.vhdx")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vhdx", "-o", "block_size=1M", src, clean)
	b, err := os.ReadFile(clean)
	if err != nil {
		t.Fatal(err)
	}
	cut := filepath.Join(dir, "cut.vhdx")
	if err := os.WriteFile(cut, b[:len(b)-2<<20], 0o644); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{clean}, {"-r", "leaks", clean}, {"-r", "all", clean}, {cut}} {
		code, got := vhdxCheckOf(t, harness.Bin, args...)
		qcode, want := vhdxCheckOf(t, "qemu-img", args...)
		if code != qcode || !reflect.DeepEqual(got, want) {
			t.Errorf("check %v: exit %d %v; qemu-img: exit %d %v", args, code, got, qcode, want)
		}
	}
	if code, got := vhdxCheckOf(t, harness.Bin, cut); code != 2 || got["corruptions"] != 2.0 {
		t.Fatalf("check of a cut image: exit %d %v, want 2 corruptions", code, got)
	}
	batPast := filepath.Join(dir, "batpast.vhdx")
	batGUID := []byte{0x66, 0x77, 0xc2, 0x2d, 0x23, 0xf6, 0x00, 0x42}
	for _, rt := range []int{192 << 10, 256 << 10} {
		for i := range int(binary.LittleEndian.Uint32(b[rt+8:])) {
			if e := b[rt+16+32*i:]; bytes.HasPrefix(e, batGUID) {
				binary.LittleEndian.PutUint64(e[16:], uint64(len(b))+64<<20)
			}
		}
		vhdxPutCRC(b[rt : rt+64<<10])
	}
	if err := os.WriteFile(batPast, b, 0o644); err != nil {
		t.Fatal(err)
	}
	if code, _ := vhdxCheckOf(t, "qemu-img", batPast); code != 0 {
		t.Fatalf("qemu-img check of a BAT region past the end: exit %d (now it sees it: compare exactly)", code)
	}
	if code, _ := vhdxCheckOf(t, harness.Bin, batPast); code != 1 {
		t.Fatalf("check of a BAT region past the end: exit %d, want 1", code)
	}
}

// TestVhdxBeyondTheFirstChunk: in a 5 GiB image of 1 MiB blocks, the
// BAT has a sector bitmap slot after every 4096 payload entries (4 GiB);
// data qemu-io writes across 4 GiB and past it reads back through the
// export where qemu-io put it, and zeroes around it.
func TestVhdxBeyondTheFirstChunk(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "big.vhdx")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "vhdx", "-o", "block_size=1M", img, "5G")
	harness.Run(t, "qemu-io", "-f", "vhdx", "-c", "write -P 0x5a 4194240k 128k", "-c", "write -P 0xa5 4197376k 64k", img)
	mnt := filepath.Join(dir, "mnt")
	harness.StartExport(t, img, mnt)
	out := harness.Run(t, "qemu-io", "-r", "-f", "raw", "-c", "read -P 0x5a 4194240k 128k", "-c", "read -P 0xa5 4197376k 64k",
		"-c", "read -P 0 4194176k 64k", "-c", "read -P 0 4194368k 3008k", "-c", "read -P 0 4197440k 64k", mnt)
	if strings.Contains(out, "Pattern verification failed") || strings.Count(out, "read ") != 5 {
		t.Fatalf("reads through the export:\n%s", out)
	}
}
