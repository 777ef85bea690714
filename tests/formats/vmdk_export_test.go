package formats

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// vmdkSameInspection: info and map of img, as JSON, equal qemu-img's
// (keys and values; run in img's directory with a relative name, so that
// extent file names are compared as qemu-img forms them).
func vmdkSameInspection(t *testing.T, img string) {
	t.Helper()
	for _, cmd := range [][]string{{"info", "--output=json", img}, {"map", "--output=json", img}} {
		if got, want := harness.JSONOf(t, harness.Bin, cmd...), harness.JSONOf(t, "qemu-img", cmd...); !reflect.DeepEqual(got, want) {
			t.Errorf("%s differs from qemu-img's\n got %v\nwant %v", cmd[0], got, want)
		}
	}
	if got, want := harness.Run(t, harness.Bin, "info", img), harness.Run(t, "qemu-img", "info", img); got != want {
		t.Errorf("info differs from qemu-img's\n got %s\nwant %s", got, want)
	}
}

// vmdkMapData is the data of qemu-img map's JSON for img as [start, end)
// runs, adjacent entries merged.
func vmdkMapData(t *testing.T, img string) [][2]int64 {
	t.Helper()
	var entries []struct {
		Start, Length int64
		Data          bool
	}
	if err := json.Unmarshal([]byte(harness.Run(t, "qemu-img", "map", "--output=json", img)), &entries); err != nil {
		t.Fatal(err)
	}
	var r [][2]int64
	for _, e := range entries {
		if !e.Data {
			continue
		}
		if n := len(r); n > 0 && r[n-1][1] == e.Start {
			r[n-1][1] += e.Length
			continue
		}
		r = append(r, [2]int64{e.Start, e.Start + e.Length})
	}
	return r
}

