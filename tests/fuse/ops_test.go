package fuse

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// An image whose size is not a multiple of 4 KiB, so the clamping at its end
// is visible.
const oddSize = 8<<20 + 1000

func TestReadOnlyExportServesImageAndRefusesWrites(t *testing.T) {
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, oddSize, 1)
	mnt := filepath.Join(dir, "mnt")
	before := harness.FileHash(t, img)
	harness.StartExport(t, img, mnt, "--format", "raw")

	var st unix.Stat_t
	if err := unix.Stat(mnt, &st); err != nil {
		t.Fatal(err)
	}
	if st.Size != oddSize || st.Mode != unix.S_IFREG|0o400 || st.Ino != 1 || st.Nlink != 1 {
		t.Fatalf("stat: size %d mode %o ino %d nlink %d; want %d %o 1 1", st.Size, st.Mode, st.Ino, st.Nlink, oddSize, unix.S_IFREG|0o400)
	}

	// cp of the export equals the image, and qemu-img agrees.
	harness.MustEqualBytes(t, "export vs image", harness.ReadAll(t, mnt), harness.ReadAll(t, img))
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", mnt, img)

	// Reads are clamped at the end: short at EOF, empty past it.
	f, err := os.Open(mnt)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 8192)
	n, err := f.ReadAt(buf, oddSize-100)
	if n != 100 {
		t.Fatalf("read across EOF returned %d bytes (%v), want 100", n, err)
	}
	if n, _ := f.ReadAt(buf, oddSize+4096); n != 0 {
		t.Fatalf("read past EOF returned %d bytes, want 0", n)
	}

	// Writes: the mount is read-only.
	if _, err := os.OpenFile(mnt, os.O_WRONLY, 0); harness.ErrnoOf(err) != unix.EROFS {
		t.Fatalf("open for writing: %v, want EROFS", err)
	}
	if err := os.Chmod(mnt, 0o600); harness.ErrnoOf(err) != unix.EROFS {
		t.Fatalf("chmod u+w: %v, want EROFS", err)
	}
	if err := os.Truncate(mnt, 4096); err == nil {
		t.Fatal("truncate of a read-only export succeeded")
	}
	out, err := exec.Command("dd", "if=/dev/zero", "of="+mnt, "bs=4k", "count=1", "conv=notrunc").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "Read-only file system") {
		t.Fatalf("dd into a read-only export: %v\n%s", err, out)
	}
	if harness.FileHash(t, img) != before {
		t.Fatal("the image changed under a read-only export")
	}
}

func TestWritesAreClampedUnlessGrowable(t *testing.T) {
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, oddSize, 2)
	mnt := filepath.Join(dir, "mnt")
	harness.StartExport(t, img, mnt, "-f", "raw", "--writable")

	f, err := os.OpenFile(mnt, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	data := bytes.Repeat([]byte{0xab}, 4096)
	if writebackCached() {
		clampedAtWriteback(t, f, img, mnt, data)
		return
	}
	// A write across the end is cut at the end. (pwrite(2) itself: Go's
	// WriteAt hides the short count behind the next chunk's ENOSPC.)
	n, err := unix.Pwrite(int(f.Fd()), data, oddSize-1000)
	if n != 1000 {
		t.Fatalf("write across EOF wrote %d (%v), want 1000", n, err)
	}
	// A write past the end fails with ENOSPC; dd says so.
	if _, err := f.WriteAt(data, oddSize); harness.ErrnoOf(err) != unix.ENOSPC {
		t.Fatalf("write past EOF: %v, want ENOSPC", err)
	}
	out, err := exec.Command("dd", "if=/dev/zero", "of="+mnt, "bs=4k", "count=1", "seek=4096", "conv=notrunc").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "No space left on device") {
		t.Fatalf("dd past EOF of a non-growable export: %v\n%s", err, out)
	}
	if st, _ := os.Stat(img); st.Size() != oddSize {
		t.Fatalf("image size changed to %d", st.Size())
	}
	got := make([]byte, 1000)
	raw, _ := os.Open(img)
	defer raw.Close()
	raw.ReadAt(got, oddSize-1000)
	harness.MustEqualBytes(t, "tail written through the export", got, data[:1000])
}

