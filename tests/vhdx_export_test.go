package tests

import (
	"bytes"
	"encoding/binary"
	"hash/crc32"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// vhdxRawWithHoles makes a 64 MiB raw image of random data with punched
// holes (one unaligned) and runs of written zeroes.
func vhdxRawWithHoles(t *testing.T, dir string) string {
	t.Helper()
	img := randomImage(t, dir, 64<<20, 29)
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
	if got := jsonOf(t, "qemu-img", "map", "--output=json", img); !reflect.DeepEqual(got, want) {
		t.Fatalf("qemu-img map is no longer one data extent (QEMU has block status for vhdx now: compare maps exactly):\n%v", got)
	}
	raw, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	exts, ok := jsonOf(t, bin, "map", "--output=json", img).([]any)
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
// vhdxMapMatches says, -w is refused in one line pointing at a qcow2
// overlay, and such an overlay exports read-write (fio verifies its
// writes) with the VHDX unchanged.
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
			run(t, "qemu-img", "convert", "-f", "raw", "-O", "vhdx", "-o", opts, src, img)
			mnt := filepath.Join(d, "mnt")
			startExport(t, img, mnt)
			run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", mnt, src)
			if name == "block_size=1M" {
				vhdxSeeksFollowTheBAT(t, mnt)
			}
			srv := startNBD(t, img, false)
			run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", srv.uri, src)
			cmd := []string{"info", "--output=json", img}
			if got, want := jsonOf(t, bin, cmd...), jsonOf(t, "qemu-img", cmd...); !reflect.DeepEqual(got, want) {
				t.Errorf("info differs from qemu-img's\n got %v\nwant %v", got, want)
			}
			// Fixed images may allocate every block, and 32 MiB blocks all hold data.
			vhdxMapMatches(t, img, src, 64<<20, name != "fixed" && name != "block_size=32M")

			wmnt := filepath.Join(d, "wmnt")
			code, out := tryExport(t, wmnt, "-w", img)
			if code == 0 || !strings.Contains(out, "qcow2") || strings.Count(strings.TrimSpace(out), "\n") != 0 {
				t.Fatalf("-w on a vhdx image: exit %d, want a one-line refusal naming a qcow2 overlay:\n%s", code, out)
			}

			ov := filepath.Join(d, "ov.qcow2")
			run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", img, "-F", "vhdx", ov)
			omnt := filepath.Join(d, "omnt")
			e := startExport(t, ov, omnt, "-w")
			run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", omnt, src)
			run(t, "fio", append(fioJob("vhdx", "4k", "0", "64M", 29), "--io_size=8M", "--filename="+omnt)...)
			e.stopClean()
			run(t, "qemu-img", "compare", "-f", "vhdx", "-F", "raw", img, src)
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
// opens it and reads zeroes for every block; we refuse it in one line.
// And a dirty log (a valid entry under the headers' log GUID): both
// refuse the read-only open, ours in one line naming qemu-img check -r
// all, and after that replay both read the disk.
func TestVhdxHostileRefusedWhereQemuReadsWrongData(t *testing.T) {
	dir := t.TempDir()
	src := randomImage(t, dir, 8<<20, 30)
	img := filepath.Join(dir, "d.vhdx")
	run(t, "qemu-img", "convert", "-f", "raw", "-O", "vhdx", "-o", "block_size=1M", src, img)
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
		run(t, "qemu-img", "info", p) // QEMU opens it...
		if out, err := vhdxTry("qemu-img", "compare", "-f", "vhdx", "-F", "raw", p, src); err == nil {
			t.Fatalf("qemu-img now reads the right data (or refuses quietly): %s", out)
		}
		code, out := runBlockexport(t, "info", p)
		if code == 0 || strings.Count(strings.TrimSpace(out), "\n") != 0 || !strings.Contains(out, "BAT region") {
			t.Fatalf("blockexport info: exit %d, want a one-line refusal naming the BAT region:\n%s", code, out)
		}
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
		code, out := runBlockexport(t, "info", p)
		if code == 0 || strings.Count(strings.TrimSpace(out), "\n") != 0 || !strings.Contains(out, "qemu-img check -r all") {
			t.Fatalf("blockexport info: exit %d, want one line saying how to replay the log:\n%s", code, out)
		}
		mnt := filepath.Join(t.TempDir(), "mnt")
		if code, out := tryExport(t, mnt, p); code == 0 || !strings.Contains(out, "replay") {
			t.Fatalf("export of a dirty log: exit %d\n%s", code, out)
		}
		run(t, "qemu-img", "check", "-q", "-r", "all", p)
		startExport(t, p, mnt)
		run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", mnt, src)
	})
}