// TestVmdkManyExtents: a 5 GiB disk (data at 2 GiB - 1 MiB, across the
// first extent's end, and at 4.4 GiB) as three twoGbMaxExtent extents:
// info (JSON and text) and map equal qemu-img's, and the data reads back
// through the export from the right extents.
func TestVmdkManyExtents(t *testing.T) {
	dir := t.TempDir()
	src := harness.SparseImage(t, dir, "big.raw", 5<<30)
	data := harness.RandomImage(t, t.TempDir(), 3<<20, 30)
	b := harness.ReadAll(t, data)
	f, err := os.OpenFile(src, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	ranges := [][2]int64{{2<<30 - 1<<20, 2 << 20}, {4500 << 20, 1 << 20}}
	f.WriteAt(b[:2<<20], ranges[0][0])
	f.WriteAt(b[2<<20:], ranges[1][0])
	f.Close()
	for _, sub := range []string{"twoGbMaxExtentSparse", "twoGbMaxExtentFlat"} {
		t.Run(sub, func(t *testing.T) {
			t.Parallel() // each subformat has its own image, exports and overlay; the source is only read
			d := t.TempDir()
			img := filepath.Join(d, "d.vmdk")
			harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vmdk", "-o", "subformat="+sub, src, img)
			vmdkSameInspection(t, img)
			mnt := filepath.Join(d, "mnt")
			harness.StartExport(t, img, mnt)
			m, err := os.Open(mnt)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			for i, r := range ranges {
				got := make([]byte, r[1]+8192)
				if _, err := m.ReadAt(got, r[0]-4096); err != nil {
					t.Fatal(err)
				}
				want := append(append(make([]byte, 4096), b[[]int64{0, 2 << 20}[i]:][:r[1]]...), make([]byte, 4096)...)
				harness.MustEqualBytes(t, fmt.Sprintf("range %d", i), got, want)
			}
		})
	}
}

// TestVmdkSubformatsExportAsQemuReadsThem: for each subformat qemu-img
// writes, a VMDK converted from a 64 MiB random raw disk with holes and
// zero runs reads back byte for byte through the FUSE export (format
// probed) and over NBD (qemu-img, nbdcopy), its info and map equal
// qemu-img's, SEEK_DATA/SEEK_HOLE through the export find map's data; -w is refused in one line that points at a qcow2 overlay; a
// qcow2 overlay on the VMDK exports read-write, fio verifies its writes,
// and the VMDK is unchanged.
func TestVmdkSubformatsExportAsQemuReadsThem(t *testing.T) {
	dir := t.TempDir()
	src := vdiRawWithHoles(t, dir)
	for _, sub := range []string{"monolithicSparse", "monolithicFlat", "twoGbMaxExtentSparse", "twoGbMaxExtentFlat", "streamOptimized"} {
		t.Run(sub, func(t *testing.T) {
			t.Parallel() // each subformat has its own image, exports and overlay; the source is only read
			d := t.TempDir()
			img := filepath.Join(d, "d.vmdk")
			harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vmdk", "-o", "subformat="+sub, src, img)
			mnt := filepath.Join(d, "mnt")
			harness.StartExport(t, img, mnt)
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", mnt, src)
			vmdkSameInspection(t, img)
			if got, want := harness.DataRanges(t, mnt), vmdkMapData(t, img); !reflect.DeepEqual(got, want) {
				t.Errorf("SEEK_DATA/SEEK_HOLE through the export find %v, qemu-img map's data is %v", got, want)
			}
			// Over NBD too: qemu-img and nbdcopy read what the raw holds.
			s := harness.StartNBD(t, img, false)
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", s.URI, src)
			out := filepath.Join(d, "copy.raw")
			harness.Run(t, "nbdcopy", s.URI, out)
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", out, src)
			os.Remove(out)

			ov := filepath.Join(d, "ov.qcow2")
			harness.CreateImage(t, "-f", "qcow2", "-b", img, "-F", "vmdk", ov)
			omnt := filepath.Join(d, "omnt")
			e := harness.StartExport(t, ov, omnt, "-w")
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", omnt, src)
			harness.Run(t, "fio", append(harness.FioJob("vmdk", "4k", "0", "64M", 27), "--io_size=8M", "--filename="+omnt)...)
			e.StopClean()
			harness.Run(t, "qemu-img", "compare", "-f", "vmdk", "-F", "raw", img, src)
		})
	}
}

// TestVmdkDeltaChain: a delta disk made by qemu-img on a monolithicSparse
// base, written by qemu-io (data, and zeroes over base data), reads
// through the export as QEMU reads it, with info and map equal to
// qemu-img's; a base whose CID changed since is refused in one line.
func TestVmdkDeltaChain(t *testing.T) {
	dir := t.TempDir()
	src := harness.RandomImage(t, dir, 16<<20, 28)
	base := filepath.Join(dir, "base.vmdk")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vmdk", src, base)
	delta := filepath.Join(dir, "delta.vmdk")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "vmdk", "-b", "base.vmdk", "-F", "vmdk", delta) // relative to the delta
	harness.Run(t, "qemu-io", "-c", "write -P 0xa5 1M 192k", "-c", "write -z 5M 128k", "-c", "write -P 0x5a 15M 4k", delta)
	want := filepath.Join(dir, "want.raw")
	harness.Run(t, "qemu-img", "convert", "-O", "raw", delta, want)
	mnt := filepath.Join(dir, "mnt")
	e := harness.StartExport(t, delta, mnt)
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", mnt, want)
	vmdkSameInspection(t, delta)
	// Through a symlinked directory: the parent is named as QEMU names it
	// (under the link), not by the path it resolves to.
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	viaLink := filepath.Join(link, "delta.vmdk")
	if got, want := harness.JSONOf(t, harness.Bin, "info", "--output=json", "--backing-chain", viaLink), harness.JSONOf(t, "qemu-img", "info", "--output=json", "--backing-chain", viaLink); !reflect.DeepEqual(got, want) {
		t.Errorf("info --backing-chain differs from qemu-img's\n got %v\nwant %v", got, want)
	}
	e.StopClean()

	// A delta larger than its base: past the base's end it reads zeroes
	// (as QEMU reads a short backing file), with a write there too.
	grow := filepath.Join(dir, "grow.vmdk")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "vmdk", "-b", "base.vmdk", "-F", "vmdk", grow, "24M")
	harness.Run(t, "qemu-io", "-c", "write -P 0x33 20M 64k", grow)
	growRaw := filepath.Join(dir, "grow.raw")
	harness.Run(t, "qemu-img", "convert", "-O", "raw", grow, growRaw)
	gmnt := filepath.Join(dir, "gmnt")
	g := harness.StartExport(t, grow, gmnt)
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", gmnt, growRaw)
	vmdkSameInspection(t, grow)
	g.StopClean()

	// The base written after the delta was made: its CID changes, and the
	// delta's data would be wrong.
	harness.Run(t, "qemu-io", "-c", "write -P 1 0 4k", base)
	code, out := harness.RunBlockexport(t, "map", delta)
	if code == 0 || strings.Count(strings.TrimSpace(out), "\n") != 0 || !strings.Contains(out, "CID") {
		t.Fatalf("delta on a changed base: exit %d, want a one-line refusal naming the CID:\n%s", code, out)
	}
}

