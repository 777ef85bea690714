package remote

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestOverlayAdviceBuildsAnOverlayOfTheBase: `fuse -w` on an image that
// is read here and not written (a streamOptimized vmdk holding grains, a
// qcow2 over HTTP) is refused with one line, exit 1 for both, that names
// the command making a qcow2 overlay on it; that command, run as given, makes an overlay that reads
// the base's disk bytes (not its container: the backing format is the
// probed one, never raw by default).
func TestOverlayAdviceBuildsAnOverlayOfTheBase(t *testing.T) {
	dir := t.TempDir()
	src := harness.RandomImage(t, dir, 8<<20, 4501)
	vmdk := filepath.Join(dir, "base.vmdk")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vmdk", "-o", "subformat=streamOptimized", src, vmdk)
	qc := filepath.Join(dir, "base.qcow2")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "qcow2", src, qc)
	n := harness.StartNginx(t)
	n.Put(t, "base.qcow2", qc)
	for _, c := range []struct{ name, image, format string }{
		{"local vmdk", vmdk, "vmdk"},
		{"qcow2 over http", n.URL("http", "base.qcow2"), "qcow2"},
	} {
		t.Run(c.name, func(t *testing.T) {
			work := t.TempDir()
			code, out := harness.TryExport(t, filepath.Join(work, "mnt"), "-w", c.image)
			i := strings.Index(out, "blockexport create ")
			if code != 1 || i < 0 || strings.Count(strings.TrimSpace(out), "\n") != 0 {
				t.Fatalf("fuse -w: exit %d, want 1 and one line naming blockexport create:\n%s", code, out)
			}
			args := strings.Fields(out[i:])[1:]
			want := []string{"create", "-f", "qcow2", "-b", c.image, "-F", c.format, "overlay.qcow2"}
			if strings.Join(args, " ") != strings.Join(want, " ") {
				t.Fatalf("advice %q, want blockexport %s", out[i:], strings.Join(want, " "))
			}
			cmd := exec.Command(harness.Bin, args...)
			cmd.Dir = work
			if b, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("the advised command: %v\n%s", err, b)
			}
			ov := filepath.Join(work, "overlay.qcow2")
			if code, out := harness.RunBlockexport(t, "compare", "-f", "qcow2", "-F", "raw", ov, src); code != 0 {
				t.Fatalf("the overlay does not read as the base's disk: exit %d\n%s", code, out)
			}
			// And it takes the writes the base refused.
			mnt := filepath.Join(work, "ovmnt")
			d := harness.StartExport(t, ov, mnt, "-w")
			f, err := os.OpenFile(mnt, os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := f.WriteAt([]byte("written"), 4096); err != nil {
				t.Fatalf("write through the overlay: %v", err)
			}
			f.Close()
			d.StopClean()
			if code, out := harness.RunBlockexport(t, "compare", "-F", "raw", c.image, src); code != 0 {
				t.Fatalf("the base changed under the overlay's write: exit %d\n%s", code, out)
			}
			if code, _ := harness.RunBlockexport(t, "compare", "-f", "qcow2", "-F", "raw", ov, src); code != 1 {
				t.Fatalf("the overlay still reads as the base after a write through it: compare exit %d", code)
			}
		})
	}
}
