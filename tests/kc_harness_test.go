package tests

import (
	"bytes"
	"os"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// kcHarnessArgs are what startExport adds for BLOCKEXPORT_KERNEL_CACHE:
// "on" runs the FUSE exports with the kernel cache on (make test runs the
// export tests that way too, as it runs them over io_uring). An export
// that asks for FUSE passthrough gets none: the two exclude each other
// (the daemon refuses both on), and that test is about passthrough. A
// test's own --kernel-cache comes later on the command line and wins.
// Unset, the exports run uncached (--kernel-cache off, where the daemon's
// default is auto): the suite's first run checks the path every request
// takes to us, the kernel-cached run (=on) the other.
func kcHarnessArgs(args []string) []string {
	v := os.Getenv("BLOCKEXPORT_KERNEL_CACHE")
	if slices.Contains(args, "--passthrough") {
		return nil
	}
	if v == "" {
		v = "off"
	}
	return []string{"--kernel-cache", v}
}

// kcWriteback says whether the harness runs the exports with the kernel's
// writeback cache (BLOCKEXPORT_KERNEL_CACHE=on): a buffered write returns
// once in the page cache, and what goes wrong when the kernel writes it
// back (a full host, the end of a non-growable image) is reported by the
// next fsync or close. The tests of the synchronous errors check that
// form of the same rule then.
func kcWriteback() bool { return os.Getenv("BLOCKEXPORT_KERNEL_CACHE") == "on" }

// kcClampedAtWriteback: writes across and past the end of a non-growable
// export fail at fsync (ENOSPC), the part before the end is in the image,
// and afterwards the export has the image's size again and reads end
// there.
func kcClampedAtWriteback(t *testing.T, f *os.File, img, mnt string, data []byte) {
	t.Helper()
	if _, err := unix.Pwrite(int(f.Fd()), data, oddSize-1000); err != nil {
		t.Fatalf("buffered write across EOF: %v", err)
	}
	if _, err := unix.Pwrite(int(f.Fd()), data, oddSize+8192); err != nil {
		t.Fatalf("buffered write past EOF: %v", err)
	}
	if err := f.Sync(); errnoOf(err) != unix.ENOSPC {
		t.Fatalf("fsync after writes past the end: %v, want ENOSPC", err)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		st, err := os.Stat(mnt)
		if err == nil && st.Size() == oddSize {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("export size after the failed write-back: %v %v, want %d", st.Size(), err, oddSize)
		}
	}
	if st, _ := os.Stat(img); st.Size() != oddSize {
		t.Fatalf("image size changed to %d", st.Size())
	}
	if n, err := unix.Pread(int(f.Fd()), make([]byte, 4096), oddSize); n != 0 || err != nil {
		t.Fatalf("read at the end: %d %v, want 0", n, err)
	}
	got := make([]byte, 1000)
	raw, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	raw.ReadAt(got, oddSize-1000)
	mustEqualBytes(t, "tail written through the export", got, data[:1000])
}

// kcHostErrorAtFsync: filling a full host through the writeback cache,
// the error comes at fsync, and reads give what the image holds.
func kcHostErrorAtFsync(t *testing.T, fd int, img string, block []byte) {
	t.Helper()
	for off := int64(0); off < 8<<20; off += int64(len(block)) {
		if _, err := unix.Pwrite(fd, block, off); err != nil {
			t.Fatalf("buffered write at %d: %v", off, err)
		}
	}
	if err := unix.Fsync(fd); err != unix.ENOSPC {
		t.Fatalf("fsync after filling a full host: %v, want ENOSPC", err)
	}
	want := readAll(t, img)
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		buf := make([]byte, 64<<10)
		n, err := unix.Pread(fd, buf, 4<<20)
		if err == nil && n == len(buf) && bytes.Equal(buf, want[4<<20:4<<20+64<<10]) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("read after a failed write-back: %d %v, not what the image holds", n, err)
		}
	}
}