// TestVmdkHostileExtentsRefusedWhereQemuFollowsThem: descriptors whose
// extent names /etc/passwd (relative and absolute), /dev/zero, a FIFO,
// the descriptor itself, or a symlink out of the directory. QEMU 7.2
// opens each (reading /etc/passwd as disk data, hanging on the FIFO); we
// refuse each with one line.
func TestVmdkHostileExtentsRefusedWhereQemuFollowsThem(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/etc/passwd", filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(dir, "d.vmdk")
	for _, name := range []string{"../../../../../../../etc/passwd", "/etc/passwd", "/dev/zero", "fifo", "d.vmdk", "link"} {
		t.Run(strings.ReplaceAll(name, "/", "_"), func(t *testing.T) {
			desc := fmt.Sprintf("# Disk DescriptorFile\nversion=1\nCID=1\nparentCID=ffffffff\ncreateType=\"monolithicFlat\"\nRW 1 FLAT \"%s\" 0\n", name)
			if err := os.WriteFile(img, []byte(desc), 0o644); err != nil {
				t.Fatal(err)
			}
			if name != "fifo" && name != "d.vmdk" {
				// QEMU opens it: the attack works there.
				harness.Run(t, "qemu-img", "info", "-U", img)
			}
			cmd := exec.Command(harness.Bin, "info", img)
			done := make(chan struct{})
			var out []byte
			var err error
			go func() { out, err = cmd.CombinedOutput(); close(done) }()
			select {
			case <-done:
			case <-time.After(20 * time.Second):
				cmd.Process.Kill()
				<-done
				t.Fatal("blockexport info hangs")
			}
			if err == nil || strings.Count(strings.TrimSpace(string(out)), "\n") != 0 || !strings.Contains(string(out), "refused") {
				t.Fatalf("extent %q: %v, want a one-line refusal:\n%s", name, err, out)
			}
		})
	}
}

// TestVmdkAllowDir: an extent outside the image's directory is refused by
// default and opened with --allow-dir naming its directory (info equal to
// qemu-img's, the export reading the extent's bytes).
func TestVmdkAllowDir(t *testing.T) {
	dir := t.TempDir()
	for _, d := range []string{"sub", "other"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	flat := harness.RandomImage(t, filepath.Join(dir, "other"), 1<<20, 29)
	img := filepath.Join(dir, "sub", "d.vmdk")
	desc := "# Disk DescriptorFile\nversion=1\nCID=1\nparentCID=ffffffff\ncreateType=\"monolithicFlat\"\nRW 2048 FLAT \"../other/disk.img\" 0\n"
	if err := os.WriteFile(img, []byte(desc), 0o644); err != nil {
		t.Fatal(err)
	}
	if code, out := harness.RunBlockexport(t, "info", img); code == 0 || !strings.Contains(out, "--allow-dir") {
		t.Fatalf("extent outside the directory: exit %d, want a refusal naming --allow-dir:\n%s", code, out)
	}
	other := filepath.Join(dir, "other")
	var got any
	if code, out := harness.RunBlockexport(t, "info", "--output=json", "--allow-dir", other, img); code != 0 {
		t.Fatalf("info --allow-dir: exit %d\n%s", code, out)
	} else if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatal(err)
	}
	if want := harness.JSONOf(t, "qemu-img", "info", "--output=json", img); !reflect.DeepEqual(got, want) {
		t.Errorf("info differs from qemu-img's\n got %v\nwant %v", got, want)
	}
	mnt := filepath.Join(dir, "mnt")
	harness.StartExport(t, img, mnt, "--allow-dir", other)
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", mnt, flat)
}

