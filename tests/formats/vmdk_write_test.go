package formats

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// runIn runs name with args in dir and fails the test if it fails.
func mustRunIn(t *testing.T, dir, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s (in %s): %v\n%s", name, strings.Join(args, " "), dir, err, out)
	}
	return string(out)
}

// needVmdkTools fails the test when libyal's vmdk tools are missing.
func needVmdkTools(t *testing.T) {
	t.Helper()
	for _, tool := range []string{"vmdkinfo", "vmdkmount"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is missing: apt-get install libvmdk-utils", tool)
		}
	}
}

var descriptorCID = regexp.MustCompile(`(?m)^CID=[0-9a-f]+$`)

// vmdkFilesEqual: the files of two images made by the same command are
// the same but for the CID: descriptor text (in a descriptor file, or a
// sparse file's embedded one), sparse headers, directories and tables
// byte for byte; flat extents of one size.
func vmdkFilesEqual(t *testing.T, ours, theirs string) {
	t.Helper()
	bi, err := os.Stat(ours)
	if err != nil {
		t.Fatal(err)
	}
	wi, err := os.Stat(theirs)
	if err != nil {
		t.Fatal(err)
	}
	if max(bi.Size(), wi.Size()) > 64<<20 { // a flat extent: its size is all there is
		if bi.Size() != wi.Size() {
			t.Errorf("%s: %d bytes, qemu-img's %d", filepath.Base(ours), bi.Size(), wi.Size())
		}
		return
	}
	b, w := harness.ReadAll(t, ours), harness.ReadAll(t, theirs)
	mask := func(p []byte) string {
		return descriptorCID.ReplaceAllString(string(bytes.TrimRight(p, "\x00")), "CID=*")
	}
	switch {
	case bytes.HasPrefix(w, []byte("# Disk DescriptorFile")): // of a length that varies with the CID's
		if mask(b) != mask(w) {
			t.Errorf("%s: descriptor\n%s\nqemu-img's\n%s", filepath.Base(ours), b, w)
		}
	case len(b) != len(w):
		t.Errorf("%s: %d bytes, qemu-img's %d", filepath.Base(ours), len(b), len(w))
	case bytes.HasPrefix(w, []byte("KDMV")) && len(w) >= 21*512:
		if !bytes.Equal(b[:512], w[:512]) || !bytes.Equal(b[21*512:], w[21*512:]) {
			t.Errorf("%s: the sparse header or tables differ from qemu-img's", filepath.Base(ours))
		}
		if mask(b[512:21*512]) != mask(w[512:21*512]) {
			t.Errorf("%s: embedded descriptor\n%s\nqemu-img's\n%s", filepath.Base(ours), mask(b[512:21*512]), mask(w[512:21*512]))
		}
	default:
		if !bytes.Equal(b, w) {
			t.Errorf("%s differs from qemu-img's", filepath.Base(ours))
		}
	}
}

// infoWithoutCID is qemu-img info's JSON of img, run in its directory,
// without the CID and the host allocation.
func infoWithoutCID(t *testing.T, dir, img string) map[string]any {
	t.Helper()
	var v map[string]any
	if err := json.Unmarshal([]byte(mustRunIn(t, dir, "qemu-img", "info", "--output=json", img)), &v); err != nil {
		t.Fatal(err)
	}
	delete(v, "actual-size")
	if fs, ok := v["format-specific"].(map[string]any); ok {
		delete(fs["data"].(map[string]any), "cid")
	}
	return v
}

