package formats

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

func TestQcow2ExportMatchesQemu(t *testing.T) {
	dir := t.TempDir()
	top := harness.QcowChain(t, dir)
	mnt := filepath.Join(dir, "mnt")
	harness.StartExport(t, top, mnt) // format probed
	st, err := os.Stat(mnt)
	if err != nil || st.Size() != 8<<20 {
		t.Fatalf("stat: %v", err)
	}
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "qcow2", mnt, top)
	// The same with O_DIRECT on the chain's files (compressed clusters and
	// byte-granular metadata go through aligned bounce buffers).
	mntDirect := filepath.Join(dir, "mnt-direct")
	harness.StartExport(t, top, mntDirect, "--cache", "none")
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "qcow2", mntDirect, top)

	// SEEK_DATA/SEEK_HOLE agree with qemu-img map's data flag.
	var entries []struct {
		Start, Length int64
		Data          bool
	}
	if err := json.Unmarshal([]byte(harness.Run(t, "qemu-img", "map", "--output=json", top)), &entries); err != nil {
		t.Fatal(err)
	}
	fd, err := unix.Open(mnt, unix.O_RDONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	checked := 0
	for i, e := range entries {
		whence := unix.SEEK_HOLE
		if e.Data {
			whence = unix.SEEK_DATA
		}
		// From inside an entry, seeking for its own kind stays put.
		if got, err := unix.Seek(fd, e.Start, whence); err != nil || got != e.Start {
			t.Errorf("entry %d %+v: lseek(%d, data=%v) = %d, %v", i, e, e.Start, e.Data, got, err)
		}
		// Seeking for the other kind jumps to the next entry that differs.
		want := int64(8 << 20)
		for _, f := range entries[i+1:] {
			if f.Data != e.Data {
				want = f.Start
				break
			}
		}
		other := unix.SEEK_DATA
		if e.Data {
			other = unix.SEEK_HOLE
		}
		got, err := unix.Seek(fd, e.Start, other)
		if want == 8<<20 && other == unix.SEEK_DATA {
			if err != unix.ENXIO {
				t.Errorf("entry %d: SEEK_DATA with no data after: %d, %v; want ENXIO", i, got, err)
			}
		} else if err != nil || got != want {
			t.Errorf("entry %d %+v: lseek for the other kind = %d, %v; want %d", i, e, got, err, want)
		}
		checked++
	}
	if checked < 4 {
		t.Fatalf("only %d map entries: the test image is not mixed enough", checked)
	}
}

// TestQcow2LoopMountReadOnly: an ext4 file system in a qcow2 image, exported
// read-only and loop-mounted, shows its files.
func TestQcow2LoopMountReadOnly(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "tree")
	os.MkdirAll(filepath.Join(src, "a", "b"), 0o755)
	files := map[string]string{"hello.txt": "hello, qcow2\n", "a/b/deep.txt": strings.Repeat("deep ", 5000)}
	for name, content := range files {
		os.WriteFile(filepath.Join(src, name), []byte(content), 0o644)
	}
	rawfs := filepath.Join(dir, "fs.raw")
	harness.Run(t, "mkfs.ext4", "-q", "-d", src, rawfs, "32M")
	img := filepath.Join(dir, "fs.qcow2")
	harness.Run(t, "qemu-img", "convert", "-c", "-f", "raw", "-O", "qcow2", rawfs, img)
	mnt := filepath.Join(dir, "export")
	harness.StartExport(t, img, mnt, "--format", "qcow2")

	loop := strings.TrimSpace(harness.Run(t, "losetup", "--find", "--show", "--read-only", mnt))
	t.Cleanup(func() { exec.Command("losetup", "-d", loop).Run() })
	fsdir := filepath.Join(dir, "fs")
	os.Mkdir(fsdir, 0o755)
	harness.Run(t, "mount", "-o", "ro", loop, fsdir)
	t.Cleanup(func() { exec.Command("umount", fsdir).Run() })
	for name, want := range files {
		got, err := os.ReadFile(filepath.Join(fsdir, name))
		if err != nil || string(got) != want {
			t.Fatalf("%s through the qcow2 export: %v", name, err)
		}
	}
}