// TestVmdkHostileTablesDifferential: a qemu-img monolithicSparse image
// with its grain directory or tables made hostile. QEMU 7.2 opens each
// (qemu-img convert reads it without an error, returning wrong data:
// the header as a table, zeroes, another table's grains, metadata as
// disk bytes); blockexport refuses each in one line, at open or at the
// map that reaches the bad entry.
func TestVmdkHostileTablesDifferential(t *testing.T) {
	dir := t.TempDir()
	src := harness.RandomImage(t, dir, 40<<20, 31) // two grain tables of 32 MiB
	img := filepath.Join(dir, "d.vmdk")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vmdk", src, img)
	good := harness.ReadAll(t, img)
	le32 := func(b []byte, off int64) uint32 {
		return uint32(b[off]) | uint32(b[off+1])<<8 | uint32(b[off+2])<<16 | uint32(b[off+3])<<24
	}
	put32 := func(b []byte, off int64, v uint32) {
		b[off], b[off+1], b[off+2], b[off+3] = byte(v), byte(v>>8), byte(v>>16), byte(v>>24)
	}
	gd := int64(le32(good, 56)) * 512  // gd_offset (sectors; its high half is 0)
	rgd := int64(le32(good, 48)) * 512 // rgd_offset
	gt0 := int64(le32(good, gd)) * 512
	cases := map[string]func(b []byte) []byte{
		// The redundant directory too, so that neither can be used.
		"grain directory inside the header": func(b []byte) []byte { put32(b, 56, 0); put32(b, 48, 0); return b },
		"grain table past the end": func(b []byte) []byte {
			put32(b, gd, uint32(len(b)/512+100))
			put32(b, rgd, uint32(len(b)/512+100))
			return b
		},
		"grain tables duplicated": func(b []byte) []byte {
			put32(b, gd+4, le32(b, gd))
			put32(b, rgd+4, le32(b, rgd))
			return b
		},
		"grain past the end":       func(b []byte) []byte { put32(b, gt0+8, uint32(len(b)/512+1000)); return b },
		"grain in the grain table": func(b []byte) []byte { put32(b, gt0+8, uint32(gt0/512)); return b },
	}
	for name, mod := range cases {
		t.Run(name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "h.vmdk")
			if err := os.WriteFile(p, mod(append([]byte(nil), good...)), 0o644); err != nil {
				t.Fatal(err)
			}
			qemuOut, qerr := exec.Command("qemu-img", "convert", "-O", "raw", p, filepath.Join(t.TempDir(), "q.raw")).CombinedOutput()
			if qerr != nil {
				t.Fatalf("qemu-img 7.2 reads this file without an error, the differential assumes; now: %v %s", qerr, qemuOut)
			}
			code, out := harness.RunBlockexport(t, "map", p)
			if code == 0 || strings.Count(strings.TrimSpace(out), "\n") != 0 || !strings.Contains(out, "corrupt") {
				t.Fatalf("blockexport map: exit %d, want a one-line refusal:\n%s", code, out)
			}
		})
	}
}

