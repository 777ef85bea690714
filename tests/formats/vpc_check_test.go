package formats

import (
	"errors"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestVpcCheckHasNoChecksAsInQemu: `check` on a dynamic or fixed VHD
// exits 63 like qemu-img check (QEMU's vpc driver has no checks), with
// and without -r. (VDI check: TestVdiCheckAsQemuImg.)
func TestVpcCheckHasNoChecksAsInQemu(t *testing.T) {
	dir := t.TempDir()
	src := harness.RandomImage(t, dir, 4<<20, 30)
	for _, c := range []struct {
		name, opts string
		fmtArgs    []string
	}{
		{"dynamic", "subformat=dynamic", nil},
		{"fixed", "subformat=fixed", []string{"-f", "vpc"}},
	} {
		img := filepath.Join(dir, c.name+".vhd")
		harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vpc", "-o", c.opts, src, img)
		for _, r := range [][]string{nil, {"-r", "all"}} {
			args := append(append(append([]string{"check"}, r...), c.fmtArgs...), img)
			qcode := 0
			if err := exec.Command("qemu-img", args...).Run(); err != nil {
				var ee *exec.ExitError
				if !errors.As(err, &ee) {
					t.Fatal(err)
				}
				qcode = ee.ExitCode()
			}
			code, out := harness.RunBlockexport(t, args...)
			if code != qcode || qcode != 63 {
				t.Errorf("%s %v: exit %d, qemu-img's %d (want 63)\n%s", c.name, r, code, qcode, out)
			}
		}
	}
}
