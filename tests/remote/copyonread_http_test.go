package remote

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestCopyOnReadAndStreamOverHTTPSBackingFile: a qcow2 overlay whose backing file is on nginx
// (https, the test's CA). Copy-on-read: everything read once through the
// export reads again, the same, once the object on the server is replaced
// by another (zeroes). Stream: a second overlay over plain http streams to
// completion and then has no backing file, checks clean and reads the
// same with the object replaced.
func TestCopyOnReadAndStreamOverHTTPSBackingFile(t *testing.T) {
	n := harness.StartNginx(t)
	dir := t.TempDir()
	base := backingBase(t, dir, 16<<20, 9)
	want := harness.ReadAll(t, base)
	n.Put(t, "base.img", base)

	cor := filepath.Join(dir, "cor.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", n.URL("https", "base.img"), "-F", "raw", cor, "16M")
	streamed := filepath.Join(dir, "streamed.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", n.URL("http", "base.img"), "-F", "raw", streamed, "16M")

	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, cor, mnt, "-w", "--copy-on-read", "--tls-ca", n.CA, "--kernel-cache", "off")
	harness.MustEqualBytes(t, "the overlay over https, first read", harness.ReadAll(t, mnt), want)
	d.StopClean()

	streamToEnd(t, streamed)

	if err := os.Remove(filepath.Join(n.Root, "base.img")); err != nil {
		t.Fatal(err)
	}
	// The backing file still opens (its name stays in the header), but
	// holds other bytes now: every read must come from the overlay.
	n.Put(t, "base.img", harness.SparseImage(t, dir, "other.raw", 16<<20))
	d = harness.StartExport(t, cor, mnt, "-w", "--copy-on-read", "--tls-ca", n.CA, "--kernel-cache", "off")
	harness.MustEqualBytes(t, "the overlay over https once the object is replaced", harness.ReadAll(t, mnt), want)
	d.StopClean()

	mustBeStandalone(t, streamed, base, "")
}
