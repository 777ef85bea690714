package fuse

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestLoopMountMkfsFsck is the main use: losetup the exported file, make an
// ext4 file system, fill it, unmount, check it, and find the files again
// through a second export.
func TestLoopMountMkfsFsck(t *testing.T) {
	dir := t.TempDir()
	img := harness.SparseImage(t, dir, "fs.img", 128<<20)
	mnt := filepath.Join(dir, "export")
	d := harness.StartExport(t, img, mnt, "-f", "raw", "-w")
	content := map[string][]byte{}
	for i, size := range []int{0, 1, 4095, 4096, 100000, 3 << 20} {
		data := make([]byte, size)
		for j := range data {
			data[j] = byte(j*7 + i)
		}
		content[filepath.Join("sub", string(rune('a'+i))+".bin")] = data
	}
	mkfsAndFill(t, mnt, filepath.Join(dir, "fs"), content)
	d.StopClean()

	harness.Run(t, "e2fsck", "-fn", img)

	// A second, read-only export shows the same files.
	mnt2 := filepath.Join(dir, "export2")
	harness.StartExport(t, img, mnt2, "-f", "raw")
	checkTree(t, mnt2, filepath.Join(dir, "fs"), content)
}

// mkfsAndFill loop-mounts file (an export), makes an ext4 file system on
// it, writes files (names relative to its root), then unmounts it and
// detaches the loop device.
func mkfsAndFill(t *testing.T, file, fsdir string, files map[string][]byte) {
	t.Helper()
	loop := strings.TrimSpace(harness.Run(t, "losetup", "--find", "--show", file))
	attached := true
	t.Cleanup(func() {
		if attached {
			exec.Command("losetup", "-d", loop).Run()
		}
	})
	harness.Run(t, "mkfs.ext4", "-q", "-F", loop)
	os.MkdirAll(fsdir, 0o755)
	harness.Run(t, "mount", loop, fsdir)
	mounted := true
	t.Cleanup(func() {
		if mounted {
			exec.Command("umount", fsdir).Run()
		}
	})
	for name, data := range files {
		os.MkdirAll(filepath.Join(fsdir, filepath.Dir(name)), 0o755)
		if err := os.WriteFile(filepath.Join(fsdir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	harness.Run(t, "umount", fsdir)
	mounted = false
	harness.Run(t, "losetup", "-d", loop)
	attached = false
}

// checkTree loop-mounts file read-only and checks that it holds files.
func checkTree(t *testing.T, file, fsdir string, files map[string][]byte) {
	t.Helper()
	loop := strings.TrimSpace(harness.Run(t, "losetup", "--find", "--show", "--read-only", file))
	t.Cleanup(func() { exec.Command("losetup", "-d", loop).Run() })
	os.MkdirAll(fsdir, 0o755)
	harness.Run(t, "mount", "-o", "ro", loop, fsdir)
	t.Cleanup(func() { exec.Command("umount", fsdir).Run() })
	for name, want := range files {
		got, err := os.ReadFile(filepath.Join(fsdir, name))
		if err != nil {
			t.Fatal(err)
		}
		harness.MustEqualBytes(t, name, got, want)
	}
}

// TestFioVerify: both aio engines, both cache modes.
func TestFioVerify(t *testing.T) {
	for _, engine := range []string{"io_uring", "threads"} {
		for _, cache := range []string{"writeback", "none"} {
			t.Run(engine+"/"+cache, func(t *testing.T) {
				t.Parallel() // each run has its own image and export
				harness.FioVerifyThroughExport(t, "32M", 42, "--aio", engine, "--cache", cache)
			})
		}
	}
}

// TestFioVerifyQueueDepthOne: at queue depth one the serve loop runs each
// request that must wait itself, with blocking system calls (the lone
// path); fio writes and verifies through it with both cache modes,
// qcow2 included.
func TestFioVerifyQueueDepthOne(t *testing.T) {
	for _, format := range []string{"raw", "qcow2"} {
		for _, cache := range []string{"writeback", "none"} {
			t.Run(format+"/"+cache, func(t *testing.T) {
				// Each run has its own image and export (and so its own
				// serve loop, at queue depth one whatever runs beside it).
				t.Parallel()
				dir := t.TempDir()
				img := filepath.Join(dir, "img")
				harness.CreateImage(t, "-f", format, img, "32M")
				mnt := filepath.Join(dir, "mnt")
				d := harness.StartExport(t, img, mnt, "-f", format, "-w", "--cache", cache)
				harness.Run(t, "fio", "--name=qd1", "--filename="+mnt, "--rw=randrw", "--bs=4k", "--size=32M",
					"--io_size=8M", "--ioengine=pvsync2", "--direct=1", "--verify=crc32c", "--verify_fatal=1",
					"--verify_state_save=0", "--randseed=3", "--minimal")
				d.StopClean()
				if format == "qcow2" {
					harness.QemuImgCheck(t, img)
				}
			})
		}
	}
}
