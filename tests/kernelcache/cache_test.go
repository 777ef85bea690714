package kernelcache

// The kernel-cached export (--kernel-cache on): coherence between the
// page cache and every path that changes the image behind it, and
// durability of what was acknowledged.

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/aio/aiotest"
	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// directWrite writes data at off through an O_DIRECT open.
func directWrite(t *testing.T, path string, off int64, data []byte) {
	t.Helper()
	fd, err := unix.Open(path, unix.O_WRONLY|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	buf := harness.AlignedBuf(len(data))
	copy(buf, data)
	if n, err := unix.Pwrite(fd, buf, off); err != nil || n != len(buf) {
		t.Fatalf("O_DIRECT write at %d: %d, %v", off, n, err)
	}
}

// TestKernelCacheServesRepeatedReadsFromPageCache: with the kernel cache on, a second buffered
// read of the same range is served by the kernel (no READ reaches the
// daemon), and the kernel reads ahead in 1 MiB READs; off, every read is
// a READ. (--stats counts the requests.)
func TestKernelCacheServesRepeatedReadsFromPageCache(t *testing.T) {
	for _, mode := range []string{"on", "off"} {
		t.Run(mode, func(t *testing.T) {
			dir := t.TempDir()
			img := harness.RandomImage(t, dir, 16<<20, 7)
			mnt := filepath.Join(dir, "mnt")
			d := harness.StartExport(t, img, mnt, "-f", "raw", "-w", "--kernel-cache", mode, "--stats", "1h")
			want := harness.ReadAll(t, img)
			for range 2 {
				harness.MustEqualBytes(t, "export", harness.ReadAll(t, mnt), want)
			}
			d.StopClean()
			reads := statCount(t, d.Log(), "read")
			if mode == "off" {
				if reads < 2*16*1024*1024/(1<<20) {
					t.Fatalf("off: %d READs for two 16 MiB reads, want every read to reach the daemon", reads)
				}
				return
			}
			// 16 MiB once, in 1 MiB READs (a few smaller at the start of
			// read-ahead): well under 64; the second pass none.
			if reads == 0 || reads > 40 {
				t.Fatalf("on: %d READs for two 16 MiB reads, want the first in about 16 large READs and the second from the cache\n%s", reads, d.Log())
			}
		})
	}
}

// statCount is the summary's request count of kind in the log.
func statCount(t *testing.T, log, kind string) int {
	t.Helper()
	lines := strings.Split(log, "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		l := lines[i]
		if !strings.Contains(l, "stats") {
			continue
		}
		_, after, ok := strings.Cut(l, kind+" ")
		if !ok {
			return 0
		}
		n, err := strconv.Atoi(strings.Fields(after)[0])
		if err != nil {
			t.Fatalf("stats line %q: %v", l, err)
		}
		return n
	}
	t.Fatalf("no stats line in\n%s", log)
	return 0
}

// TestKernelCacheInvalidatedByDirectWrite: a range cached by a buffered read,
// overwritten through an O_DIRECT open, reads back new through a
// buffered open and through a shared mapping made before the write.
func TestKernelCacheInvalidatedByDirectWrite(t *testing.T) {
	harness.EachCachedFormat(t, "4M", nil, func(t *testing.T, format, dir, img, mnt string, d *harness.Daemon) {

		fd, err := unix.Open(mnt, unix.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(fd)
		m, err := unix.Mmap(fd, 0, 4<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Munmap(m)
		// Cache it all (zeroes), through the mapping and a read.
		if !bytes.Equal(m[1<<20:1<<20+8192], make([]byte, 8192)) {
			t.Fatal("fresh image not zero")
		}
		harness.CachedPread(t, mnt, 0, 4<<20)

		data := harness.RandomBytes(8192, 1)
		directWrite(t, mnt, 1<<20, data)
		harness.MustEqualBytes(t, "buffered read after an O_DIRECT write", harness.CachedPread(t, mnt, 1<<20, 8192), data)
		harness.MustEqualBytes(t, "shared mapping after an O_DIRECT write", m[1<<20:1<<20+8192], data)

		// The other way: a store through the mapping, msync'd, is
		// what an O_DIRECT read sees.
		copy(m[2<<20:], harness.RandomBytes(4096, 2))
		if err := unix.Msync(m, unix.MS_SYNC); err != nil {
			t.Fatal(err)
		}
		dfd, err := unix.Open(mnt, unix.O_RDONLY|unix.O_DIRECT, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(dfd)
		buf := harness.AlignedBuf(4096)
		if _, err := unix.Pread(dfd, buf, 2<<20); err != nil {
			t.Fatal(err)
		}
		harness.MustEqualBytes(t, "O_DIRECT read after an msync'd store", buf, harness.RandomBytes(4096, 2))

		// A buffered write still dirty in the cache (its file open,
		// not synced) is what an O_DIRECT read sees.
		if _, err := unix.Pwrite(fd, harness.RandomBytes(4096, 3), 3<<20); err != nil {
			t.Fatal(err)
		}
		if _, err := unix.Pread(dfd, buf, 3<<20); err != nil {
			t.Fatal(err)
		}
		harness.MustEqualBytes(t, "O_DIRECT read after a buffered write", buf, harness.RandomBytes(4096, 3))
	})
}

// TestKernelCacheInvalidatedByPunchZeroAndShrink: cached data, punched or zeroed through
// the export, reads back as zeroes through a buffered open; so does a
// range shrunk away and grown back on a growable export, and the sizes
// the kernel reports follow the image.
func TestKernelCacheInvalidatedByPunchZeroAndShrink(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "img")
	harness.CreateImage(t, "-f", "raw", img, "4M")
	mnt := filepath.Join(dir, "mnt")
	harness.StartCached(t, img, mnt, "-f", "raw", "--growable")

	data := harness.RandomBytes(4<<20, 3)
	if err := os.WriteFile(mnt, data, 0); err != nil {
		t.Fatal(err)
	}
	harness.MustEqualBytes(t, "written", harness.CachedPread(t, mnt, 0, 4<<20), data)
	f, err := os.OpenFile(mnt, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fd := int(f.Fd())
	if err := unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 1<<20, 64<<10); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fallocate(fd, unix.FALLOC_FL_ZERO_RANGE, 2<<20, 64<<10); err != nil {
		t.Fatal(err)
	}
	zero := make([]byte, 64<<10)
	harness.MustEqualBytes(t, "punched range", harness.CachedPread(t, mnt, 1<<20, 64<<10), zero)
	harness.MustEqualBytes(t, "zeroed range", harness.CachedPread(t, mnt, 2<<20, 64<<10), zero)
	harness.MustEqualBytes(t, "after the punched range", harness.CachedPread(t, mnt, 1<<20+64<<10, 4096), data[1<<20+64<<10:1<<20+68<<10])

	// Shrink to 1 MiB, grow back to 4 MiB: the tail is zeroes, in the
	// image and through the cache.
	if err := f.Truncate(1 << 20); err != nil {
		t.Fatal(err)
	}
	if st, _ := os.Stat(img); st.Size() != 1<<20 {
		t.Fatalf("image size %d after truncate to 1 MiB", st.Size())
	}
	if err := f.Truncate(4 << 20); err != nil {
		t.Fatal(err)
	}
	if st, _ := os.Stat(mnt); st.Size() != 4<<20 {
		t.Fatalf("export size %d after growing to 4 MiB", st.Size())
	}
	harness.MustEqualBytes(t, "grown tail", harness.CachedPread(t, mnt, 3<<20, 4096), make([]byte, 4096))

	// A buffered write past the end grows the image once written back.
	tail := harness.RandomBytes(4096, 4)
	if _, err := f.WriteAt(tail, 5<<20); err != nil {
		t.Fatal(err)
	}
	if st, _ := os.Stat(mnt); st.Size() != 5<<20+4096 {
		t.Fatalf("export size %d after a write past the end, want %d", st.Size(), 5<<20+4096)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	got := harness.ReadAll(t, img)
	if len(got) != 5<<20+4096 {
		t.Fatalf("image size %d after fsync, want %d", len(got), 5<<20+4096)
	}
	harness.MustEqualBytes(t, "image tail", got[5<<20:], tail)
}

// TestKernelCacheFioBufferedAndDirectJobsAtOnce: a buffered and an O_DIRECT fio job
// write and verify (crc32c) at the same time on one export, on halves of
// it cached beforehand; then each half is verified by the other kind of
// reader: the direct job's writes through the buffered cache (stale
// without invalidation), the buffered job's through O_DIRECT.
func TestKernelCacheFioBufferedAndDirectJobsAtOnce(t *testing.T) {
	harness.EachCachedFormat(t, "32M", nil, func(t *testing.T, format, dir, img, mnt string, d *harness.Daemon) {
		harness.ReadAll(t, mnt) // cache the whole export
		job := func(name string, direct int, off string, extra ...string) []string {
			return append([]string{"--name=" + name, "--filename=" + mnt, "--rw=randwrite", "--bs=4k",
				"--offset=" + off, "--size=16M", "--ioengine=psync", "--direct=" + strconv.Itoa(direct),
				"--verify=crc32c", "--verify_fatal=1", "--randseed=29", "--end_fsync=1"}, extra...)
		}
		var both []string
		both = append(both, "--verify_state_save=0", "--minimal")
		both = append(both, job("buffered", 0, "0")...)
		both = append(both, job("direct", 1, "16M")...)
		harness.Run(t, "fio", both...)
		// Swap the readers: verify_only replays each job's writes.
		var swapped []string
		swapped = append(swapped, "--verify_state_save=0", "--minimal")
		swapped = append(swapped, job("buffered", 1, "0", "--verify_only=1")...)
		swapped = append(swapped, job("direct", 0, "16M", "--verify_only=1")...)
		harness.Run(t, "fio", swapped...)
		d.StopClean()
		if format == "qcow2" {
			harness.QemuImgCheck(t, img)
		}
	})
}

// TestKernelCacheFsyncedBytesSurviveSigkill: buffered writes, fsync, more buffered
// writes and sync(2), then SIGKILL of the daemon: every fsynced byte is in
// the image file, whatever happened to the writes after the fsync. sync(2)
// promises nothing here: the kernel starts the write-back to a FUSE server
// without waiting for it (a check of the synced range failed under load).
func TestKernelCacheFsyncedBytesSurviveSigkill(t *testing.T) {
	harness.EachCachedFormat(t, "16M", nil, func(t *testing.T, format, dir, img, mnt string, d *harness.Daemon) {
		f, err := os.OpenFile(mnt, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		a, b := harness.RandomBytes(6<<20, 5), harness.RandomBytes(6<<20, 6)
		for off := 0; off < len(a); off += 4096 {
			if _, err := f.WriteAt(a[off:off+4096], int64(off)); err != nil {
				t.Fatal(err)
			}
		}
		if err := f.Sync(); err != nil {
			t.Fatal(err)
		}
		for off := 0; off < len(b); off += 4096 {
			if _, err := f.WriteAt(b[off:off+4096], int64(8<<20+off)); err != nil {
				t.Fatal(err)
			}
		}
		syscall.Sync()
		d.Cmd.Process.Kill()
		<-d.Exited
		f.Close()
		harness.WaitUnlocked(t, img)
		content := img
		if format == "qcow2" {
			content = harness.ToRaw(t, img, dir)
		}
		got := harness.ReadAll(t, content)
		harness.MustEqualBytes(t, "fsynced range", got[:6<<20], a)
	})
}

// TestKernelCacheSigtermWritesBackDirtyPages: buffered writes that returned, on a file
// still open when the daemon gets SIGTERM, are in the image after it exits
// (it writes the kernel's dirty pages back before it lets go of the
// connection), and a write after that fails rather than vanishing.
func TestKernelCacheSigtermWritesBackDirtyPages(t *testing.T) {
	dir := t.TempDir()
	const blocks = 2048
	img := filepath.Join(dir, "img")
	harness.CreateImage(t, "-f", "raw", img, strconv.Itoa(blocks*4096))
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartCached(t, img, mnt, "-f", "raw")
	f, err := os.OpenFile(mnt, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
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
			if i >= 300 {
				time.Sleep(2 * time.Millisecond) // keep writing while the daemon stops
			}
		}
	}()
	for range 300 {
		<-acked
	}
	d.Cmd.Process.Signal(syscall.SIGTERM)
	n := 300
	for range acked {
		n++
	}
	if code := d.Wait(30 * time.Second); code != 0 {
		t.Fatalf("exit %d after SIGTERM\n%s", code, d.Log())
	}
	got := harness.ReadAll(t, img)
	for i := 0; i < n; i++ {
		if binary.LittleEndian.Uint64(got[i*4096:]) != uint64(i)+1 {
			t.Fatalf("block %d of %d written before SIGTERM is not in the image\n%s", i, n, d.Log())
		}
	}
}

// TestKernelCacheOfNBDSourceRevalidatedOnOpen: an NBD source may change behind the
// export (another client of the server), so even with the kernel cache
// on its cache is not kept across opens: data read and cached, then
// overwritten by another NBD client, reads back new through a new open.
// (With the cache kept, the old bytes came back.) auto leaves the cache
// off for it altogether.
func TestKernelCacheOfNBDSourceRevalidatedOnOpen(t *testing.T) {
	dir := t.TempDir()
	img := harness.SparseImage(t, dir, "src.img", 4<<20)
	sock := filepath.Join(dir, "nbd.sock")
	harness.StartServerProc(t, sock, "qemu-nbd", "-f", "raw", "--shared=8", "--persistent", "-x", "disk", "-k", sock, img)
	uri := harness.NBDURI("disk", sock)
	mnt := filepath.Join(dir, "mnt")
	harness.StartCached(t, uri, mnt)
	harness.MustEqualBytes(t, "before", harness.CachedPread(t, mnt, 1<<20, 4096), make([]byte, 4096))
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x5a 1M 4k", uri)
	harness.MustEqualBytes(t, "after another client's write", harness.CachedPread(t, mnt, 1<<20, 4096), bytes.Repeat([]byte{0x5a}, 4096))

	mnt2 := filepath.Join(dir, "mnt2")
	d := harness.StartExport(t, uri, mnt2, "--kernel-cache", "auto")
	if !strings.Contains(d.Log(), "kernel_cache=false") {
		t.Fatalf("auto turned the kernel cache on for an NBD source\n%s", d.Log())
	}
}

// TestKernelCacheOfRawImageRevalidatedOnOpen: a raw image's locks deny nobody write
// access (a read-only export's image may be written beside it), so its
// cache is not kept across opens: bytes written into the image by
// qemu-io after a cached read come back through the next open. (Kept,
// the old bytes came back.)
func TestKernelCacheOfRawImageRevalidatedOnOpen(t *testing.T) {
	dir := t.TempDir()
	img := harness.SparseImage(t, dir, "ro.img", 4<<20)
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, img, mnt, "-f", "raw", "--kernel-cache", "on")
	if !strings.Contains(d.Log(), "kernel_cache=true") {
		t.Fatalf("the export did not turn the kernel cache on\n%s", d.Log())
	}
	harness.MustEqualBytes(t, "before", harness.CachedPread(t, mnt, 1<<20, 4096), make([]byte, 4096))
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x6b 1M 4k", img)
	harness.MustEqualBytes(t, "after qemu-io wrote the image", harness.CachedPread(t, mnt, 1<<20, 4096), bytes.Repeat([]byte{0x6b}, 4096))
}

// TestReadAheadWindowFollowsFlagAndDisk: the export's bdi reads ahead as far as asked
// (--read-ahead 4M), and by default as far as the disk under the image
// does, never less than 1 MiB; the export reads right through it; a
// window under 4 KiB is refused.
func TestReadAheadWindowFollowsFlagAndDisk(t *testing.T) {
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, 32<<20, 3)
	var st unix.Stat_t
	if err := unix.Stat(img, &st); err != nil {
		t.Fatal(err)
	}
	// The disk's window, read here from the disk's own sysfs entry (a
	// partition's is its disk's).
	disk := 0
	devDir := fmt.Sprintf("/sys/dev/block/%d:%d", unix.Major(st.Dev), unix.Minor(st.Dev))
	for _, p := range []string{devDir + "/bdi/read_ahead_kb", devDir + "/../bdi/read_ahead_kb"} {
		if b, err := os.ReadFile(p); err == nil {
			disk, _ = strconv.Atoi(strings.TrimSpace(string(b)))
			break
		}
	}
	for _, tc := range []struct {
		arg    string
		wantKB int
	}{
		{"4M", 4096},
		{"auto", max(1024, disk)},
	} {
		t.Run(tc.arg, func(t *testing.T) {
			mnt := filepath.Join(t.TempDir(), "mnt")
			d := harness.StartCached(t, img, mnt, "-f", "raw", "--read-ahead", tc.arg)
			var mst unix.Stat_t
			if err := unix.Stat(mnt, &mst); err != nil {
				t.Fatal(err)
			}
			b, err := os.ReadFile(fmt.Sprintf("/sys/class/bdi/%d:%d/read_ahead_kb", unix.Major(mst.Dev), unix.Minor(mst.Dev)))
			if err != nil {
				t.Fatal(err)
			}
			if got, _ := strconv.Atoi(strings.TrimSpace(string(b))); got != tc.wantKB {
				t.Fatalf("--read-ahead %s: the export's bdi reads ahead %d KiB, want %d\n%s", tc.arg, got, tc.wantKB, d.Log())
			}
			harness.MustEqualBytes(t, "first 8 MiB", harness.CachedPread(t, mnt, 0, 8<<20), harness.ReadAll(t, img)[:8<<20])
		})
	}
	if out, err := exec.Command(harness.Bin, "fuse", "--read-ahead", "1K", img, filepath.Join(dir, "x")).CombinedOutput(); err == nil || !strings.Contains(string(out), "--read-ahead") {
		t.Fatalf("--read-ahead 1K: %v, %s; want a usage error naming the flag", err, out)
	}
}

// residentPages is how many of the first n bytes' pages of path the page
// cache holds.
func residentPages(t *testing.T, path string, n int) int {
	t.Helper()
	k, err := aiotest.Resident(path, n)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// TestKernelCacheDropsHostPagesBehindReads: with the kernel caching the export (and the host file
// read through the page cache, --cache writeback), reading the export
// cold leaves none of the image file's pages in the page cache once the
// reads are over (drop-behind, aio.SetDropBehind: granules read whole
// leave at once, the rest within a second or two): one cache, the
// export's. Uncached, the export leaves them in (the host's cache is its
// only one). Both read the right bytes.
func TestKernelCacheDropsHostPagesBehindReads(t *testing.T) {
	const size = 16 << 20
	for _, kc := range []string{"on", "off"} {
		t.Run(kc, func(t *testing.T) {
			dir := t.TempDir()
			img := harness.RandomImage(t, dir, size, 9)
			want := harness.ReadAll(t, img)
			fd, err := unix.Open(img, unix.O_RDONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			unix.Fdatasync(fd) // dirty pages are not dropped
			unix.Fadvise(fd, 0, size, unix.FADV_DONTNEED)
			unix.Close(fd)
			if k := residentPages(t, img, size); k > 0 {
				t.Fatalf("%d pages of the image still cached after FADV_DONTNEED", k)
			}
			mnt := filepath.Join(dir, "mnt")
			harness.StartExport(t, img, mnt, "-f", "raw", "--kernel-cache", kc, "--cache", "writeback")
			harness.MustEqualBytes(t, "export", harness.ReadAll(t, mnt), want)
			k := residentPages(t, img, size)
			for deadline := time.Now().Add(5 * time.Second); kc == "on" && k > 0 && time.Now().Before(deadline); k = residentPages(t, img, size) {
				time.Sleep(50 * time.Millisecond)
			}
			switch {
			case kc == "on" && k > 0:
				t.Fatalf("kernel cache on: %d of %d pages of the image file cached 5 s after reading the export: two caches", k, size/4096)
			case kc == "off" && k < size/4096/2:
				t.Fatalf("kernel cache off: only %d of %d pages of the image file cached (the test cannot tell one cache from two)", k, size/4096)
			}
		})
	}
}

// TestKernelCacheShowsImageSizeAtFirstSight: a client that starts the moment the mount shows
// in the mount table (as scripts, and the bench, poll for it) finds the
// image's size, not the empty file the kernel makes the mount's root
// with, which a writeback-cached kernel would otherwise keep until the
// daemon told it (a loop device attached then is 0 bytes: mkfs fails);
// and the image's last page, which carries the size to the kernel, reads
// back as the image's. The size is not a whole number of pages.
func TestKernelCacheShowsImageSizeAtFirstSight(t *testing.T) {
	dir := t.TempDir()
	const size = 8<<20 + 1000
	img := filepath.Join(dir, "odd.raw")
	data := harness.RandomBytes(size, 31)
	if err := os.WriteFile(img, data, 0o600); err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		mnt := filepath.Join(dir, fmt.Sprintf("mnt%d", i))
		seen := make(chan error, 1)
		quit := make(chan struct{})
		go func() {
			for !harness.IsFuseMount(mnt) {
				select {
				case <-quit:
					seen <- fmt.Errorf("the mount never showed")
					return
				default:
				}
			}
			var st unix.Stat_t
			if err := unix.Stat(mnt, &st); err != nil {
				seen <- fmt.Errorf("stat at first sight: %w", err)
				return
			}
			if st.Size != size {
				seen <- fmt.Errorf("size %d at first sight of the mount, want %d", st.Size, size)
				return
			}
			seen <- nil
		}()
		d := harness.StartCached(t, img, mnt, "-f", "raw")
		var err error
		select {
		case err = <-seen:
		case <-time.After(20 * time.Second):
			err = fmt.Errorf("the poller did not finish")
		}
		close(quit)
		if err != nil {
			t.Fatalf("round %d: %v", i, err)
		}
		harness.MustEqualBytes(t, "the last 5000 bytes", harness.CachedPread(t, mnt, size-5000, 5000), data[size-5000:])
		if fi, err := os.Stat(mnt); err != nil || fi.Size() != size {
			t.Fatalf("round %d: size once serving %v, %v", i, fi, err)
		}
		d.StopClean()
	}
}
