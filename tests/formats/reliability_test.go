package formats

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestZeroingAcrossAClusterBoundary is the reported case: a zeroed range
// that starts in one cluster and ends in the next, the first already
// reading as zeroes, left the second's data in place and said success.
// Through FUSE (ZERO_RANGE and PUNCH_HOLE) and NBD (WRITE_ZEROES).
func TestZeroingAcrossAClusterBoundary(t *testing.T) {
	const off, n = 64536, 2000 // [63.0 KiB, 65.0 KiB): clusters 0 and 1
	prepare := func(t *testing.T) string {
		img := filepath.Join(t.TempDir(), "z.qcow2")
		harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", img, "1M")
		harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x61 64k 64k", img)
		return img
	}
	// What QEMU reads there afterwards: all zeroes, and the rest intact.
	verify := func(t *testing.T, img string) {
		t.Helper()
		out := harness.Run(t, "qemu-io", "-r", "-f", "qcow2", "-c", "read -P 0 64536 2000", "-c", "read -P 0x61 66536 64536", img)
		if strings.Contains(out, "verification failed") {
			t.Fatalf("after zeroing:\n%s", out)
		}
		harness.Run(t, "qemu-img", "check", "-q", img)
	}
	for _, mode := range []struct {
		name string
		flag uint32
	}{
		{"zero-range", unix.FALLOC_FL_ZERO_RANGE | unix.FALLOC_FL_KEEP_SIZE},
		{"punch-hole", unix.FALLOC_FL_PUNCH_HOLE | unix.FALLOC_FL_KEEP_SIZE},
	} {
		t.Run("fuse/"+mode.name, func(t *testing.T) {
			img := prepare(t)
			mnt := filepath.Join(t.TempDir(), "z.raw")
			d := harness.StartExport(t, img, mnt, "-w")
			f, err := os.OpenFile(mnt, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			if err := unix.Fallocate(int(f.Fd()), mode.flag, off, n); err != nil {
				t.Fatalf("fallocate: %v", err)
			}
			got := make([]byte, n)
			if _, err := f.ReadAt(got, off); err != nil {
				t.Fatal(err)
			}
			f.Close()
			if i := bytes.IndexFunc(got, func(r rune) bool { return r != 0 }); i >= 0 {
				t.Fatalf("byte %d of the zeroed range reads %#x through the export", i, got[i])
			}
			d.StopClean()
			verify(t, img)
		})
	}
	t.Run("nbd/write-zeroes", func(t *testing.T) {
		img := prepare(t)
		s := harness.StartNBD(t, img, false, "-w", "-f", "qcow2")
		harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -z 64536 2000", s.URI)
		s.StopClean()
		verify(t, img)
	})
}

// TestWriteOntoMetadataIsRefused: with the L1 table's refcount at zero,
// the next allocation would hand out the L1 table's cluster and a guest
// write would destroy it. The client gets EIO, the daemon says why in one
// line, the image is marked corrupt and no longer opens for writing; its
// data is intact.
func TestWriteOntoMetadataIsRefused(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "m.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", img, "4M")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 0 64k", img)
	b, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	be := binary.BigEndian
	l1, rt := int64(be.Uint64(b[40:])), int64(be.Uint64(b[48:]))
	rb := int64(be.Uint64(b[rt:]))
	f, _ := os.OpenFile(img, os.O_RDWR, 0)
	f.WriteAt([]byte{0, 0}, rb+l1>>16*2) // 16-bit refcounts, 64 KiB clusters
	f.Close()

	mnt := filepath.Join(dir, "m.raw")
	d := harness.StartExport(t, img, mnt, "-w")
	fd, err := unix.Open(mnt, unix.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, werr := unix.Pwrite(fd, bytes.Repeat([]byte{1}, 4096), 1<<20)
	_, werr2 := unix.Pwrite(fd, []byte{1}, 2<<20)
	unix.Close(fd)
	if werr != unix.EIO || werr2 != unix.EIO {
		t.Fatalf("writes onto metadata: %v, then %v; want EIO both", werr, werr2)
	}
	d.StopClean()
	log := d.Log()
	if strings.Count(log, "preventing invalid write on metadata") != 1 || !strings.Contains(log, "active L1 table") {
		t.Fatalf("want one log line naming the L1 table:\n%s", log)
	}
	if out := harness.Run(t, "qemu-img", "info", "--output=json", img); !strings.Contains(out, `"corrupt": true`) {
		t.Fatalf("not marked corrupt:\n%s", out)
	}
	out := harness.Run(t, "qemu-io", "-r", "-f", "qcow2", "-c", "read -P 0x5a 0 64k", img)
	if strings.Contains(out, "verification failed") {
		t.Fatalf("data lost:\n%s", out)
	}
	code, msg := harness.RunBlockexport(t, "fuse", "-w", img, filepath.Join(dir, "again.raw"))
	if code != 1 || !strings.Contains(msg, "corrupt") {
		t.Fatalf("a writable export of the corrupt image: exit %d %q", code, msg)
	}
}

// TestFIFOsAreRefused: a FIFO as image or backing file hung info, map,
// fuse and create -b in open(2). It is refused at once, in one line.
func TestFIFOsAreRefused(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	over := filepath.Join(dir, "over.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", over, "1M")
	harness.Run(t, "qemu-img", "rebase", "-u", "-f", "qcow2", "-b", "fifo", "-F", "raw", over)
	for _, args := range [][]string{
		{"info", fifo},
		{"map", fifo},
		{"info", "--backing-chain", over}, // plain info opens no backing file, as qemu-img's
		{"map", over},
		{"fuse", fifo, filepath.Join(dir, "m1")},
		{"fuse", over, filepath.Join(dir, "m2")},
		{"nbd", "--listen", "unix:" + filepath.Join(dir, "s"), fifo},
		{"create", "-f", "qcow2", "-b", fifo, filepath.Join(dir, "new.qcow2")},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		out, err := exec.CommandContext(ctx, harness.Bin, args...).CombinedOutput()
		timedOut := ctx.Err() != nil
		cancel()
		if timedOut {
			t.Fatalf("%v hangs on the FIFO", args)
		}
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 || !strings.Contains(string(out), "FIFO") ||
			strings.Count(strings.TrimSpace(string(out)), "\n") != 0 {
			t.Errorf("%v: %v %q; want exit 1 and one line naming the FIFO", args, err, out)
		}
	}
}
