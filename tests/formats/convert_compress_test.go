package formats

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/formats/registry"
	"github.com/blockexport/blockexport/tests/internal/harness"
)

// qemuImgStatus runs qemu-img with args and returns its exit status and
// output, failing the test only when it cannot be run at all.
func qemuImgStatus(t *testing.T, args ...string) (int, string) {
	t.Helper()
	out, err := exec.Command("qemu-img", args...).CombinedOutput()
	if _, ok := err.(*exec.ExitError); err != nil && !ok {
		t.Fatalf("qemu-img %v: %v (apt-get install qemu-utils)", args, err)
	}
	if err != nil {
		return err.(*exec.ExitError).ExitCode(), string(out)
	}
	return 0, string(out)
}

// TestConvertCompressedToAFormatThatCannotCompressFailsAsQemuImg:
// `convert -c -O FMT` for every format the registry creates but cannot
// compress exits as qemu-img 7.2 does (1, "Compression not supported for
// this file format", no TARGET made), new TARGET or -n; the formats that
// compress still convert.
func TestConvertCompressedToAFormatThatCannotCompressFailsAsQemuImg(t *testing.T) {
	dir := t.TempDir()
	src := harness.SparseImage(t, dir, "src.raw", 1<<20)
	refused := 0
	for _, format := range registry.CreatableFormats() {
		t.Run(format, func(t *testing.T) {
			ours, theirs := filepath.Join(dir, "ours."+format), filepath.Join(dir, "theirs."+format)
			code, out := harness.RunBlockexport(t, "convert", "-c", "-O", format, src, ours)
			qcode, qout := qemuImgStatus(t, "convert", "-c", "-O", format, src, theirs)
			if registry.Compresses(format) {
				if code != 0 || qcode != 0 {
					t.Fatalf("-c -O %s: ours exit %d (%s), qemu-img exit %d (%s): want both 0", format, code, out, qcode, qout)
				}
				return
			}
			refused++
			const msg = "Compression not supported for this file format"
			if code != qcode || qcode != 1 {
				t.Errorf("-c -O %s: exit %d, qemu-img exits %d", format, code, qcode)
			}
			if want := strings.Replace(strings.TrimSpace(qout), "qemu-img: ", "blockexport: ", 1); strings.TrimSpace(out) != want || !strings.Contains(want, msg) {
				t.Errorf("-c -O %s says %q, qemu-img says %q", format, out, qout)
			}
			for _, p := range []string{ours, theirs} {
				if _, err := os.Stat(p); !os.IsNotExist(err) {
					t.Errorf("%s exists after the refusal (stat: %v)", p, err)
				}
			}
			if !slices.Contains(registry.WritableFormats(), format) {
				return
			}
			// -n into an existing TARGET: the same refusal.
			existing := filepath.Join(dir, "existing."+format)
			harness.Run(t, "qemu-img", "create", "-q", "-f", format, existing, "1M")
			code, out = harness.RunBlockexport(t, "convert", "-n", "-c", "-O", format, src, existing)
			qcode, qout = qemuImgStatus(t, "convert", "-n", "-c", "-O", format, src, existing)
			if code != qcode || !strings.Contains(out, msg) || !strings.Contains(qout, msg) {
				t.Errorf("-n -c -O %s: exit %d %q; qemu-img: exit %d %q", format, code, out, qcode, qout)
			}
		})
	}
	if refused == 0 {
		t.Fatalf("no creatable format refuses -c (formats %v): nothing was compared", registry.CreatableFormats())
	}
}

// TestBackingFileForAFormatWithoutOneFailsAsQemuImg: `create -b` and
// `convert -B` for every format the registry creates without a backing
// file exit as qemu-img 7.2 does (1, "Backing file not supported for file
// format 'FMT'"), and neither makes the file.
func TestBackingFileForAFormatWithoutOneFailsAsQemuImg(t *testing.T) {
	dir := t.TempDir()
	base := harness.SparseImage(t, dir, "base.raw", 1<<20)
	refused := 0
	for _, format := range registry.CreatableFormats() {
		if registry.CreatesBacking(format) {
			continue
		}
		refused++
		t.Run(format, func(t *testing.T) {
			msg := "Backing file not supported for file format '" + format + "'"
			for _, verb := range []struct {
				name        string
				ours, qemus []string
			}{
				{"create", []string{"create", "-f", format, "-b", base, "-F", "raw"}, []string{"create", "-f", format, "-b", base, "-F", "raw"}},
				{"convert", []string{"convert", "-O", format, "-B", base}, []string{"convert", "-O", format, "-B", base}},
			} {
				ours, theirs := filepath.Join(dir, verb.name+"-ours."+format), filepath.Join(dir, verb.name+"-theirs."+format)
				oursArgs, qemuArgs := append(slices.Clone(verb.ours), ours), append(slices.Clone(verb.qemus), theirs)
				if verb.name == "create" {
					oursArgs, qemuArgs = append(oursArgs, "1M"), append(qemuArgs, "1M")
				} else {
					oursArgs = append(slices.Clone(verb.ours), base, ours)
					qemuArgs = append(slices.Clone(verb.qemus), base, theirs)
				}
				code, out := harness.RunBlockexport(t, oursArgs...)
				qcode, qout := qemuImgStatus(t, qemuArgs...)
				if qcode != 1 || code != qcode {
					t.Errorf("%s: exit %d (%s), qemu-img exits %d (%s)", verb.name, code, out, qcode, qout)
				}
				if !strings.Contains(out, msg) || !strings.Contains(qout, msg) {
					t.Errorf("%s says %q, qemu-img says %q; want both to say %q", verb.name, out, qout, msg)
				}
				for _, p := range []string{ours, theirs} {
					if _, err := os.Stat(p); !os.IsNotExist(err) {
						t.Errorf("%s: %s exists after the refusal (stat: %v)", verb.name, p, err)
					}
				}
			}
		})
	}
	if refused == 0 {
		t.Fatalf("every creatable format records a backing file (%v): nothing was compared", registry.CreatableFormats())
	}
}
