package formats

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// needVhdi fails the test unless libyal's VHD tools are installed.
func needVhdi(t *testing.T) {
	t.Helper()
	for _, tool := range []string{"vhdiinfo", "vhdimount"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is needed: apt-get install -y libvhdi-utils", tool)
		}
	}
}

// exitOf runs name args and returns its exit status and output.
func exitOf(t *testing.T, name string, args ...string) (int, string) {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode(), string(out)
	}
	if err != nil {
		t.Fatal(err)
	}
	return 0, string(out)
}

// vhdiReads is the disk libyal's vhdimount (which shares no code with
// QEMU or us) reads from img, its first n bytes.
func vhdiReads(t *testing.T, img string, n int64) []byte {
	t.Helper()
	mnt := filepath.Join(t.TempDir(), "vhdi")
	os.Mkdir(mnt, 0o755)
	cmd := exec.Command("vhdimount", img, mnt)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("vhdimount %s: %v\n%s", img, err, out)
	}
	defer syscall.Unmount(mnt, syscall.MNT_DETACH)
	f, err := os.Open(filepath.Join(mnt, "vhdi1"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, 0); err != nil {
		t.Fatalf("read through vhdimount: %v", err)
	}
	return b
}

// TestVpcCreateEqualsQemuImg: create -f vpc with each subformat, with and
// without force_size (and with the file driver's options, which change
// nothing), for sizes on both sides of the CHS steps up to the 2040 GiB
// maximum: qemu-img info's JSON of our image equals that of
// qemu-img's image from the same command (its file name aside), qemu-img
// check answers the same (vpc has no checks: 63), vhdiinfo accepts it.
// What qemu-img refuses (a size past the maximum, an unknown subformat,
// force_size=maybe, an unknown key, a bad preallocation, nocow or
// extent_size_hint) is refused, with no file made.
func TestVpcCreateEqualsQemuImg(t *testing.T) {
	needVhdi(t)
	dir := t.TempDir()
	for _, size := range []string{"1M", "10M", "127M", "1G", "3221226496", "2040G"} {
		for _, opts := range []string{"subformat=dynamic", "force_size=on", "subformat=fixed", "subformat=fixed,force_size=on",
			"preallocation=full,extent_size_hint=1M,nocow=on", "subformat=fixed,preallocation=falloc,noforce_size"} {
			name := strings.NewReplacer("=", "-", ",", "-").Replace(size + "-" + opts)
			ours, theirs := filepath.Join(dir, name+".vhd"), filepath.Join(dir, name+"-qemu.vhd")
			harness.CreateImage(t, "-f", "vpc", "-o", opts, ours, size)
			harness.Run(t, "qemu-img", "create", "-q", "-f", "vpc", "-o", opts, theirs, size)
			info := func(p string) map[string]any {
				m := harness.JSONOf(t, "qemu-img", "info", "-f", "vpc", "--output=json", p).(map[string]any)
				delete(m, "filename")
				return m
			}
			if got, want := info(ours), info(theirs); !reflect.DeepEqual(got, want) {
				t.Errorf("%s %s: info\n got %v\nwant %v", size, opts, got, want)
			}
			if code, out := exitOf(t, "qemu-img", "check", "-f", "vpc", ours); code != 63 {
				t.Errorf("%s %s: qemu-img check exit %d, want 63 as for its own image\n%s", size, opts, code, out)
			}
			if code, out := exitOf(t, "vhdiinfo", ours); code != 0 || !strings.Contains(out, "Media size") {
				t.Errorf("%s %s: vhdiinfo exit %d\n%s", size, opts, code, out)
			}
			os.Remove(ours)
			os.Remove(theirs)
		}
	}
	for _, c := range [][]string{
		{"-o", "subformat=dynamic", "2041G"}, {"-o", "force_size=on", "2041G"}, {"-o", "subformat=Fixed", "1M"},
		{"-o", "force_size=maybe", "1M"}, {"-o", "cluster_size=64k", "1M"}, {"-o", "preallocation=metadata", "1M"},
		{"-o", "nocow=maybe", "1M"}, {"-o", "extent_size_hint=big", "1M"},
	} {
		p := filepath.Join(dir, "refused.vhd")
		qcode, _ := exitOf(t, "qemu-img", append(append([]string{"create", "-q", "-f", "vpc"}, c[:2]...), p, c[2])...)
		os.Remove(p) // qemu-img leaves an empty file behind
		code, out := harness.RunBlockexport(t, append(append([]string{"create", "-f", "vpc"}, c[:2]...), p, c[2])...)
		if qcode == 0 || code == 0 || strings.Count(strings.TrimSpace(out), "\n") != 0 {
			t.Errorf("%v: exit %d (qemu-img %d), want a one-line refusal:\n%s", c, code, qcode, out)
		}
		if _, err := os.Stat(p); err == nil {
			t.Errorf("%v: a refused create left a file", c)
		}
	}
}