func TestGrowableExportGrowsAndShrinks(t *testing.T) {
	dir := t.TempDir()
	img := harness.SparseImage(t, dir, "g.img", 1<<20)
	mnt := filepath.Join(dir, "mnt")
	harness.StartExport(t, img, mnt, "-f", "raw", "-w", "--growable")

	harness.Run(t, "dd", "if=/dev/urandom", "of="+mnt, "bs=64k", "count=2", "seek=31", "conv=notrunc")
	want := int64(33 * 64 << 10)
	for _, p := range []string{mnt, img} {
		if st, err := os.Stat(p); err != nil || st.Size() != want {
			t.Fatalf("%s after growing write: %v, size %d; want %d", p, err, st.Size(), want)
		}
	}
	harness.MustEqualBytes(t, "grown export vs image", harness.ReadAll(t, mnt), harness.ReadAll(t, img))

	harness.Run(t, "truncate", "-s", "100000", mnt)
	for _, p := range []string{mnt, img} {
		if st, err := os.Stat(p); err != nil || st.Size() != 100000 {
			t.Fatalf("%s after truncate: %v, size %d; want 100000", p, err, st.Size())
		}
	}
}

func TestFallocateModes(t *testing.T) {
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, 4<<20, 3)
	mnt := filepath.Join(dir, "mnt")
	harness.StartExport(t, img, mnt, "-f", "raw", "-w")

	fd, err := unix.Open(mnt, unix.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)

	// mode 0 inside the image: not possible (QEMU: EOPNOTSUPP).
	if err := unix.Fallocate(fd, 0, 0, 4096); err != unix.EOPNOTSUPP {
		t.Fatalf("fallocate mode 0 inside the image: %v, want EOPNOTSUPP", err)
	}
	// Punch hole needs KEEP_SIZE.
	if err := unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE, 0, 4096); err != unix.EINVAL && err != unix.EOPNOTSUPP {
		t.Fatalf("punch hole without KEEP_SIZE: %v, want EINVAL", err)
	}
	// Punch hole: reads zeroes, the host file is deallocated there.
	harness.Run(t, "fallocate", "--punch-hole", "--offset", "1048576", "--length", "1048576", mnt)
	// Zero range: reads zeroes.
	harness.Run(t, "fallocate", "--zero-range", "--keep-size", "--offset", "2097152", "--length", "65536", mnt)
	got := harness.ReadAll(t, img)
	zero := make([]byte, 1<<20)
	harness.MustEqualBytes(t, "punched range", got[1<<20:2<<20], zero)
	harness.MustEqualBytes(t, "zeroed range", got[2<<20:2<<20+65536], zero[:65536])
	if got[2<<20+65536] == 0 && got[2<<20+65537] == 0 && got[2<<20+65538] == 0 {
		t.Fatal("zero range spilled past its end")
	}
	hole, err := unix.Seek(fd, 0, unix.SEEK_HOLE)
	if err != nil || hole != 1<<20 {
		t.Fatalf("SEEK_HOLE after punching: %d, %v; want %d", hole, err, 1<<20)
	}
	// mode 0 at the end grows the image (iotest 308).
	harness.Run(t, "fallocate", "--offset", "4194304", "--length", "65536", mnt)
	if st, _ := os.Stat(img); st.Size() != 4<<20+65536 {
		t.Fatalf("image size after fallocate at EOF: %d, want %d", st.Size(), 4<<20+65536)
	}
	// Zero range without KEEP_SIZE grows too.
	harness.Run(t, "fallocate", "--zero-range", "--offset", "4259840", "--length", "4096", mnt)
	if st, _ := os.Stat(mnt); st.Size() != 4<<20+65536+4096 {
		t.Fatalf("export size after zero-range past EOF: %d", st.Size())
	}
}