// TestVmdkCreateMatchesQemuImg: create -f vmdk with each subformat and
// qemu-img's options makes the files qemu-img 7.2 makes for the same
// command, named as it names them, with the same bytes but the CID; info
// says the same; qemu-img check finds them clean and libyal's vmdkinfo
// reads them.
func TestVmdkCreateMatchesQemuImg(t *testing.T) {
	needVmdkTools(t)
	for _, c := range []struct{ size, opts string }{
		{"5G", "subformat=monolithicSparse"},
		{"5G", "subformat=monolithicFlat"},
		{"5G", "subformat=twoGbMaxExtentSparse"},
		{"5G", "subformat=twoGbMaxExtentFlat"},
		{"5G", "subformat=streamOptimized"},
		{"4400M", "adapter_type=lsilogic,hwversion=10,toolsversion=10338"},
		{"100M", "compat6=on,adapter_type=legacyESX,zeroed_grain=on"},
		{"3G", "subformat=twoGbMaxExtentSparse,adapter_type=buslogic,zeroed_grain=on"},
		{"100M", "subformat=streamOptimized,zeroed_grain=on,hwversion=undefined"},
		{"100M", "backing_file=base.vmdk,backing_fmt=vmdk"},
		{"3G", "subformat=twoGbMaxExtentSparse,backing_file=base.vmdk,backing_fmt=vmdk"},
	} {
		t.Run(c.opts, func(t *testing.T) {
			ours, theirs := t.TempDir(), t.TempDir()
			mustRunIn(t, theirs, "qemu-img", "create", "-q", "-f", "vmdk", "base.vmdk", "100M")
			if err := os.WriteFile(filepath.Join(ours, "base.vmdk"), harness.ReadAll(t, filepath.Join(theirs, "base.vmdk")), 0o644); err != nil {
				t.Fatal(err) // one parent, one CID
			}
			mustRunIn(t, theirs, "qemu-img", "create", "-q", "-f", "vmdk", "-o", c.opts, "d.vmdk", c.size)
			mustRunIn(t, ours, harness.Bin, "create", "-f", "vmdk", "-o", c.opts, "d.vmdk", c.size)
			names := func(d string) []string {
				es, _ := os.ReadDir(d)
				var n []string
				for _, e := range es {
					n = append(n, e.Name())
				}
				return n
			}
			if got, want := names(ours), names(theirs); !slices.Equal(got, want) {
				t.Fatalf("files %v, qemu-img makes %v", got, want)
			}
			for _, n := range names(theirs) {
				if n != "base.vmdk" {
					vmdkFilesEqual(t, filepath.Join(ours, n), filepath.Join(theirs, n))
				}
			}
			if got, want := infoWithoutCID(t, ours, "d.vmdk"), infoWithoutCID(t, theirs, "d.vmdk"); !reflect.DeepEqual(got, want) {
				t.Errorf("qemu-img info of ours\n%v\nof qemu-img's\n%v", got, want)
			}
			mustRunIn(t, ours, "qemu-img", "check", "-q", "d.vmdk")
			mustRunIn(t, ours, "vmdkinfo", "d.vmdk")
		})
	}
}

// vmdkSource is a qcow2 image of an odd size (not whole grains) with
// data, zeroes, a hole and data in its last, partial grain, and the raw
// bytes it reads as.
func vmdkSource(t *testing.T, dir string) (src, raw string) {
	t.Helper()
	sparse := harness.SparseImage(t, dir, "sparse.raw", 70000<<10)
	f, err := os.OpenFile(sparse, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range [][2]int64{{0, 3 << 20}, {40000 << 10, 1500 << 10}, {69990 << 10, 10 << 10}} {
		b := harness.RandomBytes(int(r[1]), uint64(i+1))
		if i == 1 {
			b = bytes.Repeat([]byte("compressible "), int(r[1])/13+1)[:r[1]]
		}
		if _, err := f.WriteAt(b, r[0]); err != nil {
			t.Fatal(err)
		}
	}
	f.Close()
	src = filepath.Join(dir, "src.qcow2")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "qcow2", sparse, src)
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -z 1M 64k", src)
	raw = filepath.Join(dir, "src.raw")
	harness.Run(t, "qemu-img", "convert", "-f", "qcow2", "-O", "raw", src, raw)
	return src, raw
}

// vmdkMountReads: libyal's vmdkmount reads img as raw's bytes.
func vmdkMountReads(t *testing.T, img, raw string) {
	t.Helper()
	mnt := filepath.Join(t.TempDir(), "vmdkmount")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("vmdkmount", img, mnt).CombinedOutput(); err != nil {
		t.Fatalf("vmdkmount %s: %v\n%s", img, err, out)
	}
	t.Cleanup(func() { exec.Command("fusermount3", "-u", mnt).Run() })
	harness.MustEqualBytes(t, "vmdkmount's read of "+filepath.Base(img), harness.ReadAll(t, filepath.Join(mnt, "vmdk1")), harness.ReadAll(t, raw))
	exec.Command("fusermount3", "-u", mnt).Run()
}

