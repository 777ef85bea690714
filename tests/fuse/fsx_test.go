package fuse

// An fsx-style exerciser (Debian 12 ships no fsx): random operations of
// every kind a client can make on the exported file — buffered pread and
// pwrite, reads and stores through a shared mapping (msync'd), O_DIRECT
// reads and writes through a second open, ftruncate of a growable export,
// fallocate punch and zero, fsync — each read checked against an
// in-memory model of the file, with the kernel cache on and off, over
// raw and qcow2 images. Seeded and reproducible: BLOCKEXPORT_FSX_SEED
// replays a run, BLOCKEXPORT_FSX_OPS sets its length; a failure prints
// the seed and the tail of the operation log.

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// fsxMaxSize bounds the file; writes and truncates stay under it.
const fsxMaxSize = 6 << 20

// fsxRun is one exerciser run on one export.
type fsxRun struct {
	t      *testing.T
	seed   uint64
	rnd    *rand.Rand
	align  int64 // granularity of every size change (qcow2 keeps whole sectors)
	model  []byte
	fd     int // buffered open
	dfd    int // O_DIRECT open
	log    []string
	nops   int
	dbuf   []byte // aligned O_DIRECT buffer of fsxMaxSize
	counts map[string]int
	d      *harness.Daemon
	mu     sync.Mutex // log, read by the watchdog too
	hung   atomic.Bool
}

func (r *fsxRun) logf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.log = append(r.log, fmt.Sprintf("%5d ", r.nops)+fmt.Sprintf(format, args...))
	if len(r.log) > 40 {
		r.log = r.log[len(r.log)-40:]
	}
}

func (r *fsxRun) fail(format string, args ...any) {
	r.t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	hung := ""
	if r.hung.Load() {
		hung = fmt.Sprintf(" (the operation hung for %v: the watchdog aborted the FUSE connection; kernel stacks above)", harness.HangLimit)
	}
	r.t.Fatalf("fsx: seed %d (BLOCKEXPORT_FSX_SEED=%d replays it), op %d: %s%s\nlast operations:\n%s\ndaemon log:\n%s",
		r.seed, r.seed, r.nops, fmt.Sprintf(format, args...), hung, strings.Join(r.log, "\n"), r.d.Log())
}

// watchdog turns a hang into a failure with a log: when no operation has
// finished for HangLimit, it prints the kernel stacks of this process and of
// the daemon, and aborts the FUSE connection (conn is its number in
// /sys/fs/fuse/connections), which fails the stuck system call.
func (r *fsxRun) watchdog(conn uint32, done *atomic.Int64) (stop func()) {
	quit := make(chan struct{})
	go func() {
		last, since := done.Load(), time.Now()
		for {
			select {
			case <-quit:
				return
			case <-time.After(time.Second):
			}
			if n := done.Load(); n != last {
				last, since = n, time.Now()
				continue
			}
			if time.Since(since) < harness.HangLimit {
				continue
			}
			r.hung.Store(true)
			var b strings.Builder
			for _, pid := range []int{os.Getpid(), r.d.Cmd.Process.Pid} {
				tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stack", pid))
				for _, task := range tasks {
					if st, err := os.ReadFile(task); err == nil && bytes.Contains(st, []byte("fuse")) {
						fmt.Fprintf(&b, "%s:\n%s", task, st)
					}
				}
			}
			fmt.Fprintf(os.Stderr, "fsx watchdog: seed %d, op %d hung for %v; kernel stacks:\n%s", r.seed, last+1, harness.HangLimit, b.String())
			os.WriteFile(fmt.Sprintf("/sys/fs/fuse/connections/%d/abort", conn), []byte("1"), 0)
			return
		}
	}()
	return func() { close(quit) }
}

