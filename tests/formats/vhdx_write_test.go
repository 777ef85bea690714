package formats

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// vhdxInfo is qemu-img info's JSON of a VHDX image, less its name.
func vhdxInfo(t *testing.T, img string) map[string]any {
	t.Helper()
	m := harness.JSONOf(t, "qemu-img", "info", "-f", "vhdx", "--output=json", img).(map[string]any)
	delete(m, "filename")
	return m
}

// TestVhdxCreateEqualsQemuImg: create -f vhdx with qemu-img 7.2's -o keys
// makes what qemu-img makes (qemu-img info's JSON equal, the disk usage
// included: the same extents are written), qemu-img check finds it clean,
// and qemu-img and we read zeroes; every refusal is qemu-img's, one line,
// before a file is made.
func TestVhdxCreateEqualsQemuImg(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct{ size, opts string }{
		{"100M", ""}, {"0", ""}, {"3G", ""}, {"200G", ""}, {"64T", ""}, {"2500k", "subformat=fixed,block_size=1M"},
		{"20M", "subformat=fixed"}, {"20M", "subformat=fixed,block_state_zero=off"}, {"1G", "block_state_zero=off"},
		{"1G", "log_size=1536k,block_size=1536k"}, {"1G", "log_size=4M,block_size=512M"}, {"1G", "block_size=512k,log_size=512k"},
		{"1G", "preallocation=falloc,nocow=on,extent_size_hint=1M"}, {"10M", "subformat=dynamic,block_state_zero=on"},
		{"1G", "block_size=18446744073709551615,log_size=0x2M"},
	} {
		name := strings.NewReplacer("=", "-", ",", "-").Replace(c.size + "-" + c.opts)
		ours, theirs := filepath.Join(dir, name+".vhdx"), filepath.Join(dir, name+"-qemu.vhdx")
		args := []string{"-f", "vhdx"}
		if c.opts != "" {
			args = append(args, "-o", c.opts)
		}
		harness.CreateImage(t, append(args, ours, c.size)...)
		harness.Run(t, "qemu-img", append(append([]string{"create", "-q"}, args...), theirs, c.size)...)
		if got, want := vhdxInfo(t, ours), vhdxInfo(t, theirs); !reflect.DeepEqual(got, want) {
			t.Errorf("%s %s: info\n got %v\nwant %v", c.size, c.opts, got, want)
		}
		if code, out := exitOf(t, "qemu-img", "check", "-f", "vhdx", ours); code != 0 {
			t.Errorf("%s %s: qemu-img check exit %d\n%s", c.size, c.opts, code, out)
		}
		if c.size != "0" && !strings.HasSuffix(c.size, "T") && !strings.HasSuffix(c.size, "00G") {
			blank := filepath.Join(dir, "blank.raw")
			harness.Run(t, "qemu-img", "create", "-q", "-f", "raw", blank, c.size)
			harness.Run(t, "qemu-img", "compare", "-q", "-f", "raw", "-F", "vhdx", blank, ours)
			if code, out := harness.RunBlockexport(t, "compare", blank, ours); code != 0 {
				t.Errorf("%s %s: our compare with zeroes: exit %d\n%s", c.size, c.opts, code, out)
			}
			os.Remove(blank)
		}
		os.Remove(ours)
		os.Remove(theirs)
	}
	for _, c := range [][]string{
		{"-o", "subformat=Fixed", "1M"}, {"-o", "block_size=3M", "1G"}, {"-o", "block_size=-1", "1G"}, {"-o", "block_size=big", "1G"},
		{"-o", "log_size=0", "1G"}, {"-o", "log_size=8G", "1G"}, {"-o", "block_state_zero=maybe", "1G"}, {"-o", "foo=1", "1G"},
		{"-o", "cluster_size=1M", "1G"}, {"-o", "preallocation=metadata", "1G"}, {"-o", "nocow=x", "1G"}, {"-o", "subformat=dynamic", "65T"}, {"-o", "block_size=16E", "1G"}, {"-o", "log_size=0x1.5M", "1G"},
		{"-b", "base.vhdx", "1G"},
	} {
		p := filepath.Join(dir, "refused.vhdx")
		qcode, qout := exitOf(t, "qemu-img", append(append([]string{"create", "-q", "-f", "vhdx"}, c[:2]...), p, c[2])...)
		os.Remove(p) // qemu-img leaves an empty file behind for some
		code, out := harness.RunBlockexport(t, append(append([]string{"create", "-f", "vhdx"}, c[:2]...), p, c[2])...)
		if qcode == 0 || code == 0 || strings.Count(strings.TrimSpace(out), "\n") != 0 {
			t.Errorf("%v: exit %d (qemu-img %d), want a one-line refusal:\n%s", c, code, qcode, out)
		}
		// qemu-img's words: its message after "qemu-img: PATH: ".
		words := qout[strings.LastIndex(strings.SplitN(qout, "\n", 2)[0], ": ")+2:]
		if words = strings.SplitN(words, "\n", 2)[0]; !strings.Contains(out, words) {
			t.Errorf("%v: %q, want qemu-img's words %q", c, out, words)
		}
		if _, err := os.Stat(p); err == nil {
			t.Errorf("%v: a refused create left a file", c)
		}
	}
}