// TestVpcConvertReadsBackEverywhere: convert -O vpc of a raw disk with
// holes and zero runs (and of its qcow2), dynamic and fixed, with
// force_size (Azure's fixed disk of a whole MiB: the virtual size is the
// source's and the file one footer longer) and without (the CHS geometry
// rounds up), also with O_DIRECT and parallel out-of-order writes:
// qemu-img compare finds the source's bytes, and so does libyal's
// vhdimount.
func TestVpcConvertReadsBackEverywhere(t *testing.T) {
	needVhdi(t)
	dir := t.TempDir()
	src := vdiRawWithHoles(t, dir)
	srcBytes := harness.ReadAll(t, src)
	qsrc := filepath.Join(dir, "src.qcow2")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "qcow2", src, qsrc)
	parallel := []string{"-t", "none", "-W", "-m", "8"}
	for _, c := range []struct {
		opts string
		args []string
	}{
		{"", nil}, {"subformat=fixed", nil}, {"subformat=fixed,force_size", nil}, {"force_size=on", nil},
		{"", parallel}, {"subformat=fixed,force_size", parallel}, {"", []string{"-f", "qcow2"}},
	} {
		t.Run(strings.ReplaceAll(c.opts+"_"+strings.Join(c.args, "_"), ",", "_"), func(t *testing.T) {
			t.Parallel() // the sources are only read; each conversion has its own file
			img := filepath.Join(t.TempDir(), "c.vhd")
			from := src
			args := append([]string{"convert", "-O", "vpc"}, c.args...)
			if slices.Contains(c.args, "qcow2") {
				from = qsrc
			} else {
				args = append(args, "-f", "raw")
			}
			if c.opts != "" {
				args = append(args, "-o", c.opts)
			}
			if code, out := harness.RunBlockexport(t, append(args, from, img)...); code != 0 {
				t.Fatalf("convert %v: exit %d\n%s", args, code, out)
			}
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "vpc", src, img)
			if strings.Contains(c.opts, "force_size") {
				info := harness.JSONOf(t, "qemu-img", "info", "-f", "vpc", "--output=json", img).(map[string]any)
				if vs := int64(info["virtual-size"].(float64)); vs != int64(len(srcBytes)) {
					t.Errorf("force_size: virtual size %d, want the source's %d", vs, len(srcBytes))
				}
				if fi, err := os.Stat(img); err != nil || strings.Contains(c.opts, "fixed") && fi.Size() != int64(len(srcBytes))+512 {
					t.Errorf("fixed force_size: file of %v bytes, want the disk's %d and the footer", fi.Size(), len(srcBytes))
				}
			}
			if !bytes.Equal(vhdiReads(t, img, int64(len(srcBytes))), srcBytes) {
				t.Error("vhdimount reads other bytes than the source's")
			}
		})
	}
}