// check compares what a read returned at off with the model.
func (r *fsxRun) check(what string, got []byte, off int64) {
	r.t.Helper()
	want := r.model[off : off+int64(len(got))]
	if bytes.Equal(got, want) {
		return
	}
	i := 0
	for got[i] == want[i] {
		i++
	}
	j := len(got) - 1
	for got[j] == want[j] {
		j--
	}
	r.fail("%s at %d+%d: bytes %d..%d differ (first: got %#x, want %#x)", what, off, len(got), off+int64(i), off+int64(j), got[i], want[i])
}

// resize sets the model's size: new bytes are zero.
func (r *fsxRun) resize(n int64) {
	if n <= int64(len(r.model)) {
		r.model = r.model[:n]
		return
	}
	r.model = append(r.model, make([]byte, n-int64(len(r.model)))...)
}

func (r *fsxRun) roundUp(n int64) int64 { return (n + r.align - 1) / r.align * r.align }

// span picks a range: lengths mostly small and unaligned, some large.
func (r *fsxRun) span(limit int64, aligned bool) (off, n int64) {
	var max int64 = 64 << 10
	if r.rnd.IntN(8) == 0 {
		max = 1 << 20
	}
	if aligned {
		off = r.rnd.Int64N(limit/4096+1) * 4096
		n = (r.rnd.Int64N(max/4096) + 1) * 4096
	} else {
		off = r.rnd.Int64N(limit + 1)
		n = r.rnd.Int64N(max) + 1
	}
	if off+n > fsxMaxSize {
		n = fsxMaxSize - off
	}
	if aligned {
		n &^= 4095
	}
	return off, n
}

// writeSpan is span for a write: a write that grows the file ends on the
// image's granularity.
func (r *fsxRun) writeSpan(aligned bool) (off, n int64) {
	size := int64(len(r.model))
	off, n = r.span(size+size/8, aligned)
	if end := off + n; end > size && r.roundUp(end) != end {
		n = r.roundUp(end) - off
		if off+n > fsxMaxSize {
			n = size - off
		}
	}
	return off, n
}

func (r *fsxRun) randomBytes(n int64) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.rnd.Uint32())
	}
	// Runs of zeroes too: a qcow2 may store them as zero clusters.
	if r.rnd.IntN(4) == 0 && n > 2 {
		a := r.rnd.Int64N(n)
		clear(b[a : a+r.rnd.Int64N(n-a)])
	}
	return b
}