// TestVmdkCheckAsQemuImg: check on clean images of each kind exits 0 with
// qemu-img's JSON; a flat extent that starts past its file's end and a
// grain past the end of the file fail the check (exit 1, the ERROR line
// qemu-img prints) as in qemu-img.
func TestVmdkCheckAsQemuImg(t *testing.T) {
	dir := t.TempDir()
	src := harness.RandomImage(t, dir, 1<<20, 32)
	for _, sub := range []string{"monolithicSparse", "monolithicFlat", "streamOptimized", "twoGbMaxExtentSparse"} {
		img := filepath.Join(dir, sub+".vmdk")
		harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vmdk", "-o", "subformat="+sub, src, img)
		if got, want := harness.JSONOf(t, harness.Bin, "check", "--output=json", img), harness.JSONOf(t, "qemu-img", "check", "--output=json", img); !reflect.DeepEqual(got, want) {
			t.Errorf("%s: check %v, qemu-img %v", sub, got, want)
		}
	}
	flat := filepath.Join(dir, "flat.vmdk")
	desc := fmt.Sprintf("# Disk DescriptorFile\nversion=1\nCID=1\nparentCID=ffffffff\ncreateType=\"monolithicFlat\"\nRW 2048 FLAT \"%s\" 4096\n", filepath.Base(src))
	if err := os.WriteFile(flat, []byte(desc), 0o644); err != nil {
		t.Fatal(err)
	}
	sparse := filepath.Join(dir, "monolithicSparse.vmdk")
	b := harness.ReadAll(t, sparse)
	le := func(off int) int { return int(b[off]) | int(b[off+1])<<8 | int(b[off+2])<<16 | int(b[off+3])<<24 }
	gt := le(le(56)*512) * 512
	past := len(b)/512 + 1000
	b[gt+8], b[gt+9], b[gt+10], b[gt+11] = byte(past), byte(past>>8), byte(past>>16), byte(past>>24)
	bad := filepath.Join(dir, "bad.vmdk")
	if err := os.WriteFile(bad, b, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, img := range []string{flat, bad} {
		qout, qerr := exec.Command("qemu-img", "check", img).CombinedOutput()
		var ee *exec.ExitError
		if !errors.As(qerr, &ee) || ee.ExitCode() != 1 || !strings.Contains(string(qout), "points after EOF") {
			t.Fatalf("qemu-img check %s: %v, the test expects exit 1 and an ERROR line:\n%s", img, qerr, qout)
		}
		code, out := harness.RunBlockexport(t, "check", img)
		if code != 1 || !strings.Contains(out, "ERROR: cluster offset for sector") || !strings.Contains(out, "points after EOF") {
			t.Errorf("check %s: exit %d, want 1 and qemu-img's ERROR line:\n%s", filepath.Base(img), code, out)
		}
	}
}

// TestVmdkDecompressedCacheSize: a streamOptimized disk of compressible
// data (its grains Huffman-coded, so each is inflated and held, not read
// in place) exported with --decompressed-cache-size of one grain and of
// the whole disk reads back as qemu-img reads it, from several readers at
// once at random (a cache of one grain evicts on nearly every read); a
// size that is not one is refused in one line, exit 2.
func TestVmdkDecompressedCacheSize(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "letters.raw")
	r := rand.New(rand.NewPCG(7, 9))
	b := make([]byte, 16<<20)
	for i := range b {
		b[i] = "acgt"[r.IntN(4)]
	}
	if err := os.WriteFile(src, b, 0o644); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(dir, "s.vmdk")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vmdk", "-o", "subformat=streamOptimized", src, img)
	if st, err := os.Stat(img); err != nil || st.Size() > int64(len(b))/2 {
		t.Fatalf("the streamOptimized image is not compressed: %v %v", st.Size(), err)
	}
	for _, size := range []string{"64K", "32M"} {
		t.Run(size, func(t *testing.T) {
			mnt := filepath.Join(t.TempDir(), "mnt")
			d := harness.StartExport(t, img, mnt, "--decompressed-cache-size", size)
			var wg sync.WaitGroup
			errs := make(chan error, 4)
			for w := range 4 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					f, err := os.Open(mnt)
					if err != nil {
						errs <- err
						return
					}
					defer f.Close()
					rr := rand.New(rand.NewPCG(uint64(w), 1))
					got := make([]byte, 12<<10)
					for range 300 {
						off := rr.Int64N(int64(len(b)-len(got))) &^ 511
						if _, err := f.ReadAt(got, off); err != nil {
							errs <- err
							return
						}
						if !bytes.Equal(got, b[off:off+int64(len(got))]) {
							errs <- fmt.Errorf("wrong bytes at %d", off)
							return
						}
					}
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatal(err)
			}
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", mnt, src)
			d.StopClean()
		})
	}
	for _, bad := range []string{"lots", "-5", "1e3", "8E", "9E"} {
		code, out := harness.TryExport(t, filepath.Join(dir, "bad"), "--decompressed-cache-size", bad, img)
		if code != 2 || !strings.Contains(out, "--decompressed-cache-size") || strings.Count(strings.TrimSpace(out), "\n") != 0 {
			t.Fatalf("--decompressed-cache-size %s: exit %d, want 2 and one line naming the flag:\n%s", bad, code, out)
		}
	}
}