func TestSeekDataHoleAndBlocksFollowAllocation(t *testing.T) {
	dir := t.TempDir()
	img := harness.SparseImage(t, dir, "s.img", 16<<20)
	// Data at [1M, 1M+64K) and [8M, 9M); the rest holes.
	f, err := os.OpenFile(img, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt(bytes.Repeat([]byte{1}, 64<<10), 1<<20)
	f.WriteAt(bytes.Repeat([]byte{2}, 1<<20), 8<<20)
	f.Close()
	mnt := filepath.Join(dir, "mnt")
	harness.StartExport(t, img, mnt, "-f", "raw")

	hostFd, _ := unix.Open(img, unix.O_RDONLY, 0)
	defer unix.Close(hostFd)
	expFd, err := unix.Open(mnt, unix.O_RDONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(expFd)
	for _, off := range []int64{0, 4096, 1 << 20, 1<<20 + 100, 2 << 20, 8 << 20, 9<<20 - 1, 9 << 20, 16<<20 - 1} {
		for _, whence := range []int{unix.SEEK_DATA, unix.SEEK_HOLE} {
			want, wantErr := unix.Seek(hostFd, off, whence)
			got, gotErr := unix.Seek(expFd, off, whence)
			if got != want || gotErr != wantErr {
				t.Errorf("lseek(%d, whence %d): export %d/%v, host file %d/%v", off, whence, got, gotErr, want, wantErr)
			}
		}
	}
	// At and past the end: SEEK_HOLE at EOF is EOF, the rest ENXIO.
	if off, err := unix.Seek(expFd, 16<<20, unix.SEEK_HOLE); err != unix.ENXIO && off != 16<<20 {
		t.Errorf("SEEK_HOLE at EOF: %d, %v", off, err)
	}
	if _, err := unix.Seek(expFd, 16<<20, unix.SEEK_DATA); err != unix.ENXIO {
		t.Errorf("SEEK_DATA at EOF: %v, want ENXIO", err)
	}
	if _, err := unix.Seek(expFd, 17<<20, unix.SEEK_DATA); err != unix.ENXIO {
		t.Errorf("SEEK_DATA past EOF: %v, want ENXIO", err)
	}
	var hs, es unix.Stat_t
	unix.Stat(img, &hs)
	unix.Stat(mnt, &es)
	if hs.Blocks != es.Blocks || es.Blocks >= 16<<20/512 {
		t.Errorf("st_blocks: export %d, image %d", es.Blocks, hs.Blocks)
	}
}

func TestSetattrRules(t *testing.T) {
	dir := t.TempDir()
	img := harness.SparseImage(t, dir, "a.img", 1<<20)
	mnt := filepath.Join(dir, "mnt")
	harness.StartExport(t, img, mnt, "-f", "raw", "-w", "--allow-other", "off")

	if err := os.Chmod(mnt, 0o400); err != nil {
		t.Fatalf("chmod 0400: %v", err)
	}
	if st, _ := os.Stat(mnt); st.Mode().Perm() != 0o400 {
		t.Fatalf("mode after chmod: %o", st.Mode().Perm())
	}
	// Without allow_other, group/other bits are refused, as are owners.
	if err := os.Chmod(mnt, 0o644); harness.ErrnoOf(err) != unix.EPERM {
		t.Fatalf("chmod 0644 without allow_other: %v, want EPERM", err)
	}
	if err := os.Chown(mnt, 1000, 1000); harness.ErrnoOf(err) != unix.ENOTSUP {
		t.Fatalf("chown without allow_other: %v, want ENOTSUP", err)
	}
	// Times cannot be set (QEMU: ENOTSUP).
	out, err := exec.Command("touch", mnt).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "not supported") {
		t.Fatalf("touch: %v %s", err, out)
	}
}

func TestSetattrWithAllowOther(t *testing.T) {
	dir := t.TempDir()
	img := harness.SparseImage(t, dir, "a.img", 1<<20)
	mnt := filepath.Join(dir, "mnt")
	harness.StartExport(t, img, mnt, "-f", "raw", "-w", "--allow-other", "on")

	if err := os.Chmod(mnt, 0o644); err != nil {
		t.Fatalf("chmod 0644 with allow_other: %v", err)
	}
	if err := os.Chown(mnt, 1000, 1001); err != nil {
		t.Fatalf("chown with allow_other: %v", err)
	}
	var st unix.Stat_t
	unix.Stat(mnt, &st)
	if st.Mode&0o777 != 0o644 || st.Uid != 1000 || st.Gid != 1001 {
		t.Fatalf("after chmod/chown: mode %o uid %d gid %d", st.Mode&0o777, st.Uid, st.Gid)
	}
}

func TestStatfsDescribesTheImage(t *testing.T) {
	dir := t.TempDir()
	img := harness.SparseImage(t, dir, "f.img", 64<<20)
	os.WriteFile(img, bytes.Repeat([]byte{7}, 4<<20), 0) // 4 MiB allocated, rest... truncated below
	os.Truncate(img, 64<<20)
	mnt := filepath.Join(dir, "mnt")
	harness.StartExport(t, img, mnt, "-f", "raw")
	var s unix.Statfs_t
	if err := unix.Statfs(mnt, &s); err != nil {
		t.Fatalf("statfs: %v", err)
	}
	if total := int64(s.Blocks) * s.Bsize; total != 64<<20 {
		t.Errorf("statfs size %d, want %d", total, 64<<20)
	}
	if free := int64(s.Bfree) * s.Bsize; free != 60<<20 {
		t.Errorf("statfs free %d, want %d (size minus allocated)", free, 60<<20)
	}
	harness.Run(t, "df", mnt)
}

func TestSharedMmapOfTheExport(t *testing.T) {
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, 1<<20, 4)
	want := harness.ReadAll(t, img)
	mnt := filepath.Join(dir, "mnt")
	harness.StartExport(t, img, mnt, "-f", "raw", "-w")

	fd, err := unix.Open(mnt, unix.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	m, err := unix.Mmap(fd, 0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatalf("MAP_SHARED mmap of the export: %v", err)
	}
	harness.MustEqualBytes(t, "mmap contents", m[:1<<20], want)
	copy(m[8192:], "written through a shared mapping")
	if err := unix.Msync(m, unix.MS_SYNC); err != nil {
		t.Fatalf("msync: %v", err)
	}
	unix.Munmap(m)
	got := make([]byte, 32)
	h, _ := os.Open(img)
	defer h.Close()
	h.ReadAt(got, 8192)
	if string(got) != "written through a shared mapping" {
		t.Fatalf("image after msync: %q", got)
	}
}

func TestExportOntoTheImageItself(t *testing.T) {
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, 2<<20, 5)
	orig := harness.ReadAll(t, img)
	d := harness.StartExport(t, img, img, "-f", "raw", "-w")
	if !harness.IsFuseMount(img) {
		t.Fatal("image path is not a FUSE mount while exported")
	}
	harness.MustEqualBytes(t, "export over its own image", harness.ReadAll(t, img), orig)
	f, err := os.OpenFile(img, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("hello"), 0); err != nil {
		t.Fatal(err)
	}
	f.Close()
	d.StopClean()
	if harness.IsFuseMount(img) {
		t.Fatal("still mounted after stop")
	}
	got := harness.ReadAll(t, img)
	copy(orig, "hello")
	harness.MustEqualBytes(t, "original file after unmount", got, orig)
}