// TestVpcWritableExports: a dynamic and a fixed VHD (ours, also with
// O_DIRECT, and qemu-img's; a fixed one probed by its footer) written
// through fuse -w under fio verify and through nbd -w with qemu-io
// (writes, write-zeroes, flush): after a clean stop the
// image reads back as the export did (qemu-img compare against a copy),
// vhdimount reads the same, vhdiinfo accepts it, the file's last 512
// bytes are a footer, and a fixed disk's is the one it had.
func TestVpcWritableExports(t *testing.T) {
	needVhdi(t)
	ours := func(opts string) func(t *testing.T, img string) {
		return func(t *testing.T, img string) { harness.CreateImage(t, "-f", "vpc", "-o", opts, img, "64M") }
	}
	for _, c := range []struct {
		name   string
		create func(t *testing.T, img string)
		args   []string
	}{
		{"dynamic", ours("subformat=dynamic"), nil},
		{"dynamic O_DIRECT", ours("subformat=dynamic"), []string{"--cache", "none"}},
		{"fixed O_DIRECT", ours("subformat=fixed,force_size=on"), []string{"--cache", "none"}},
		{"dynamic by qemu-img", func(t *testing.T, img string) {
			harness.Run(t, "qemu-img", "create", "-q", "-f", "vpc", img, "64M")
		}, nil},
		{"fixed", ours("subformat=fixed,force_size=on"), nil},
		{"fixed by qemu-img", func(t *testing.T, img string) {
			harness.Run(t, "qemu-img", "create", "-q", "-f", "vpc", "-o", "subformat=fixed", img, "64M")
		}, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel() // each disk has its own image, exports and copies
			dir := t.TempDir()
			img := filepath.Join(dir, "w.vhd")
			c.create(t, img)
			footer := func() []byte {
				b := harness.ReadAll(t, img)
				return b[len(b)-512:]
			}
			before := footer()
			mnt := filepath.Join(dir, "mnt")
			d := harness.StartExport(t, img, mnt, append([]string{"-w"}, c.args...)...) // probed: a fixed one by its footer
			harness.Run(t, "fio", append(harness.FioJob("vpc", "4k", "0", "64M", 47), "--io_size=4M", "--filename="+mnt)...)
			harness.Run(t, "fio", append(harness.FioJob("vpc-big", "1M", "0", "64M", 48), "--io_size=8M", "--filename="+mnt)...)
			exported := filepath.Join(dir, "exported.raw")
			harness.Run(t, "cp", mnt, exported)
			d.StopClean()
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "vpc", exported, img)

			srv := harness.StartNBD(t, img, false, append([]string{"-w"}, c.args...)...)
			harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x5a 1000 70000", "-c", "write -z 3M 2M", "-c", "flush", srv.URI)
			srv.StopClean()
			harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x5a 1000 70000", "-c", "write -z 3M 2M", exported)
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "vpc", exported, img)
			if strings.HasPrefix(c.name, "fixed") && !bytes.Equal(footer(), before) || !bytes.HasPrefix(footer(), []byte("conectix")) {
				t.Error("the fixed disk's footer changed")
			}
			want := harness.ReadAll(t, exported)
			if !bytes.Equal(vhdiReads(t, img, int64(len(want))), want) {
				t.Error("vhdimount reads other bytes")
			}
			if code, out := exitOf(t, "vhdiinfo", img); code != 0 {
				t.Errorf("vhdiinfo exit %d\n%s", code, out)
			}
		})
	}
}

