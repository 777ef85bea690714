package fuse

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

func TestExternalUnmountEndsTheExport(t *testing.T) {
	dir := t.TempDir()
	img := harness.SparseImage(t, dir, "u.img", 1<<20)
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, img, mnt, "-f", "raw", "-w")
	harness.Run(t, "fusermount3", "-u", mnt)
	if code := d.Wait(10 * time.Second); code != 0 {
		t.Fatalf("exit %d after external unmount\n%s", code, d.Log())
	}
	// The process must have gone, not be spinning: wait returned.
	if !strings.Contains(d.Log(), "unmounted from outside") {
		t.Fatalf("log does not say why it stopped:\n%s", d.Log())
	}
}

func TestDaemonizeReturnsOnceServing(t *testing.T) {
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, 3<<20, 8)
	mnt := filepath.Join(dir, "mnt")
	pidfile := filepath.Join(dir, "pid")
	code, out := harness.RunBlockexport(t, "fuse", "-f", "raw", "--daemonize", "--pidfile", pidfile, img, mnt)
	pid := 0
	if b, err := os.ReadFile(pidfile); err == nil {
		pid, _ = strconv.Atoi(strings.TrimSpace(string(b)))
	}
	t.Cleanup(func() {
		if pid > 0 {
			syscall.Kill(pid, syscall.SIGTERM)
			for i := 0; i < 200 && syscall.Kill(pid, 0) == nil; i++ {
				time.Sleep(20 * time.Millisecond)
			}
		}
		if harness.IsFuseMount(mnt) {
			syscall.Unmount(mnt, syscall.MNT_DETACH)
		}
	})
	if code != 0 {
		t.Fatalf("--daemonize exit %d: %s", code, out)
	}
	if pid <= 0 {
		t.Fatal("no pid in the pidfile")
	}
	// Usable right away, no polling.
	st, err := os.Stat(mnt)
	if err != nil || st.Size() != 3<<20 {
		t.Fatalf("stat right after --daemonize returned: %v", err)
	}
	harness.MustEqualBytes(t, "daemonized export", harness.ReadAll(t, mnt), harness.ReadAll(t, img))
	syscall.Kill(pid, syscall.SIGTERM)
	for i := 0; i < 500 && syscall.Kill(pid, 0) == nil; i++ {
		time.Sleep(20 * time.Millisecond)
	}
	if syscall.Kill(pid, 0) == nil {
		t.Fatal("daemon did not exit on SIGTERM")
	}
	if _, err := os.Stat(pidfile); !os.IsNotExist(err) {
		t.Fatal("pidfile left behind")
	}
	if _, err := os.Stat(mnt); !os.IsNotExist(err) {
		t.Fatal("created mountpoint left behind")
	}

	// A daemon that cannot come up says why and exits non-zero.
	code, out = harness.RunBlockexport(t, "fuse", "--daemonize", filepath.Join(dir, "absent"), mnt)
	if code != 1 || !strings.Contains(out, "no such file") {
		t.Fatalf("--daemonize of a missing image: exit %d, %q", code, out)
	}
}

// TestSigtermLosesNoAcknowledgedWrite writes numbered blocks through the
// export while it is stopped; every write that returned success must be in
// the image afterwards, raw and qcow2 (whose metadata is written back at
// exit).
func TestSigtermLosesNoAcknowledgedWrite(t *testing.T) {
	for _, format := range []string{"raw", "qcow2"} {
		t.Run(format, func(t *testing.T) { sigtermUnderLoad(t, format) })
	}
}

func sigtermUnderLoad(t *testing.T, format string) {
	dir := t.TempDir()
	const blocks = 4096
	img := filepath.Join(dir, "w."+format)
	harness.CreateImage(t, "-f", format, img, strconv.Itoa(blocks*4096))
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, img, mnt, "-f", format, "-w")
	f, err := os.OpenFile(mnt, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	acked := make(chan int, blocks)
	go func() {
		defer close(acked)
		buf := make([]byte, 4096)
		for i := 0; i < blocks; i++ {
			for j := 0; j < len(buf); j += 8 {
				binary.LittleEndian.PutUint64(buf[j:], uint64(i)+1)
			}
			if _, err := f.WriteAt(buf, int64(i)*4096); err != nil {
				return
			}
			acked <- i
		}
	}()
	// Let some writes through, then stop the export under load.
	for i := 0; i < 200; i++ {
		<-acked
	}
	d.Cmd.Process.Signal(syscall.SIGTERM)
	var done []int
	for i := range acked {
		done = append(done, i)
	}
	f.Close()
	if code := d.Wait(20 * time.Second); code != 0 {
		t.Fatalf("exit %d after SIGTERM\n%s", code, d.Log())
	}
	content := img
	if format == "qcow2" {
		harness.QemuImgCheck(t, img)
		content = harness.ToRaw(t, img, dir)
	}
	got := harness.ReadAll(t, content)
	for i := 0; i < 200+len(done); i++ {
		want := make([]byte, 8)
		binary.LittleEndian.PutUint64(want, uint64(i)+1)
		if !bytes.Equal(got[i*4096:i*4096+8], want) {
			t.Fatalf("acknowledged block %d is not in the image", i)
		}
	}
	if harness.IsFuseMount(mnt) {
		t.Fatal("still mounted")
	}
}

