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