func TestLookupIsENOENT(t *testing.T) {
	dir := t.TempDir()
	img := harness.SparseImage(t, dir, "l.img", 1<<20)
	mnt := filepath.Join(dir, "mnt")
	harness.StartExport(t, img, mnt, "-f", "raw")
	if _, err := os.Stat(mnt + "/x"); harness.ErrnoOf(err) != syscall.ENOTDIR && harness.ErrnoOf(err) != syscall.ENOENT {
		t.Fatalf("stat below the file: %v", err)
	}
}

// TestHostErrorsReachTheClient: the image lives on a 256 KiB tmpfs, so
// allocating writes fail with ENOSPC on the host; the client must get that
// errno (not a hang, not success), and the export keeps serving.
func TestHostErrorsReachTheClient(t *testing.T) {
	dir := t.TempDir()
	img := harness.SparseImage(t, harness.SmallHost(t, dir, "256k"), "full.img", 8<<20)
	mnt := filepath.Join(dir, "mnt")
	harness.StartExport(t, img, mnt, "-f", "raw", "-w")

	fd, err := unix.Open(mnt, unix.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	block := bytes.Repeat([]byte{1}, 64<<10)
	if writebackCached() {
		hostErrorAtFsync(t, fd, img, block)
		return
	}
	var werr error
	for off := int64(0); off < 8<<20 && werr == nil; off += int64(len(block)) {
		_, werr = unix.Pwrite(fd, block, off)
	}
	if werr != unix.ENOSPC {
		t.Fatalf("filling a full host: %v, want ENOSPC", werr)
	}
	// Still serving: reads of what was written work.
	buf := make([]byte, 4096)
	if n, err := unix.Pread(fd, buf, 0); n != 4096 || err != nil || buf[0] != 1 {
		t.Fatalf("read after ENOSPC: %d %v", n, err)
	}
}