// TestVmdkConvertToEachSubformat: convert -O vmdk from a qcow2 image
// (data, zeroes, holes, a partial last grain) makes each subformat, one
// that qemu-img compare finds identical to the source, qemu-img check
// clean, and libyal's vmdkinfo reads; vmdkmount reads the sparse ones as
// the source; streamOptimized also with -W and a progress bar, its grains
// deflated.
func TestVmdkConvertToEachSubformat(t *testing.T) {
	needVmdkTools(t)
	dir := t.TempDir()
	src, raw := vmdkSource(t, dir)
	for _, c := range []struct{ sub, opts string }{
		{"monolithicSparse", ""}, {"monolithicFlat", ""}, {"twoGbMaxExtentSparse", ""},
		{"twoGbMaxExtentFlat", ""}, {"streamOptimized", ""}, {"streamOptimized", "-W -p"},
		{"monolithicSparse", "zeroed_grain=on"},
	} {
		t.Run(c.sub+c.opts, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "d.vmdk")
			args := []string{"convert", "-O", "vmdk", "-o", "subformat=" + c.sub}
			if strings.HasPrefix(c.opts, "-") {
				args = append(args, strings.Fields(c.opts)...)
			} else if c.opts != "" {
				args[4] += "," + c.opts
			}
			if code, msg := harness.RunBlockexport(t, append(args, src, out)...); code != 0 {
				t.Fatalf("convert: exit %d\n%s", code, msg)
			}
			harness.Run(t, "qemu-img", "compare", "-f", "qcow2", "-F", "vmdk", src, out)
			harness.Run(t, "qemu-img", "check", "-q", out)
			harness.Run(t, "vmdkinfo", out)
			if !strings.Contains(c.sub, "Flat") {
				vmdkMountReads(t, out, raw)
			}
			if c.sub == "streamOptimized" {
				if fi, _ := os.Stat(out); fi.Size() > 6<<20 {
					t.Errorf("streamOptimized of 4.5 MiB of data (1.5 MiB compressible) takes %d bytes: grains not deflated", fi.Size())
				}
			}
		})
	}
}

