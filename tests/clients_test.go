package tests

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestLoopMountMkfsFsck is the main use: losetup the exported file, make an
// ext4 file system, fill it, unmount, check it, and find the files again
// through a second export.
func TestLoopMountMkfsFsck(t *testing.T) {
	dir := t.TempDir()
	img := sparseImage(t, dir, "fs.img", 128<<20)
	mnt := filepath.Join(dir, "export")
	d := startExport(t, img, mnt, "-f", "raw", "-w")
	content := map[string][]byte{}
	for i, size := range []int{0, 1, 4095, 4096, 100000, 3 << 20} {
		data := make([]byte, size)
		for j := range data {
			data[j] = byte(j*7 + i)
		}
		content[filepath.Join("sub", string(rune('a'+i))+".bin")] = data
	}
	mkfsAndFill(t, mnt, filepath.Join(dir, "fs"), content)
	d.stopClean()

	run(t, "e2fsck", "-fn", img)

	// A second, read-only export shows the same files.
	mnt2 := filepath.Join(dir, "export2")
	startExport(t, img, mnt2, "-f", "raw")
	checkTree(t, mnt2, filepath.Join(dir, "fs"), content)
}

// mkfsAndFill loop-mounts file (an export), makes an ext4 file system on
// it, writes files (names relative to its root), then unmounts it and
// detaches the loop device.
func mkfsAndFill(t *testing.T, file, fsdir string, files map[string][]byte) {
	t.Helper()
	loop := strings.TrimSpace(run(t, "losetup", "--find", "--show", file))
	attached := true
	t.Cleanup(func() {
		if attached {
			exec.Command("losetup", "-d", loop).Run()
		}
	})
	run(t, "mkfs.ext4", "-q", "-F", loop)
	os.MkdirAll(fsdir, 0o755)
	run(t, "mount", loop, fsdir)
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
	run(t, "umount", fsdir)
	mounted = false
	run(t, "losetup", "-d", loop)
	attached = false
}

// checkTree loop-mounts file read-only and checks that it holds files.
func checkTree(t *testing.T, file, fsdir string, files map[string][]byte) {
	t.Helper()
	loop := strings.TrimSpace(run(t, "losetup", "--find", "--show", "--read-only", file))
	t.Cleanup(func() { exec.Command("losetup", "-d", loop).Run() })
	os.MkdirAll(fsdir, 0o755)
	run(t, "mount", "-o", "ro", loop, fsdir)
	t.Cleanup(func() { exec.Command("umount", fsdir).Run() })
	for name, want := range files {
		got, err := os.ReadFile(filepath.Join(fsdir, name))
		if err != nil {
			t.Fatal(err)
		}
		mustEqualBytes(t, name, got, want)
	}
}

// fioVerifyThroughExport writes ioSize of random 4 KiB blocks at queue
// depth 16 through an export of a new 64 MiB raw image, each checked with
// crc32c as fio reads it back; then the export stops cleanly and the same
// job verifies the image file itself.
func fioVerifyThroughExport(t *testing.T, ioSize string, seed int, exportArgs ...string) {
	t.Helper()
	dir := t.TempDir()
	img := sparseImage(t, dir, "fio.img", 64<<20)
	mnt := filepath.Join(dir, "mnt")
	d := startExport(t, img, mnt, append([]string{"-f", "raw", "-w"}, exportArgs...)...)
	job := []string{"--name=verify", "--rw=randwrite", "--bs=4k", "--size=64M", "--io_size=" + ioSize,
		"--ioengine=libaio", "--iodepth=16", "--direct=1", "--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0",
		fmt.Sprintf("--randseed=%d", seed), "--minimal"}
	run(t, "fio", append(job, "--filename="+mnt)...)
	d.stopClean()
	run(t, "fio", append(job, "--filename="+img, "--verify_only")...)
}

// fuseFds counts the /dev/fuse descriptors (queues) a process holds.
func fuseFds(t *testing.T, pid int) int {
	t.Helper()
	return fdsTo(t, pid, "/dev/fuse")
}

// fdsTo counts a process's descriptors whose link reads target.
func fdsTo(t *testing.T, pid int, target string) int {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if link, _ := os.Readlink(filepath.Join(dir, e.Name())); link == target {
			n++
		}
	}
	return n
}

// Large buffered writes call in a second queue (the bulk helper), which
// parks between bursts and comes back for the next: every block of each
// burst verifies, small requests in between are answered, the export stops
// cleanly with the helper parked, and the image holds the last burst. On
// qcow2 the first burst allocates (handed off), the second writes in place
// (inline on both queues).
func TestBulkWritesSecondQueue(t *testing.T) {
	for _, format := range []string{"raw", "qcow2"} {
		t.Run(format, func(t *testing.T) {
			dir := t.TempDir()
			img := filepath.Join(dir, "bulk."+format)
			createImage(t, "-f", format, img, "64M")
			mnt := filepath.Join(dir, "mnt")
			d := startExport(t, img, mnt, "-f", format, "-w")
			if n := fuseFds(t, d.cmd.Process.Pid); n != 1 {
				t.Fatalf("%d /dev/fuse fds before any large write, want 1", n)
			}
			bulk := func(seed int) []string {
				return []string{"--name=bulk", "--rw=write", "--bs=1M", "--size=64M", "--ioengine=libaio", "--iodepth=16",
					"--direct=1", "--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0",
					fmt.Sprintf("--randseed=%d", seed), "--minimal"}
			}
			run(t, "fio", append(bulk(1), "--filename="+mnt)...)
			if n := fuseFds(t, d.cmd.Process.Pid); n != 2 {
				t.Fatalf("%d /dev/fuse fds after 1 MiB writes, want 2 (the bulk helper)", n)
			}
			time.Sleep(100 * time.Millisecond) // past bulkIdle: the next request parks it
			run(t, "fio", "--name=small", "--filename="+mnt, "--rw=randrw", "--bs=4k", "--size=64M", "--io_size=8M",
				"--ioengine=libaio", "--iodepth=16", "--direct=1", "--minimal")
			run(t, "fio", append(bulk(2), "--filename="+mnt)...) // the helper resumes
			d.stopClean()
			plain := img
			if format == "qcow2" {
				run(t, "qemu-img", "check", img)
				plain = filepath.Join(dir, "plain.raw")
				run(t, "qemu-img", "convert", "-f", "qcow2", "-O", "raw", img, plain)
			}
			run(t, "fio", append(bulk(2), "--filename="+plain, "--verify_only")...)
		})
	}
}