// TestVpcFixedDiskProbedByItsFooter: a fixed VHD (qemu-img's, ours, and
// one of a whole MiB with force_size) is probed as vpc by its footer at
// the end, where qemu-img probes raw: info says so in one note line, and
// its JSON is qemu-img's given -f vpc. Files that end in a footer by
// accident stay raw: a bad checksum, a size that is not the file's, a
// dynamic footer; given -f raw, a fixed VHD is raw with a warning.
func TestVpcFixedDiskProbedByItsFooter(t *testing.T) {
	dir := t.TempDir()
	qemuFixed := filepath.Join(dir, "qemu.vhd")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "vpc", "-o", "subformat=fixed", qemuFixed, "5M")
	ours := filepath.Join(dir, "ours.vhd")
	harness.CreateImage(t, "-f", "vpc", "-o", "subformat=fixed,force_size=on", ours, "4M")
	for _, img := range []string{qemuFixed, ours} {
		code, out := harness.RunBlockexport(t, "info", img)
		if code != 0 || !strings.Contains(out, "file format: vpc") || strings.Count(out, "note:") != 1 || !strings.Contains(out, "qemu-img") {
			t.Errorf("info %s: exit %d, want vpc and one note of qemu-img's raw:\n%s", filepath.Base(img), code, out)
		}
		want := harness.JSONOf(t, "qemu-img", "info", "-f", "vpc", "--output=json", img)
		if got := harness.JSONOf(t, harness.Bin, "info", "--output=json", img); !reflect.DeepEqual(got, want) {
			t.Errorf("info --output=json %s:\n got %v\nwant %v", filepath.Base(img), got, want)
		}
		if _, out := harness.RunBlockexport(t, "info", "-f", "raw", img); !strings.Contains(out, "file format: raw") || !strings.Contains(out, "looks like a vpc image") {
			t.Errorf("info -f raw %s: want raw with a warning:\n%s", filepath.Base(img), out)
		}
	}
	good := harness.ReadAll(t, ours)
	accidents := map[string]func(b []byte) []byte{
		"bad checksum": func(b []byte) []byte { b[len(b)-512+100] ^= 1; return b },
		"size is not the file's": func(b []byte) []byte {
			return append(make([]byte, 4096), b...)
		},
		"dynamic footer": func(b []byte) []byte {
			f := b[len(b)-512:]
			binary.BigEndian.PutUint32(f[60:], 3)
			fixChecksum(f)
			return b
		},
	}
	for name, mod := range accidents {
		p := filepath.Join(dir, strings.ReplaceAll(name, " ", "-")+".img")
		if err := os.WriteFile(p, mod(append([]byte(nil), good...)), 0o644); err != nil {
			t.Fatal(err)
		}
		code, out := harness.RunBlockexport(t, "info", p)
		if code != 0 || !strings.Contains(out, "file format: raw") || strings.Contains(out, "note:") {
			t.Errorf("%s: exit %d, want raw as qemu-img says:\n%s", name, code, out)
		}
	}
}

// fixChecksum recomputes a VHD footer's checksum.
func fixChecksum(f []byte) {
	binary.BigEndian.PutUint32(f[64:], 0)
	var sum uint32
	for _, c := range f[:512] {
		sum += uint32(c)
	}
	binary.BigEndian.PutUint32(f[64:], ^sum)
}

// TestVpcSurvivesKill9: the exporter of a fresh dynamic VHD (each write
// may allocate a block: the footer moved, bitmap and data, sync, the BAT
// entry) is killed with SIGKILL while writers write, punch holes and
// fsync. Every time the image opens here (every BAT entry inside the
// file, over no other block or structure) and in qemu-img (whose check
// has nothing to check for vpc: 63, as for any VHD), and every block
// reads back as the rule of [harness.WritesUnderKill] allows: what was
// synced exactly, what was written since as one of its values.
func TestVpcSurvivesKill9(t *testing.T) {
	// TornAt 512: a block's data starts one bitmap sector into its place,
	// so a 4 KiB write spans two host pages and a kill may land between.
	load := harness.KillLoad{BlockSize: 4096, Blocks: 64 << 20 / 4096, Writers: 4, SyncEvery: 8, PunchOneIn: 8, TornAt: 512}
	dir := t.TempDir()
	img := filepath.Join(dir, "crash.vhd")
	harness.CreateImage(t, "-f", "vpc", "-o", "force_size=on", img, "64M")
	writes := harness.NewWritesUnderKill(load)
	r := rand.New(rand.NewPCG(47, 47))
	for round := 1; round <= 3; round++ {
		writes.Round(t, round, img, filepath.Join(dir, fmt.Sprintf("mnt%d", round)), time.Duration(100+r.IntN(300))*time.Millisecond)
		if code, out := harness.RunBlockexport(t, "info", img); code != 0 {
			t.Fatalf("round %d: the image no longer opens: exit %d\n%s", round, code, out)
		}
		if code, out := exitOf(t, "qemu-img", "check", "-f", "vpc", img); code != 63 {
			t.Fatalf("round %d: qemu-img check exit %d, want 63 (no checks for vpc)\n%s", round, code, out)
		}
		raw := filepath.Join(dir, fmt.Sprintf("round%d.raw", round))
		harness.Run(t, "qemu-img", "convert", "-f", "vpc", "-O", "raw", img, raw)
		got := writes.Check(t, round, harness.ReadAll(t, raw))
		t.Logf("round %d: %v", round, got)
		if round == 1 && got.Synced == 0 {
			t.Fatal("no write was fsynced before the kill: nothing was checked")
		}
		os.Remove(raw)
	}
}