func TestNullDevice(t *testing.T) {
	dir := t.TempDir()
	mnt := filepath.Join(dir, "mnt")
	harness.StartExport(t, "null:1G", mnt, "-w")
	st, err := os.Stat(mnt)
	if err != nil || st.Size() != 1<<30 {
		t.Fatalf("null:1G: %v, size %d", err, st.Size())
	}
	f, err := os.OpenFile(mnt, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(bytes.Repeat([]byte{9}, 65536), 1<<20); err != nil {
		t.Fatal(err)
	}
	buf := bytes.Repeat([]byte{1}, 65536)
	if _, err := f.ReadAt(buf, 1<<20); err != nil {
		t.Fatal(err)
	}
	harness.MustEqualBytes(t, "null device read", buf, make([]byte, 65536))
	out := harness.Run(t, "fio", "--name=null", "--filename="+mnt, "--rw=randrw", "--bs=4k", "--size=64M",
		"--ioengine=libaio", "--iodepth=16", "--direct=1", "--io_size=32M", "--minimal")
	if !strings.Contains(out, "null;") {
		t.Fatalf("fio output: %s", out)
	}
}

// TestStatsCountRequests: --stats logs intervals and a summary whose read
// count covers the reads a client made.
func TestStatsCountRequests(t *testing.T) {
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, 4<<20, 31)
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, img, mnt, "-f", "raw", "--stats", "100ms")
	harness.Run(t, "dd", "if="+mnt, "of=/dev/null", "bs=4k", "count=300", "iflag=direct")
	time.Sleep(250 * time.Millisecond)
	d.StopClean()
	log := d.Log()
	if !strings.Contains(log, "msg=stats ") {
		t.Fatalf("no interval line:\n%s", log)
	}
	i := strings.Index(log, "stats summary")
	if i < 0 {
		t.Fatalf("no summary:\n%s", log)
	}
	var n int
	if _, err := fmt.Sscanf(log[strings.Index(log[i:], "read ")+i:], "read %d ops", &n); err != nil || n < 300 {
		t.Fatalf("summary counts %d reads (%v), want at least 300:\n%s", n, err, log[i:])
	}
}

// TestFileNameInDirectory: with --file-name the export is the one file of
// a mounted directory: listable, usable by real clients (fio verify, then
// qemu-img compare against the image), and nothing else can be made,
// renamed or removed there. The directory is ours again afterwards.
func TestFileNameInDirectory(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "disk.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", img, "32M")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 1M 2M", img)
	mnt := filepath.Join(dir, "mnt")
	os.Mkdir(mnt, 0o755)
	d := harness.StartExport(t, img, mnt, "-f", "qcow2", "-w", "--file-name", "disk.raw")
	file := filepath.Join(mnt, "disk.raw")

	entries, err := os.ReadDir(mnt)
	if err != nil || len(entries) != 1 || entries[0].Name() != "disk.raw" || !entries[0].Type().IsRegular() {
		t.Fatalf("the directory lists %v (%v); want the one regular file disk.raw", entries, err)
	}
	st, err := os.Stat(file)
	if err != nil || st.Size() != 32<<20 || !st.Mode().IsRegular() {
		t.Fatalf("stat %s: %v, %v", file, st, err)
	}
	if st, err := os.Stat(mnt); err != nil || !st.IsDir() {
		t.Fatalf("stat %s: %v, %v; want a directory", mnt, st, err)
	}
	if _, err := os.Stat(filepath.Join(mnt, "other")); !os.IsNotExist(err) {
		t.Fatalf("a name that is not there: %v; want ENOENT", err)
	}
	refused := map[string]error{
		"create":  os.WriteFile(filepath.Join(mnt, "new"), nil, 0o644),
		"mkdir":   os.Mkdir(filepath.Join(mnt, "sub"), 0o755),
		"symlink": os.Symlink("disk.raw", filepath.Join(mnt, "link")),
		"link":    os.Link(file, filepath.Join(mnt, "hard")),
		"rename":  os.Rename(file, filepath.Join(mnt, "moved")),
		"remove":  os.Remove(file),
		"chmod":   os.Chmod(mnt, 0o777),
	}
	for what, err := range refused {
		if harness.ErrnoOf(err) != syscall.EPERM {
			t.Errorf("%s in the export's directory: %v; want EPERM", what, err)
		}
	}

	// Real clients on the file: qemu-img sees the data written before,
	// fio writes and verifies over it.
	if out := harness.Run(t, "qemu-img", "compare", "-U", "-f", "raw", "-F", "qcow2", file, img); !strings.Contains(out, "identical") {
		t.Fatalf("qemu-img compare: %s", out)
	}
	harness.Run(t, "fio", "--name=verify", "--filename="+file, "--rw=randwrite", "--bs=4k", "--size=8M", "--offset=16M",
		"--ioengine=libaio", "--iodepth=16", "--direct=1", "--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0", "--minimal")
	written := harness.ReadAll(t, file)
	d.StopClean()

	if harness.IsFuseMount(mnt) {
		t.Fatal("still mounted after SIGTERM")
	}
	if entries, err := os.ReadDir(mnt); err != nil || len(entries) != 0 {
		t.Fatalf("after the export the directory holds %v (%v); want it empty, as it was", entries, err)
	}
	// What fio wrote is in the image.
	raw := filepath.Join(dir, "back.raw")
	harness.Run(t, "qemu-img", "convert", "-f", "qcow2", "-O", "raw", img, raw)
	harness.MustEqualBytes(t, "the image after the export", harness.ReadAll(t, raw), written)
	harness.Run(t, "qemu-img", "check", img)
}
