package harness

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// kernelCacheArgs are what StartExport adds for BLOCKEXPORT_KERNEL_CACHE:
// "on" runs the FUSE exports with the kernel cache on (make test runs the
// tests/fuse package that way too). A test's own --kernel-cache comes later on the command line and wins.
// Unset, the exports run uncached (--kernel-cache off, where the daemon's
// default is auto): the suite's first run checks the path every request
// takes to us, the kernel-cached run (=on) the other.
func kernelCacheArgs() []string {
	v := os.Getenv("BLOCKEXPORT_KERNEL_CACHE")
	if v == "" {
		v = "off"
	}
	return []string{"--kernel-cache", v}
}

// AlignedBuf is an O_DIRECT-ready buffer of n bytes.
func AlignedBuf(n int) []byte {
	b := make([]byte, n+4096)
	off := int(4096 - uintptr(unsafe.Pointer(&b[0]))%4096)
	return b[off%4096 : off%4096+n]
}

// CachedPread reads n bytes at off through a fresh buffered open (the
// kernel's cache, kept across opens).
func CachedPread(t *testing.T, path string, off int64, n int) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatalf("buffered read at %d: %v", off, err)
	}
	return b
}

// RandomBytes is n pseudo-random bytes from seed.
func RandomBytes(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, 29))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// EachCachedFormat runs fn as a subtest for a raw and a qcow2 image of size,
// each exported writable with the kernel cache on (and args).
func EachCachedFormat(t *testing.T, size string, args []string, fn func(t *testing.T, format, dir, img, mnt string, d *Daemon)) {
	t.Helper()
	for _, format := range []string{"raw", "qcow2"} {
		t.Run(format, func(t *testing.T) {
			dir := t.TempDir()
			img := filepath.Join(dir, "img")
			CreateImage(t, "-f", format, img, size)
			mnt := filepath.Join(dir, "mnt")
			d := StartCached(t, img, mnt, append([]string{"-f", format}, args...)...)
			fn(t, format, dir, img, mnt, d)
		})
	}
}

// GuardAgainstHang aborts the export's FUSE connection when fn has not
// returned within HangLimit (a deadlock between the kernel and the
// daemon), so that the stuck system call fails and the test says so
// instead of hanging.
func GuardAgainstHang(t *testing.T, file string, fn func()) {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(file, &st); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		select {
		case <-done:
		case <-time.After(HangLimit):
			os.WriteFile(fmt.Sprintf("/sys/fs/fuse/connections/%d/abort", unix.Minor(st.Dev)), []byte("1"), 0)
		}
	}()
	defer close(done)
	fn()
}

// HangLimit is how long one operation may take before the run counts as
// hung (a deadlock between the kernel and the daemon).
const HangLimit = 60 * time.Second

// StartCached exports image writable with the kernel cache on.
func StartCached(t *testing.T, img, mnt string, args ...string) *Daemon {
	t.Helper()
	d := StartExport(t, img, mnt, append([]string{"-w", "--kernel-cache", "on"}, args...)...)
	if !strings.Contains(d.Log(), "kernel_cache=true") {
		t.Fatalf("the export did not turn the kernel cache on\n%s", d.Log())
	}
	return d
}
