package nbd

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// imageWithTwoSnapshots is a qcow2 image with snapshots s1 (ID 1) and s2
// (ID 2) and writes after each, over the same clusters.
func imageWithTwoSnapshots(t *testing.T, dir string) string {
	t.Helper()
	img := filepath.Join(dir, "snap.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", img, "16M")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 1 0 4M", "-c", "write -P 9 12M 64k", img)
	harness.Run(t, "qemu-img", "snapshot", "-c", "s1", img)
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 2 1M 4M", "-c", "write -z 12M 64k", img)
	harness.Run(t, "qemu-img", "snapshot", "-c", "s2", img)
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 3 3M 1M", "-c", "discard 0 64k", img)
	return img
}

// convertSnapshot is qemu-img convert -l SPEC's raw output.
func convertSnapshot(t *testing.T, img, spec string) []byte {
	t.Helper()
	out := filepath.Join(t.TempDir(), "snap.raw")
	harness.Run(t, "qemu-img", "convert", "-U", "-O", "raw", "-l", spec, img, out)
	return harness.ReadAll(t, out)
}

func TestSnapshotServedOverNbdEqualsQemuImgConvert(t *testing.T) {
	img := imageWithTwoSnapshots(t, t.TempDir())
	current := convertSnapshot(t, img, "snapshot.id=2")
	for _, spec := range []string{"s1", "2", "snapshot.name=s1", "snapshot.id=2", "snapshot.id=1,snapshot.name=s1"} {
		want := convertSnapshot(t, img, spec)
		srv := harness.StartNBD(t, img, false, "--snapshot", spec)
		if list := harness.Run(t, "nbdinfo", "--list", srv.URI); !strings.Contains(list, "is_read_only: true") {
			t.Errorf("--snapshot %s: export is not read-only:\n%s", spec, list)
		}
		out := filepath.Join(t.TempDir(), "got.raw")
		harness.Run(t, "nbdcopy", srv.URI, out)
		harness.MustEqualBytes(t, "--snapshot "+spec, harness.ReadAll(t, out), want)
		srv.StopClean()
	}
	if s1 := convertSnapshot(t, img, "s1"); string(s1) == string(current) {
		t.Fatal("the snapshots read alike: the test would prove nothing")
	}
}

func TestSnapshotServedOverFuseEqualsQemuImgConvert(t *testing.T) {
	dir := t.TempDir()
	img := imageWithTwoSnapshots(t, dir)
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, img, mnt, "-l", "s1")
	harness.MustEqualBytes(t, "fuse --snapshot s1", harness.ReadAll(t, mnt), convertSnapshot(t, img, "s1"))
	if f, err := os.OpenFile(mnt, os.O_WRONLY, 0); err == nil {
		f.Close()
		t.Error("the snapshot export opened for writing")
	}
	d.StopClean()
}

func TestSnapshotRefusedAsQemuNbdRefusesIt(t *testing.T) {
	dir := t.TempDir()
	img := imageWithTwoSnapshots(t, dir)
	sock := "unix:" + filepath.Join(dir, "s")
	for _, c := range []struct {
		args []string
		code int
		msg  string
	}{
		{[]string{"-l", "nope"}, 1, "Failed to load snapshot: Can't find snapshot"},
		{[]string{"-l", "snapshot.id=1,snapshot.name=s2"}, 1, "Failed to load snapshot: Can't find snapshot"},
		{[]string{"-w", "--snapshot", "s1"}, 2, "read-only"},
		{[]string{"-l", "snapshot.size=1"}, 2, "snapshot.name=NAME"},
	} {
		code, out := harness.RunBlockexport(t, append(append([]string{"nbd", "--listen", sock}, c.args...), img)...)
		if code != c.code || !strings.Contains(out, c.msg) || strings.Count(strings.TrimSpace(out), "\n") != 0 {
			t.Errorf("%v: exit %d, %q; want exit %d and one line with %q", c.args, code, out, c.code, c.msg)
		}
	}
}
