package formats

import (
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// vdiSeekAndBlocksAsQemu: SEEK_DATA/SEEK_HOLE through the export at mnt
// find the data qemu-img map reports for img (its data runs, merged),
// and st_blocks is the image file's.
func vdiSeekAndBlocksAsQemu(t *testing.T, mnt, img string, fmtArgs ...string) {
	t.Helper()
	var entries []struct {
		Start, Length int64
		Data          bool
	}
	out := harness.Run(t, "qemu-img", append(append([]string{"map", "--output=json"}, fmtArgs...), img)...)
	if err := json.Unmarshal([]byte(out), &entries); err != nil {
		t.Fatal(err)
	}
	var want [][2]int64
	for _, e := range entries {
		if !e.Data {
			continue
		}
		if n := len(want); n > 0 && want[n-1][1] == e.Start {
			want[n-1][1] += e.Length
		} else {
			want = append(want, [2]int64{e.Start, e.Start + e.Length})
		}
	}
	if got := harness.DataRanges(t, mnt); !reflect.DeepEqual(got, want) {
		t.Errorf("SEEK_DATA/SEEK_HOLE through the export: %v, qemu-img map's data: %v", got, want)
	}
	var sm, si unix.Stat_t
	if err := unix.Stat(mnt, &sm); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(img, &si); err != nil {
		t.Fatal(err)
	}
	if sm.Blocks != si.Blocks {
		t.Errorf("st_blocks through the export %d, the image file's %d", sm.Blocks, si.Blocks)
	}
}

// vdiRawWithHoles makes a 64 MiB raw image of random data with holes
// (punched, one unaligned) and runs of written zeroes, the source every
// foreign-format test converts from.
func vdiRawWithHoles(t *testing.T, dir string) string {
	t.Helper()
	img := harness.RandomImage(t, dir, 64<<20, 26)
	f, err := os.OpenFile(img, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, h := range [][2]int64{{3 << 20, 5 << 20}, {20<<20 + 12345, 7 << 20}, {60 << 20, 4 << 20}} {
		if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, h[0], h[1]); err != nil {
			t.Fatal(err)
		}
	}
	for _, z := range [][2]int64{{10 << 20, 3 << 20}, {33<<20 + 4096, 1 << 20}, {40<<20 + 700, 100}} {
		if _, err := f.WriteAt(make([]byte, z[1]), z[0]); err != nil {
			t.Fatal(err)
		}
	}
	return img
}

// vdiSameInspection: info and map, as JSON, equal qemu-img's on img.
func vdiSameInspection(t *testing.T, img string) {
	t.Helper()
	for _, cmd := range [][]string{{"info", "--output=json", img}, {"map", "--output=json", img}} {
		if got, want := harness.JSONOf(t, harness.Bin, cmd...), harness.JSONOf(t, "qemu-img", cmd...); !reflect.DeepEqual(got, want) {
			t.Errorf("%s differs from qemu-img's\n got %v\nwant %v", cmd[0], got, want)
		}
	}
}

// TestVdiConvertedImagesExportAsQemuReadsThem: qemu-img's static and
// dynamic VDI images of a raw disk with holes and zero runs read back
// byte for byte through the FUSE export and NBD (format probed), their info and
// map equal qemu-img's, -w exports them, and a qcow2 overlay on the VDI
// exports read-write (fio verifies its writes) with the VDI unchanged.
func TestVdiConvertedImagesExportAsQemuReadsThem(t *testing.T) {
	dir := t.TempDir()
	src := vdiRawWithHoles(t, dir)
	for _, static := range []string{"off", "on"} {
		t.Run("static="+static, func(t *testing.T) {
			d := t.TempDir()
			img := filepath.Join(d, "d.vdi")
			harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vdi", "-o", "static="+static, src, img)
			// Written back now: the file system allocates its own metadata
			// (extent tree blocks, counted in st_blocks) at write-back, which
			// under load came between the export's stat and the test's.
			harness.Run(t, "sync", img)
			mnt := filepath.Join(d, "mnt")
			harness.StartExport(t, img, mnt)
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", mnt, src)
			dmnt := filepath.Join(d, "dmnt") // O_DIRECT: the map and data through aligned bounce buffers
			harness.StartExport(t, img, dmnt, "--cache", "none")
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", dmnt, src)
			srv := harness.StartNBD(t, img, false)
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", srv.URI, src)
			vdiSameInspection(t, img)
			vdiSeekAndBlocksAsQemu(t, mnt, img)

			// -w exports a copy read-write (vdi_write_test.go writes it).
			wimg := filepath.Join(d, "w.vdi")
			harness.Run(t, "cp", "--sparse=always", img, wimg)
			w := harness.StartExport(t, wimg, filepath.Join(d, "wmnt"), "-w")
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", w.Mnt, src)
			w.StopClean()

			ov := filepath.Join(d, "ov.qcow2")
			harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", img, "-F", "vdi", ov)
			omnt := filepath.Join(d, "omnt")
			e := harness.StartExport(t, ov, omnt, "-w")
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", omnt, src)
			harness.Run(t, "fio", append(harness.FioJob("vdi", "4k", "0", "64M", 26), "--io_size=8M", "--filename="+omnt)...)
			e.StopClean()
			harness.Run(t, "qemu-img", "compare", "-f", "vdi", "-F", "raw", img, src)
		})
	}
}

// TestVdiHostileMapsRefusedWhereQemuReadsWrongData: a block map with two
// entries naming one data block, and a block map past the end of the
// file. QEMU 7.2 opens both and reads another block's bytes (or block 0's
// for every block); we refuse each with one line, for reading and for
// writing (fuse -w, nbd -w), and write nothing.
func TestVdiHostileMapsRefusedWhereQemuReadsWrongData(t *testing.T) {
	dir := t.TempDir()
	src := harness.RandomImage(t, dir, 4<<20, 27)
	img := filepath.Join(dir, "d.vdi")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vdi", src, img)
	good, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	bmapOff := int64(binary.LittleEndian.Uint32(good[0x154:]))
	cases := map[string]func(b []byte){
		"duplicate entries": func(b []byte) { copy(b[bmapOff+4:], b[bmapOff:bmapOff+4]) },
		"map past the end":  func(b []byte) { binary.LittleEndian.PutUint32(b[0x154:], uint32(len(b)+1<<20)&^511) },
		"entry past the end": func(b []byte) { // and the file cut by a block below
			binary.LittleEndian.PutUint32(b[bmapOff+8:], 3)
			binary.LittleEndian.PutUint32(b[0x188:], 4) // blocks allocated
		},
	}
	for name, mod := range cases {
		t.Run(name, func(t *testing.T) {
			b := append([]byte(nil), good...)
			mod(b)
			p := filepath.Join(t.TempDir(), "h.vdi")
			if name == "entry past the end" {
				b = b[:len(b)-(1<<20)]
			}
			if err := os.WriteFile(p, b, 0o644); err != nil {
				t.Fatal(err)
			}
			harness.Run(t, "qemu-img", "compare", "-q", "-f", "vdi", "-F", "vdi", p, p) // QEMU opens and reads it
			code, out := harness.RunBlockexport(t, "info", p)
			if code == 0 || strings.Count(strings.TrimSpace(out), "\n") != 0 || !strings.Contains(out, "corrupt") {
				t.Fatalf("blockexport info: exit %d, want a one-line refusal:\n%s", code, out)
			}
			// Opened for writing: refused as well, the file untouched.
			before := harness.FileHash(t, p)
			mnt := filepath.Join(t.TempDir(), "w")
			os.Mkdir(mnt, 0o755)
			if code, out := harness.TryExport(t, mnt, "-w", p); code != 1 || strings.Count(strings.TrimSpace(out), "\n") != 0 || !strings.Contains(out, "corrupt") {
				t.Fatalf("fuse -w: exit %d, want 1 and a one-line refusal:\n%s", code, out)
			}
			sock := filepath.Join(t.TempDir(), "s.sock")
			if code, out := harness.RunBlockexport(t, "nbd", "--listen", "unix:"+sock, "-w", p); code != 1 || !strings.Contains(out, "corrupt") {
				t.Fatalf("nbd -w: exit %d, want 1 and the refusal:\n%s", code, out)
			}
			if harness.FileHash(t, p) != before {
				t.Fatal("a refused writable open changed the file")
			}
		})
	}
}
