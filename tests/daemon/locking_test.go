package daemon

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestImageLocksAgainstQemu: an export takes QEMU's image locks, so that
// QEMU and blockexport never write one qcow2 image at once. While our
// writable export runs, qemu-img info (without -U) and a writable
// qemu-storage-daemon are refused, and a second export of ours too; while
// QEMU's writable export runs, ours is refused with one clear line.
// blockexport info does not lock (like qemu-img -U). The image is intact
// throughout.
func TestImageLocksAgainstQemu(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "img.qcow2")
	harness.CreateImage(t, "-f", "qcow2", img, "16M")
	harness.Run(t, "qemu-io", "-c", "write -P 0x5a 0 1M", img)
	qmnt := filepath.Join(dir, "qmnt")
	if err := os.WriteFile(qmnt, nil, 0o600); err != nil { // QEMU wants it to exist
		t.Fatal(err)
	}

	t.Run("ours holds it", func(t *testing.T) {
		d := harness.StartExport(t, img, filepath.Join(dir, "mnt"), "-f", "qcow2", "-w")
		out, err := exec.Command("qemu-img", "info", img).CombinedOutput()
		if err == nil || !strings.Contains(string(out), "Failed to get shared \"write\" lock") {
			t.Errorf("qemu-img info of an image we export writable: %v\n%s", err, out)
		}
		code, qout := harness.TryRun(t, qmnt, "qemu-storage-daemon", "--blockdev", "file,node-name=f,filename="+img,
			"--blockdev", "qcow2,node-name=q,file=f",
			"--export", "fuse,id=e,node-name=q,mountpoint="+qmnt+",writable=on")
		if code <= 0 || !strings.Contains(qout, "Failed to get") {
			t.Errorf("a writable qemu-storage-daemon beside our export: exit %d\n%s", code, qout)
		}
		code, out2 := harness.TryExport(t, filepath.Join(dir, "mnt2"), "-f", "qcow2", img)
		if code != 1 || !strings.Contains(out2, "image is in use") || strings.Count(out2, "\n") != 1 {
			t.Errorf("a second export of ours: exit %d, %q; want 1 and one line saying the image is in use", code, out2)
		}
		if code, out := harness.RunBlockexport(t, "info", img); code != 0 {
			t.Errorf("blockexport info must not need the locks: exit %d\n%s", code, out)
		}
		d.StopClean()
	})

	t.Run("QEMU holds it", func(t *testing.T) {
		harness.StartDaemon(t, qmnt, "qemu-storage-daemon", "--blockdev", "file,node-name=f,filename="+img,
			"--blockdev", "qcow2,node-name=q,file=f",
			"--export", "fuse,id=e,node-name=q,mountpoint="+qmnt+",writable=on")
		for _, args := range [][]string{{"-f", "qcow2", "-w"}, {"-f", "qcow2"}} {
			code, out := harness.TryExport(t, filepath.Join(dir, "mnt3"), append(args, img)...)
			if code != 1 || !strings.Contains(out, "image is in use") || strings.Count(out, "\n") != 1 {
				t.Errorf("export %v while QEMU writes the image: exit %d, %q; want 1 and one line", args, code, out)
			}
		}
	})
	harness.QemuImgCheck(t, img)
	harness.Run(t, "qemu-io", "-c", "read -P 0x5a 0 1M", img)
}