func (r *fsxRun) op() {
	r.t.Helper()
	size := int64(len(r.model))
	switch k := r.rnd.IntN(20); {
	case k < 4: // buffered read
		off, n := r.span(size, false)
		buf := make([]byte, n)
		r.logf("read     %d+%d (size %d)", off, n, size)
		got, err := unix.Pread(r.fd, buf, off)
		if err != nil {
			r.fail("read %d+%d: %v", off, n, err)
		}
		if want := max(0, min(n, size-off)); int64(got) != want {
			r.fail("read %d+%d returned %d bytes, want %d", off, n, got, want)
		}
		r.check("buffered read", buf[:got], off)
		r.counts["read"]++
	case k < 8: // buffered write
		off, n := r.writeSpan(false)
		if n <= 0 {
			return
		}
		data := r.randomBytes(n)
		r.logf("write    %d+%d (size %d)", off, n, size)
		if got, err := unix.Pwrite(r.fd, data, off); err != nil || int64(got) != n {
			r.fail("write %d+%d: %d, %v", off, n, got, err)
		}
		if off+n > size {
			r.resize(off + n)
		}
		copy(r.model[off:], data)
		r.counts["write"]++
	case k < 10: // mapped read
		if size == 0 {
			return
		}
		off, n := r.span(size-1, false)
		n = min(n, size-off)
		r.logf("mapread  %d+%d (size %d)", off, n, size)
		m, err := unix.Mmap(r.fd, 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
		if err != nil {
			r.fail("mmap for reading: %v", err)
		}
		got := bytes.Clone(m[off : off+n])
		unix.Munmap(m)
		r.check("mapped read", got, off)
		r.counts["mapread"]++
	case k < 12: // mapped write, msync'd
		if size == 0 {
			return
		}
		off, n := r.span(size-1, false)
		n = min(n, size-off)
		data := r.randomBytes(n)
		r.logf("mapwrite %d+%d (size %d)", off, n, size)
		m, err := unix.Mmap(r.fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			r.fail("mmap for writing: %v", err)
		}
		copy(m[off:], data)
		err = unix.Msync(m, unix.MS_SYNC)
		unix.Munmap(m)
		if err != nil {
			r.fail("msync: %v", err)
		}
		copy(r.model[off:], data)
		r.counts["mapwrite"]++
	case k < 14: // O_DIRECT read
		off, n := r.span(size, true)
		if n <= 0 {
			return
		}
		buf := r.dbuf[:n]
		// No fsync first: before a direct_io read the kernel writes the
		// range's dirty pages back to us itself, which this checks.
		r.logf("dread    %d+%d (size %d)", off, n, size)
		got, err := unix.Pread(r.dfd, buf, off)
		if err != nil {
			r.fail("O_DIRECT read %d+%d: %v", off, n, err)
		}
		if want := max(0, min(n, size-off)); int64(got) != want {
			r.fail("O_DIRECT read %d+%d returned %d bytes, want %d", off, n, got, want)
		}
		r.check("O_DIRECT read", buf[:got], off)
		r.counts["dread"]++
	case k < 16: // O_DIRECT write
		off, n := r.writeSpan(true)
		if n <= 0 {
			return
		}
		buf := r.dbuf[:n]
		copy(buf, r.randomBytes(n))
		r.logf("dwrite   %d+%d (size %d)", off, n, size)
		if got, err := unix.Pwrite(r.dfd, buf, off); err != nil || int64(got) != n {
			r.fail("O_DIRECT write %d+%d: %d, %v", off, n, got, err)
		}
		if off+n > size {
			r.resize(off + n)
		}
		copy(r.model[off:], buf)
		r.counts["dwrite"]++
	case k < 17: // truncate, down or up
		n := r.roundUp(r.rnd.Int64N(fsxMaxSize - r.align))
		if r.rnd.IntN(2) == 0 && size > 0 {
			n = r.roundUp(size - r.rnd.Int64N(min(size, 256<<10)))
		}
		r.logf("truncate %d (size %d)", n, size)
		if err := unix.Ftruncate(r.fd, n); err != nil {
			r.fail("ftruncate to %d: %v", n, err)
		}
		r.resize(n)
		r.counts["truncate"]++
	case k < 19: // punch or zero, inside the file or across its end
		off, n := r.span(size, false)
		if n <= 0 {
			return
		}
		mode, name := uint32(unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE), "punch"
		if r.rnd.IntN(2) == 0 {
			mode, name = unix.FALLOC_FL_ZERO_RANGE|unix.FALLOC_FL_KEEP_SIZE, "zero"
		}
		r.logf("%-8s %d+%d (size %d)", name, off, n, size)
		if err := unix.Fallocate(r.fd, mode, off, n); err != nil {
			r.fail("fallocate %s %d+%d: %v", name, off, n, err)
		}
		if off < size {
			clear(r.model[off:min(size, off+n)])
		}
		r.counts[name]++
	default:
		r.logf("fsync")
		if err := unix.Fsync(r.fd); err != nil {
			r.fail("fsync: %v", err)
		}
		r.counts["fsync"]++
	}
	if r.nops%64 == 0 {
		var st unix.Stat_t
		if err := unix.Fstat(r.fd, &st); err != nil {
			r.fail("fstat: %v", err)
		}
		if st.Size != int64(len(r.model)) {
			r.fail("st_size %d, want %d", st.Size, len(r.model))
		}
	}
}

// fsxSeed is BLOCKEXPORT_FSX_SEED, else a new seed (logged).
func fsxSeed(t *testing.T) uint64 {
	if s := os.Getenv("BLOCKEXPORT_FSX_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("BLOCKEXPORT_FSX_SEED=%q: %v", s, err)
		}
		return v
	}
	return uint64(time.Now().UnixNano())
}