// TestFioVerify: both aio engines, both cache modes.
func TestFioVerify(t *testing.T) {
	for _, engine := range []string{"io_uring", "threads"} {
		for _, cache := range []string{"writeback", "none"} {
			t.Run(engine+"/"+cache, func(t *testing.T) {
				fioVerifyThroughExport(t, "32M", 42, "--aio", engine, "--cache", cache)
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
				dir := t.TempDir()
				img := filepath.Join(dir, "img")
				createImage(t, "-f", format, img, "32M")
				mnt := filepath.Join(dir, "mnt")
				d := startExport(t, img, mnt, "-f", format, "-w", "--cache", cache)
				run(t, "fio", "--name=qd1", "--filename="+mnt, "--rw=randrw", "--bs=4k", "--size=32M",
					"--io_size=8M", "--ioengine=pvsync2", "--direct=1", "--verify=crc32c", "--verify_fatal=1",
					"--verify_state_save=0", "--randseed=3", "--minimal")
				d.stopClean()
				if format == "qcow2" {
					qemuImgCheck(t, img)
				}
			})
		}
	}
}

// TestDirectAlignedWritesDoNotRead: with --cache none, 4 KiB aligned
// O_DIRECT writes through the export reach the host file without reading
// it first (the daemon's read_bytes in /proc/PID/io, which counts what it
// reads from the device), and land intact. Measured before the fix: as
// many bytes read as written, every write a read-modify-write.
func TestDirectAlignedWritesDoNotRead(t *testing.T) {
	dir := t.TempDir()
	// Allocated and written: reading a hole would cost no device read
	// and hide a read-modify-write.
	img := randomImage(t, dir, 64<<20, 5)
	run(t, "sync")
	mnt := filepath.Join(dir, "mnt")
	d := startExport(t, img, mnt, "-f", "raw", "-w", "--cache", "none")
	before := readBytes(t, d.cmd.Process.Pid)
	const ioSize = 16 << 20
	job := []string{"--name=w", "--rw=randwrite", "--bs=4k", "--size=64M", fmt.Sprintf("--io_size=%d", ioSize),
		"--ioengine=libaio", "--iodepth=16", "--direct=1", "--verify=crc32c", "--verify_fatal=1",
		"--verify_state_save=0", "--randseed=5", "--minimal"}
	run(t, "fio", append(job, "--filename="+mnt, "--do_verify=0")...)
	read := readBytes(t, d.cmd.Process.Pid) - before
	if read > ioSize/10 {
		t.Errorf("the daemon read %d bytes from the image while %d were written in aligned 4 KiB blocks", read, ioSize)
	}
	d.stopClean()
	run(t, "fio", append(job, "--filename="+img, "--verify_only")...)
}

// readBytes is read_bytes of /proc/PID/io: what the process (all its
// threads) made the block layer read.
func readBytes(t *testing.T, pid int) int64 {
	t.Helper()
	return procField(t, pid, "io", "read_bytes:")
}

// TestQemuImgConvertIntoTheExport is the reproducer of QEMU's 2025 data
// corruption bug: convert into the export with O_DIRECT, then compare; into
// a raw image and into a new qcow2 image (every write allocating).
func TestQemuImgConvertIntoTheExport(t *testing.T) {
	for _, format := range []string{"raw", "qcow2"} {
		t.Run(format, func(t *testing.T) {
			dir := t.TempDir()
			src := randomImage(t, dir, 32<<20, 9)
			dst := filepath.Join(dir, "dst."+format)
			createImage(t, "-f", format, dst, "32M")
			mnt := filepath.Join(dir, "mnt")
			d := startExport(t, dst, mnt, "-f", format, "-w")
			run(t, "qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", "-t", "none", src, mnt)
			run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", src, mnt)
			d.stopClean()
			if format == "qcow2" {
				qemuImgCheck(t, dst)
			}
			run(t, "qemu-img", "compare", "-f", "raw", "-F", format, src, dst)
		})
	}
}

// TestQueuesAndBusyPolling: two cloned /dev/fuse queues served by busy
// polling loops keep data intact under fio's verify, and the export stops
// cleanly (the poll loops must notice the unmount).
func TestQueuesAndBusyPolling(t *testing.T) {
	fioVerifyThroughExport(t, "16M", 7, "--queues", "2", "--poll-us", "50")
}
