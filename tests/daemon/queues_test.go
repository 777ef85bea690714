package daemon

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

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
			harness.CreateImage(t, "-f", format, img, "64M")
			mnt := filepath.Join(dir, "mnt")
			d := harness.StartExport(t, img, mnt, "-f", format, "-w")
			if n := fuseFds(t, d.Cmd.Process.Pid); n != 1 {
				t.Fatalf("%d /dev/fuse fds before any large write, want 1", n)
			}
			bulk := func(seed int) []string {
				return []string{"--name=bulk", "--rw=write", "--bs=1M", "--size=64M", "--ioengine=libaio", "--iodepth=16",
					"--direct=1", "--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0",
					fmt.Sprintf("--randseed=%d", seed), "--minimal"}
			}
			harness.Run(t, "fio", append(bulk(1), "--filename="+mnt)...)
			if n := fuseFds(t, d.Cmd.Process.Pid); n != 2 {
				t.Fatalf("%d /dev/fuse fds after 1 MiB writes, want 2 (the bulk helper)", n)
			}
			time.Sleep(100 * time.Millisecond) // past bulkIdle: the next request parks it
			harness.Run(t, "fio", "--name=small", "--filename="+mnt, "--rw=randrw", "--bs=4k", "--size=64M", "--io_size=8M",
				"--ioengine=libaio", "--iodepth=16", "--direct=1", "--minimal")
			harness.Run(t, "fio", append(bulk(2), "--filename="+mnt)...) // the helper resumes
			d.StopClean()
			plain := img
			if format == "qcow2" {
				harness.Run(t, "qemu-img", "check", img)
				plain = filepath.Join(dir, "plain.raw")
				harness.Run(t, "qemu-img", "convert", "-f", "qcow2", "-O", "raw", img, plain)
			}
			harness.Run(t, "fio", append(bulk(2), "--filename="+plain, "--verify_only")...)
		})
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
	img := harness.RandomImage(t, dir, 64<<20, 5)
	harness.Run(t, "sync")
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, img, mnt, "-f", "raw", "-w", "--cache", "none")
	before := readBytes(t, d.Cmd.Process.Pid)
	const ioSize = 16 << 20
	job := []string{"--name=w", "--rw=randwrite", "--bs=4k", "--size=64M", fmt.Sprintf("--io_size=%d", ioSize),
		"--ioengine=libaio", "--iodepth=16", "--direct=1", "--verify=crc32c", "--verify_fatal=1",
		"--verify_state_save=0", "--randseed=5", "--minimal"}
	harness.Run(t, "fio", append(job, "--filename="+mnt, "--do_verify=0")...)
	read := readBytes(t, d.Cmd.Process.Pid) - before
	if read > ioSize/10 {
		t.Errorf("the daemon read %d bytes from the image while %d were written in aligned 4 KiB blocks", read, ioSize)
	}
	d.StopClean()
	harness.Run(t, "fio", append(job, "--filename="+img, "--verify_only")...)
}

// TestQemuImgConvertIntoTheExport is the reproducer of QEMU's 2025 data
// corruption bug: convert into the export with O_DIRECT, then compare; into
// a raw image and into a new qcow2 image (every write allocating).
func TestQemuImgConvertIntoTheExport(t *testing.T) {
	for _, format := range []string{"raw", "qcow2"} {
		t.Run(format, func(t *testing.T) {
			dir := t.TempDir()
			src := harness.RandomImage(t, dir, 32<<20, 9)
			dst := filepath.Join(dir, "dst."+format)
			harness.CreateImage(t, "-f", format, dst, "32M")
			mnt := filepath.Join(dir, "mnt")
			d := harness.StartExport(t, dst, mnt, "-f", format, "-w")
			harness.Run(t, "qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", "-t", "none", src, mnt)
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", src, mnt)
			d.StopClean()
			if format == "qcow2" {
				harness.QemuImgCheck(t, dst)
			}
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", format, src, dst)
		})
	}
}

// TestQueuesAndBusyPolling: two cloned /dev/fuse queues served by busy
// polling loops keep data intact under fio's verify, and the export stops
// cleanly (the poll loops must notice the unmount).
func TestQueuesAndBusyPolling(t *testing.T) {
	harness.FioVerifyThroughExport(t, "16M", 7, "--queues", "2", "--poll-us", "50")
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

// readBytes is read_bytes of /proc/PID/io: what the process (all its
// threads) made the block layer read.
func readBytes(t *testing.T, pid int) int64 {
	t.Helper()
	return harness.ProcField(t, pid, "io", "read_bytes:")
}