func fsxOps(t *testing.T) int {
	if s := os.Getenv("BLOCKEXPORT_FSX_OPS"); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v <= 0 {
			t.Fatalf("BLOCKEXPORT_FSX_OPS=%q: want a positive count", s)
		}
		return v
	}
	return 3000
}

// TestFsxOnGrowableExportsMatchesModel runs the exerciser on a growable writable export of a raw
// image, a qcow2 image and a qcow2 overlay over a raw base of random
// data (its clusters allocated as the run writes, the rest read through
// from the base, growth over the base's end zeroed), with the kernel
// cache on and off; at the end the image itself (qcow2: as qemu-img
// reads it) holds the model.
func TestFsxOnGrowableExportsMatchesModel(t *testing.T) {
	for _, format := range []string{"raw", "qcow2", "qcow2-overlay"} {
		for _, kc := range []string{"on", "off"} {
			t.Run(format+"/kernel-cache="+kc, func(t *testing.T) {
				t.Parallel() // each run has its own image, export and model
				seed := fsxSeed(t)
				t.Logf("fsx seed %d", seed)
				fsxExercise(t, format, kc, seed, fsxOps(t))
			})
		}
	}
}

func fsxExercise(t *testing.T, format, kc string, seed uint64, ops int) {
	dir := t.TempDir()
	img := filepath.Join(dir, "img")
	var base []byte
	if format == "qcow2-overlay" {
		b := harness.RandomImage(t, dir, 4<<20, seed)
		base = harness.ReadAll(t, b)
		harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", b, "-F", "raw", img)
		format = "qcow2"
	} else {
		harness.CreateImage(t, "-f", format, img, "4M")
	}
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, img, mnt, "-f", format, "-w", "--growable", "--kernel-cache", kc)

	r := &fsxRun{t: t, d: d, seed: seed, rnd: rand.New(rand.NewPCG(seed, 0xf5)), align: 1,
		model: make([]byte, 4<<20), dbuf: harness.AlignedBuf(fsxMaxSize), counts: map[string]int{}}
	if format == "qcow2" {
		r.align = 512
	}
	var err error
	if r.fd, err = unix.Open(mnt, unix.O_RDWR, 0); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(r.fd)
	if r.dfd, err = unix.Open(mnt, unix.O_RDWR|unix.O_DIRECT, 0); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(r.dfd)
	// Start from data, not zeroes, so that a stale zero shows: the
	// base's, or written now.
	if base != nil {
		copy(r.model, base)
	} else {
		first := r.randomBytes(4 << 20)
		if _, err := unix.Pwrite(r.fd, first, 0); err != nil {
			t.Fatal(err)
		}
		copy(r.model, first)
	}

	var st unix.Stat_t
	if err := unix.Fstat(r.fd, &st); err != nil {
		t.Fatal(err)
	}
	var done atomic.Int64
	stop := r.watchdog(unix.Minor(st.Dev), &done)
	defer stop()
	for r.nops = 1; r.nops <= ops; r.nops++ {
		r.op()
		done.Store(int64(r.nops))
	}
	// Everything read back each way, then durable in the image.
	buf := make([]byte, len(r.model))
	if n, err := unix.Pread(r.fd, buf, 0); err != nil || n != len(buf) {
		r.fail("final read: %d, %v", n, err)
	}
	r.check("final buffered read", buf, 0)
	if err := unix.Fsync(r.fd); err != nil {
		r.fail("final fsync: %v", err)
	}
	unix.Close(r.dfd)
	unix.Close(r.fd)
	t.Logf("fsx: %d operations %v, final size %d", ops, r.counts, len(r.model))
	d.StopClean()
	got := harness.ReadAll(t, img)
	if format == "qcow2" {
		harness.QemuImgCheck(t, img)
		got = harness.ReadAll(t, harness.ToRaw(t, img, dir))
	}
	if len(got) != len(r.model) {
		r.fail("image size %d after the run, want %d", len(got), len(r.model))
	}
	r.check("the image after the run", got, 0)
}