// TestVmdkWritableExportsWriteInPlace: fuse -w on each subformat written
// in place (the two sparse kinds, the two flat kinds) and nbd -w on a
// monolithicSparse image: writes inside a grain, across grains, across
// the first 2 GiB extent's end, in the last grain and over data written
// before all read back through qemu-img, whose check finds the image
// clean.
func TestVmdkWritableExportsWriteInPlace(t *testing.T) {
	const size = 2<<30 + 1<<20
	writes := []struct{ off, n int64 }{{100, 1}, {65536 - 10, 20}, {3 << 20, 200 << 10}, {2<<30 - 5000, 10000}, {size - 4096, 4096}, {110, 3000}}
	for _, sub := range []string{"monolithicSparse", "twoGbMaxExtentSparse", "monolithicFlat", "twoGbMaxExtentFlat", "nbd"} {
		t.Run(sub, func(t *testing.T) {
			dir := t.TempDir()
			img := filepath.Join(dir, "d.vmdk")
			create := sub
			if sub == "nbd" {
				create = "monolithicSparse"
			}
			harness.CreateImage(t, "-f", "vmdk", "-o", "subformat="+create, img, fmt.Sprint(size))
			ref := harness.SparseImage(t, dir, "ref.raw", size)
			rf, err := os.OpenFile(ref, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer rf.Close()
			if sub == "nbd" {
				s := harness.StartNBD(t, img, false, "-w")
				for i, w := range writes {
					b := harness.RandomBytes(int(w.n), uint64(i+7))
					rf.WriteAt(b, w.off)
					p := filepath.Join(dir, "piece")
					if err := os.WriteFile(p, b, 0o644); err != nil {
						t.Fatal(err)
					}
					harness.Run(t, "qemu-io", "-f", "raw", "-c", fmt.Sprintf("write -s %s %d %d", p, w.off, w.n), "-c", "flush", s.URI)
				}
				s.StopClean()
			} else {
				mnt := filepath.Join(dir, "mnt")
				d := harness.StartExport(t, img, mnt, "-w")
				f, err := os.OpenFile(mnt, os.O_RDWR, 0)
				if err != nil {
					t.Fatal(err)
				}
				for i, w := range writes {
					b := harness.RandomBytes(int(w.n), uint64(i+7))
					rf.WriteAt(b, w.off)
					if _, err := f.WriteAt(b, w.off); err != nil {
						t.Fatalf("write %d at %d: %v", w.n, w.off, err)
					}
				}
				if err := f.Sync(); err != nil {
					t.Fatal(err)
				}
				f.Close()
				d.StopClean()
			}
			harness.Run(t, "qemu-img", "check", "-q", img)
			harness.Run(t, "qemu-img", "compare", "-f", "vmdk", "-F", "raw", img, ref)
		})
	}
}

// TestVmdkStreamOptimizedWithGrainsPointsToAnOverlay: a streamOptimized
// image that holds grains is written once, as it is converted (as in
// QEMU): fuse -w on it is refused in one line that names the command
// making a qcow2 overlay, and the image is left as it was.
func TestVmdkStreamOptimizedWithGrainsPointsToAnOverlay(t *testing.T) {
	dir := t.TempDir()
	src := harness.RandomImage(t, dir, 1<<20, 3)
	img := filepath.Join(dir, "s.vmdk")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vmdk", "-o", "subformat=streamOptimized", src, img)
	before := harness.ReadAll(t, img)
	code, out := harness.TryExport(t, filepath.Join(dir, "mnt"), "-w", img)
	if code != 1 || !strings.Contains(out, "-F vmdk overlay.qcow2") || strings.Count(strings.TrimSpace(out), "\n") != 0 {
		t.Fatalf("fuse -w on a streamOptimized image with grains: exit %d, want 1 and one line naming a qcow2 overlay:\n%s", code, out)
	}
	harness.MustEqualBytes(t, "the image after the refusal", harness.ReadAll(t, img), before)
}

// TestVmdkSurvivesKill9: the exporter of a monolithicSparse image is
// killed with SIGKILL at random moments while clients write 4 KiB blocks
// (each a part of a 64 KiB grain: new grains filled around the write)
// and fsync. Every time qemu-img check and ours find the image clean (a
// leak at worst: a grain written and not yet linked), and every block
// reads back as the rule of [harness.WritesUnderKill] allows: what was
// synced exactly, what was written since as one of its values.
func TestVmdkSurvivesKill9(t *testing.T) {
	// 16 MiB. TornAt 512: the driver places grains on sector boundaries
	// only (not pages), so a 4 KiB write into one may span two host pages
	// and a kill land between them.
	load := harness.KillLoad{BlockSize: 4096, Blocks: 4096, Writers: 2, SyncEvery: 8, TornAt: 512}
	dir := t.TempDir()
	img := filepath.Join(dir, "crash.vmdk")
	harness.CreateImage(t, "-f", "vmdk", img, fmt.Sprint(load.Blocks*load.BlockSize))
	writes := harness.NewWritesUnderKill(load)
	r := rand.New(rand.NewPCG(47, 47))
	for round := 1; round <= 3; round++ {
		writes.Round(t, round, img, filepath.Join(dir, fmt.Sprintf("mnt%d", round)), time.Duration(100+r.IntN(300))*time.Millisecond)
		if out, err := exec.Command("qemu-img", "check", "-f", "vmdk", img).CombinedOutput(); err != nil {
			t.Fatalf("round %d: qemu-img check: %v\n%s", round, err, out)
		}
		if code, out := harness.RunBlockexport(t, "check", img); code != 0 {
			t.Fatalf("round %d: blockexport check: exit %d\n%s", round, code, out)
		}
		asRaw := filepath.Join(dir, fmt.Sprintf("round%d.raw", round))
		harness.Run(t, "qemu-img", "convert", "-f", "vmdk", "-O", "raw", img, asRaw)
		got := writes.Check(t, round, harness.ReadAll(t, asRaw))
		os.Remove(asRaw)
		t.Logf("round %d: %v", round, got)
	}
}

// TestVmdkDeltaDiskAndDdOutput: a delta disk (create -b) written through
// fuse -w in part of a grain keeps its parent's bytes around the write,
// reads back through qemu-img with the chain and leaves the parent as it
// was; dd -O vmdk writes a vmdk that reads as its input.
func TestVmdkDeltaDiskAndDdOutput(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.vmdk")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "vmdk", base, "8M")
	harness.Run(t, "qemu-io", "-f", "vmdk", "-c", "write -P 0x11 0 8M", base)
	baseBytes := harness.ReadAll(t, base)
	delta := filepath.Join(dir, "delta.vmdk")
	harness.CreateImage(t, "-f", "vmdk", "-b", base, "-F", "vmdk", delta)
	d := harness.StartExport(t, delta, filepath.Join(dir, "mnt"), "-w")
	f, err := os.OpenFile(filepath.Join(dir, "mnt"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(bytes.Repeat([]byte{0x22}, 1000), 70000); err != nil {
		t.Fatal(err)
	}
	f.Close()
	d.StopClean()
	out := harness.Run(t, "qemu-io", "-f", "vmdk", "-c", "read -P 0x11 0 70000", "-c", "read -P 0x22 70000 1000",
		"-c", "read -P 0x11 71000 8317608", delta)
	if strings.Contains(out, "fail") {
		t.Fatalf("the delta disk reads other bytes than its parent and the write:\n%s", out)
	}
	harness.Run(t, "qemu-img", "check", "-q", delta)
	harness.MustEqualBytes(t, "the parent after writes to its delta", harness.ReadAll(t, base), baseBytes)

	src := harness.RandomImage(t, dir, 3<<20, 9)
	dd := filepath.Join(dir, "dd.vmdk")
	if code, msg := harness.RunBlockexport(t, "dd", "-O", "vmdk", "if="+src, "of="+dd); code != 0 {
		t.Fatalf("dd -O vmdk: exit %d\n%s", code, msg)
	}
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "vmdk", src, dd)
}

// TestVmdkConvertWithBackingWritesOnlyTheDifference: convert -O vmdk -B
// makes a delta disk on a vmdk parent (its CID recorded) that holds only
// the grains where the source differs from the parent, and reads as the
// source through qemu-img, sparse and streamOptimized alike.
func TestVmdkConvertWithBackingWritesOnlyTheDifference(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.vmdk")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "vmdk", base, "8M")
	harness.Run(t, "qemu-io", "-f", "vmdk", "-c", "write -P 0x01 0 8M", base)
	top := filepath.Join(dir, "top.raw")
	harness.Run(t, "qemu-img", "convert", "-f", "vmdk", "-O", "raw", base, top)
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x02 1M 100k", top)
	for _, sub := range []string{"monolithicSparse", "streamOptimized"} {
		t.Run(sub, func(t *testing.T) {
			out := filepath.Join(dir, sub+".vmdk")
			if code, msg := harness.RunBlockexport(t, "convert", "-O", "vmdk", "-o", "subformat="+sub, "-B", "base.vmdk", "-F", "vmdk", top, out); code != 0 {
				t.Fatalf("convert -B: exit %d\n%s", code, msg)
			}
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "vmdk", top, out)
			harness.Run(t, "qemu-img", "check", "-q", out)
			var info struct {
				Backing string `json:"backing-filename"`
			}
			if err := json.Unmarshal([]byte(harness.Run(t, "qemu-img", "info", "--output=json", out)), &info); err != nil || info.Backing != "base.vmdk" {
				t.Fatalf("parent %q (%v), want base.vmdk", info.Backing, err)
			}
			// Only the grains of [1M, 1M+100k) are the delta's own.
			if code, msg := harness.RunBlockexport(t, "map", "--output=json", out); code != 0 {
				t.Fatalf("map: exit %d\n%s", code, msg)
			} else {
				var own int64
				var entries []struct {
					Length int64
					Depth  int
					Data   bool
				}
				if err := json.Unmarshal([]byte(msg), &entries); err != nil {
					t.Fatal(err)
				}
				for _, e := range entries {
					if e.Depth == 0 && e.Data {
						own += e.Length
					}
				}
				if own != 2*65536 {
					t.Fatalf("the delta holds %d bytes of its own, want the 2 grains that differ\n%s", own, msg)
				}
			}
		})
	}
}

// TestVmdkConvertCompressedAsQemuImg: convert -c -O vmdk exits as
// qemu-img 7.2 does for each subformat: the sparse ones are made (a
// streamOptimized one deflated, the others' grains stored as they are)
// and read as the source; a flat one has no clusters and is refused with
// qemu-img's message and exit code.
func TestVmdkConvertCompressedAsQemuImg(t *testing.T) {
	needVmdkTools(t)
	dir := t.TempDir()
	src, _ := vmdkSource(t, dir)
	for _, sub := range []string{"monolithicSparse", "twoGbMaxExtentSparse", "streamOptimized", "monolithicFlat", "twoGbMaxExtentFlat"} {
		t.Run(sub, func(t *testing.T) {
			theirs := filepath.Join(t.TempDir(), "theirs.vmdk")
			qcmd := exec.Command("qemu-img", "convert", "-c", "-O", "vmdk", "-o", "subformat="+sub, src, theirs)
			qout, err := qcmd.CombinedOutput()
			qcode := qcmd.ProcessState.ExitCode()
			if err != nil && qcode < 0 {
				t.Fatalf("qemu-img convert: %v", err)
			}
			ours := filepath.Join(t.TempDir(), "ours.vmdk")
			code, msg := harness.RunBlockexport(t, "convert", "-c", "-O", "vmdk", "-o", "subformat="+sub, src, ours)
			if code != qcode {
				t.Fatalf("convert -c exits %d (%s), qemu-img %d (%s)", code, msg, qcode, qout)
			}
			if code != 0 {
				want := strings.TrimPrefix(strings.TrimSpace(string(qout)), "qemu-img: ")
				if !strings.HasSuffix(strings.TrimSpace(msg), want) {
					t.Fatalf("convert -c says %q, qemu-img %q", msg, qout)
				}
				return
			}
			harness.Run(t, "qemu-img", "compare", "-f", "qcow2", "-F", "vmdk", src, ours)
			harness.Run(t, "qemu-img", "check", "-q", ours)
		})
	}
}