// TestVhdxConvertReadsBack: convert -O vhdx (dynamic, fixed, without
// ZERO blocks, 1 MiB blocks, O_DIRECT with parallel out-of-order writes)
// of a raw disk with holes and zero runs and of its qcow2: qemu-img
// compare finds the source's bytes, qemu-img check finds it clean, and
// our compare agrees. The image stays read-only to everything but the
// conversion that made it: convert -n into it is refused.
func TestVhdxConvertReadsBack(t *testing.T) {
	dir := t.TempDir()
	src := vdiRawWithHoles(t, dir)
	qsrc := filepath.Join(dir, "src.qcow2")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "qcow2", src, qsrc)
	for _, c := range []struct {
		opts string
		args []string
	}{
		{"", nil}, {"subformat=fixed", nil}, {"subformat=fixed,block_state_zero=off", nil}, {"block_state_zero=off,block_size=1M", nil},
		{"", []string{"-t", "none", "-W", "-m", "8"}}, {"subformat=fixed", []string{"-t", "none", "-W", "-m", "8"}},
	} {
		for _, from := range []string{src, qsrc} {
			img := filepath.Join(dir, "c.vhdx")
			args := append([]string{"convert", "-O", "vhdx"}, c.args...)
			if c.opts != "" {
				args = append(args, "-o", c.opts)
			}
			if code, out := harness.RunBlockexport(t, append(args, from, img)...); code != 0 {
				t.Fatalf("convert %v: exit %d\n%s", args, code, out)
			}
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "vhdx", src, img)
			if code, out := exitOf(t, "qemu-img", "check", "-f", "vhdx", img); code != 0 {
				t.Errorf("%v %s: qemu-img check exit %d\n%s", args, from, code, out)
			}
			if code, out := harness.RunBlockexport(t, "compare", src, img); code != 0 {
				t.Errorf("%v %s: our compare: exit %d\n%s", args, from, code, out)
			}
			// qemu-img's conversion has the same virtual and block size
			// (its disk usage differs: it appends a fixed disk's blocks).
			qimg := filepath.Join(dir, "q.vhdx")
			qargs := []string{"convert", "-O", "vhdx"}
			if c.opts != "" {
				qargs = append(qargs, "-o", c.opts)
			}
			harness.Run(t, "qemu-img", append(qargs, from, qimg)...)
			got, want := vhdxInfo(t, img), vhdxInfo(t, qimg)
			delete(got, "actual-size")
			delete(want, "actual-size")
			if !reflect.DeepEqual(got, want) {
				t.Errorf("%v %s: info\n got %v\nwant %v", args, from, got, want)
			}
		}
	}
	img := filepath.Join(dir, "c.vhdx")
	before := harness.ReadAll(t, img)
	if code, out := harness.RunBlockexport(t, "convert", "-n", "-O", "vhdx", qsrc, img); code == 0 {
		t.Errorf("convert -n into a VHDX wrote it:\n%s", out)
	}
	if !reflect.DeepEqual(harness.ReadAll(t, img), before) {
		t.Error("a refused convert -n changed the image")
	}
}