// TestTruncateOverDirtyPagesReturns: a shrinking ftruncate whose new end lies
// in a page still dirty in the writeback cache returns, and the export
// and the image both end there with the data before it. It hung before
// (the daemon invalidated the page from inside the SETATTR, while the
// kernel holds the inode's write-back until the SETATTR's reply; fsx seed
// 1796185334523830635).
func TestTruncateOverDirtyPagesReturns(t *testing.T) {
	harness.EachCachedFormat(t, "4M", []string{"--growable"}, func(t *testing.T, format, dir, img, mnt string, d *harness.Daemon) {
		f, err := os.OpenFile(mnt, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		data := harness.RandomBytes(1<<20, 11)
		if _, err := f.WriteAt(data, 1<<20); err != nil {
			t.Fatal(err)
		}
		harness.GuardAgainstHang(t, mnt, func() {
			if err := f.Truncate(1<<20 + 4096 + 512); err != nil {
				t.Fatalf("ftruncate over dirty pages: %v\n%s", err, d.Log())
			}
		})
		harness.MustEqualBytes(t, "kept part", harness.CachedPread(t, mnt, 1<<20, 4096+512), data[:4096+512])
		if err := f.Sync(); err != nil {
			t.Fatal(err)
		}
		d.StopClean()
		got := harness.ReadAll(t, img)
		if format == "qcow2" {
			got = harness.ReadAll(t, harness.ToRaw(t, img, dir))
		}
		if len(got) != 1<<20+4096+512 {
			t.Fatalf("image size %d, want %d", len(got), 1<<20+4096+512)
		}
		harness.MustEqualBytes(t, "image", got[1<<20:], data[:4096+512])
	})
}

// TestDirectReadOfHoleBeforeCachedWriteReadsZeroes: a buffered write past the
// end of a growable export grows the file in the kernel at once and the
// image only at write-back; an O_DIRECT read of the hole between the old
// end and that write reads zeroes, as the file's size says (it read
// nothing before: the daemon ended the read at the image's end; fsx seed
// 1796186140117775601).
func TestDirectReadOfHoleBeforeCachedWriteReadsZeroes(t *testing.T) {
	harness.EachCachedFormat(t, "1M", []string{"--growable"}, func(t *testing.T, format, dir, img, mnt string, d *harness.Daemon) {
		f, err := os.OpenFile(mnt, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		dfd, err := unix.Open(mnt, unix.O_RDONLY|unix.O_DIRECT, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(dfd)
		buf := harness.AlignedBuf(64 << 10)
		// Each round grows the file by a write 64 KiB past its end and
		// reads the hole at once (the kernel writes the page back
		// soon, which would close the window), then across the write.
		end := int64(1 << 20)
		for round := range 32 {
			tail := harness.RandomBytes(4096, uint64(round))
			at := end + int64(len(buf))
			if _, err := f.WriteAt(tail, at); err != nil {
				t.Fatal(err)
			}
			for i := range buf {
				buf[i] = 0xa5
			}
			n, err := unix.Pread(dfd, buf, end)
			if err != nil || n != len(buf) {
				t.Fatalf("round %d: O_DIRECT read of the hole at %d: %d, %v; want %d zero bytes", round, end, n, err, len(buf))
			}
			harness.MustEqualBytes(t, "hole", buf, make([]byte, len(buf)))
			n, err = unix.Pread(dfd, buf[:8192], at-4096)
			if err != nil || n != 8192 {
				t.Fatalf("round %d: O_DIRECT read across the write: %d, %v", round, n, err)
			}
			harness.MustEqualBytes(t, "before the write", buf[:4096], make([]byte, 4096))
			harness.MustEqualBytes(t, "the write", buf[4096:8192], tail)
			end = at + 4096
		}
	})
}
