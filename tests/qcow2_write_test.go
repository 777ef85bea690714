package tests

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// qemuImgCheck fails the test unless qemu-img check finds the image clean
// (no corruption, no leaks).
func qemuImgCheck(t *testing.T, img string) {
	t.Helper()
	out, err := exec.Command("qemu-img", "check", "-f", "qcow2", img).CombinedOutput()
	if err != nil {
		t.Fatalf("qemu-img check %s: %v\n%s", img, err, out)
	}
}

// toRaw converts img to a raw file with QEMU's own qcow2 driver.
func toRaw(t *testing.T, img, dir string) string {
	t.Helper()
	out := filepath.Join(dir, fmt.Sprintf("as-raw-%d.raw", time.Now().UnixNano()))
	run(t, "qemu-img", "convert", "-f", "qcow2", "-O", "raw", img, out)
	return out
}

// mirrorWrites runs workers goroutines (a client at queue depth workers),
// each writing random pieces of its own stripe of target and of mirror
// alike: 4 KiB aligned blocks, 64 KiB blocks, and unaligned odd sizes.
func mirrorWrites(t *testing.T, target, mirror string, size int64, workers, ops int, seed uint64) {
	t.Helper()
	tf, err := os.OpenFile(target, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer tf.Close()
	mf, err := os.OpenFile(mirror, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer mf.Close()
	stripe := size / int64(workers)
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(seed, uint64(w)))
			base := int64(w) * stripe
			buf := make([]byte, 200_000)
			for range ops {
				var n, off int64
				switch r.IntN(3) {
				case 0:
					n, off = 4096, base+r.Int64N(stripe/4096)*4096
				case 1:
					n, off = 65536, base+r.Int64N(stripe/65536)*65536
				default:
					n = 1 + r.Int64N(int64(len(buf)))
					off = base + r.Int64N(stripe-n)
				}
				for i := range buf[:n] {
					buf[i] = byte(r.Uint32())
				}
				if _, err := tf.WriteAt(buf[:n], off); err != nil {
					errs <- fmt.Errorf("write %d bytes at %d through the export: %w", n, off, err)
					return
				}
				if _, err := mf.WriteAt(buf[:n], off); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if err := tf.Sync(); err != nil {
		t.Fatalf("fsync through the export: %v", err)
	}
}

// fioJob is a crc32c-verified random-write job on one region of a file.
func fioJob(name, bs, offset, size string, seed int) []string {
	return []string{"--name=" + name, "--rw=randwrite", "--bs=" + bs, "--offset=" + offset, "--size=" + size,
		"--ioengine=libaio", "--iodepth=16", "--direct=1", "--verify=crc32c", "--verify_fatal=1",
		"--verify_state_save=0", "--randseed=" + strconv.Itoa(seed), "--minimal"}
}

// TestQcow2WritesThroughTheExport: a new image, an overlay over a backing
// file and a compressed image, each written through a writable export by
// a mirrored workload and by fio's verified jobs (4 KiB and 64 KiB, queue
// depth 16). QEMU then finds each image clean and reading exactly what
// was written; the backing file is untouched.
func TestQcow2WritesThroughTheExport(t *testing.T) {
	const size = 48 << 20
	newImage := func(t *testing.T, dir string) (string, string) {
		img := filepath.Join(dir, "new.qcow2")
		createImage(t, "-f", "qcow2", img, strconv.Itoa(size))
		return img, ""
	}
	setups := []struct {
		name string
		make func(t *testing.T, dir string) (img, backing string)
		args []string // export flags beyond -w
	}{
		{"new", newImage, nil},
		{"new, cache none", newImage, []string{"--cache", "none"}},
		{"overlay", func(t *testing.T, dir string) (string, string) {
			base := randomImage(t, dir, size, 21)
			img := filepath.Join(dir, "over.qcow2")
			createImage(t, "-f", "qcow2", "-b", filepath.Base(base), "-F", "raw", img)
			return img, base
		}, nil},
		{"with an internal snapshot", func(t *testing.T, dir string) (string, string) {
			img := filepath.Join(dir, "snap.qcow2")
			run(t, "qemu-img", "create", "-q", "-f", "qcow2", img, strconv.Itoa(size))
			run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x3c 0 40M", img)
			run(t, "qemu-img", "snapshot", "-c", "s1", img)
			return img, ""
		}, nil},
		{"compressed", func(t *testing.T, dir string) (string, string) {
			src := filepath.Join(dir, "src.raw")
			data := bytes.Repeat([]byte("a compressible line of text, over and over\n"), size/43+1)[:size]
			if err := os.WriteFile(src, data, 0o644); err != nil {
				t.Fatal(err)
			}
			img := filepath.Join(dir, "c.qcow2")
			run(t, "qemu-img", "convert", "-c", "-f", "raw", "-O", "qcow2", src, img)
			return img, ""
		}, nil},
	}
	for _, s := range setups {
		t.Run(s.name, func(t *testing.T) {
			dir := t.TempDir()
			img, backing := s.make(t, dir)
			var backingHash [32]byte
			if backing != "" {
				backingHash = fileHash(t, backing)
			}
			mirror := toRaw(t, img, dir)

			mnt := filepath.Join(dir, "mnt")
			d := startExport(t, img, mnt, append([]string{"-w"}, s.args...)...)
			mirrorWrites(t, mnt, mirror, size, 16, 60, 5)
			d.stopClean()
			qemuImgCheck(t, img)
			run(t, "qemu-img", "compare", "-f", "qcow2", "-F", "raw", img, mirror)

			d = startExport(t, img, mnt, append([]string{"-w"}, s.args...)...)
			jobs := [][]string{fioJob("small", "4k", "0", "24M", 1), fioJob("large", "64k", "24M", "24M", 2)}
			for _, job := range jobs {
				run(t, "fio", append(job, "--io_size=12M", "--filename="+mnt)...)
			}
			d.stopClean()
			qemuImgCheck(t, img)
			raw := toRaw(t, img, dir)
			for _, job := range jobs {
				run(t, "fio", append(job, "--io_size=12M", "--filename="+raw, "--verify_only")...)
			}
			if backing != "" && fileHash(t, backing) != backingHash {
				t.Fatal("writes to the overlay changed its backing file")
			}
		})
	}
}

// TestQcow2LoopMountReadWrite: mkfs.ext4 on a new qcow2 image through the
// export, copy a tree in, and find it intact, the file system clean and
// the image clean afterwards.
func TestQcow2LoopMountReadWrite(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "fs.qcow2")
	createImage(t, "-f", "qcow2", img, "128M")
	mnt := filepath.Join(dir, "export")
	d := startExport(t, img, mnt, "-w")
	content := map[string][]byte{}
	r := rand.New(rand.NewPCG(8, 8))
	for i := range 40 {
		data := make([]byte, r.IntN(600_000))
		for j := range data {
			data[j] = byte(r.Uint32())
		}
		content[filepath.Join(fmt.Sprintf("d%d", i%5), fmt.Sprintf("f%d.bin", i))] = data
	}
	mkfsAndFill(t, mnt, filepath.Join(dir, "fs"), content)
	d.stopClean()
	qemuImgCheck(t, img)

	// A second, read-only export: the file system is clean and holds the
	// tree.
	mnt2 := filepath.Join(dir, "export2")
	startExport(t, img, mnt2)
	run(t, "e2fsck", "-fn", mnt2)
	checkTree(t, mnt2, filepath.Join(dir, "fs"), content)
}

// TestQcow2SurvivesKill9: the exporter is killed with SIGKILL at random
// moments while clients write, punch holes and fsync. Every time, qemu-img
// check finds no corruption (leaks are allowed), and every block
// acknowledged before its writer's last successful fsync, and not touched
// since, reads back.
func TestQcow2SurvivesKill9(t *testing.T) {
	const (
		blockSize = 4096
		blocks    = 8192 // 32 MiB
		writers   = 4
	)
	dir := t.TempDir()
	img := filepath.Join(dir, "crash.qcow2")
	// 4 KiB clusters: many L2 tables and refcount updates per second.
	createImage(t, "-f", "qcow2", "--cluster-size", "4k", img, strconv.Itoa(blocks*blockSize))
	// The value each block must hold (0: zeroes), where known.
	durable := map[int]uint64{}
	r := rand.New(rand.NewPCG(99, 99))
	for round := 1; round <= 6; round++ {
		mnt := filepath.Join(dir, fmt.Sprintf("mnt%d", round))
		d := startExport(t, img, mnt, "-w")
		f, err := os.OpenFile(mnt, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		// Blocks written since their writer's last successful fsync: those
		// may hold either value after the crash.
		var mu sync.Mutex
		unsure := map[int]bool{}
		var wg sync.WaitGroup
		for w := range writers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				wr := rand.New(rand.NewPCG(uint64(round), uint64(w)))
				buf := make([]byte, blockSize)
				pending := map[int]uint64{}
				for seq := uint64(1); ; seq++ {
					b := w + writers*wr.IntN(blocks/writers)
					v := uint64(round)<<40 | uint64(b)<<20 | seq
					mu.Lock()
					unsure[b] = true
					mu.Unlock()
					if wr.IntN(8) == 0 {
						v = 0
						if err := syscall.Fallocate(int(f.Fd()), 0x01|0x02, int64(b)*blockSize, blockSize); err != nil {
							return // FALLOC_FL_KEEP_SIZE|FALLOC_FL_PUNCH_HOLE
						}
					} else {
						for j := 0; j < blockSize; j += 8 {
							binary.LittleEndian.PutUint64(buf[j:], v)
						}
						if _, err := f.WriteAt(buf, int64(b)*blockSize); err != nil {
							return
						}
					}
					pending[b] = v
					if seq%16 == 0 {
						if err := f.Sync(); err != nil {
							return
						}
						mu.Lock()
						for pb, pv := range pending {
							durable[pb] = pv
							delete(unsure, pb)
						}
						mu.Unlock()
						clear(pending)
					}
				}
			}()
		}
		time.Sleep(time.Duration(50+r.IntN(400)) * time.Millisecond)
		d.cmd.Process.Signal(syscall.SIGKILL)
		wg.Wait()
		f.Close()
		d.wait(10 * time.Second)
		syscall.Unmount(mnt, syscall.MNT_DETACH)

		// The killed daemon's image locks go with its last reference to
		// the file, which an io_uring ring torn down after the process
		// died may still hold a moment: qemu-img then fails to take its
		// lock (exit 1) and is asked again.
		var out []byte
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			var stderr bytes.Buffer
			cmd := exec.Command("qemu-img", "check", "-f", "qcow2", "--output=json", img)
			cmd.Stderr = &stderr
			out, err = cmd.Output()
			if err == nil || !strings.Contains(stderr.String(), "lock") || time.Now().After(deadline) {
				if err != nil {
					err = fmt.Errorf("%w: %s", err, stderr.Bytes())
				}
				break
			}
		}
		var check struct {
			Corruptions int `json:"corruptions"`
			Leaks       int `json:"leaks"`
		}
		if jerr := json.Unmarshal(out, &check); jerr != nil {
			t.Fatalf("round %d: qemu-img check: %v %v\n%s", round, err, jerr, out)
		}
		if check.Corruptions != 0 {
			t.Fatalf("round %d: qemu-img check finds %d corruptions\n%s", round, check.Corruptions, out)
		}
		compareChecks(t, img) // blockexport check finds the same
		content := readAll(t, toRaw(t, img, dir))
		block := func(b int) []byte { return content[b*blockSize : (b+1)*blockSize] }
		checked, zeroes := 0, 0
		for b, v := range durable {
			if unsure[b] {
				continue
			}
			want := make([]byte, blockSize)
			if v != 0 {
				for j := 0; j < blockSize; j += 8 {
					binary.LittleEndian.PutUint64(want[j:], v)
				}
			} else {
				zeroes++
			}
			if !bytes.Equal(block(b), want) {
				t.Fatalf("round %d: block %d, acknowledged and flushed as %#x, reads back as %#x", round, b, v, binary.LittleEndian.Uint64(block(b)))
			}
			checked++
		}
		// What was in doubt is settled now: the next round starts from
		// what is on disk.
		for b := range unsure {
			durable[b] = binary.LittleEndian.Uint64(block(b))
			if durable[b] != 0 && !bytes.Equal(block(b)[:8], block(b)[blockSize-8:]) {
				t.Fatalf("round %d: block %d is torn: %#x...%#x", round, b, durable[b], binary.LittleEndian.Uint64(block(b)[blockSize-8:]))
			}
		}
		if round > 1 && (checked == 0 || zeroes == 0) {
			t.Fatalf("round %d: %d flushed blocks, %d of them punched, to check: the writers did not get going", round, checked, zeroes)
		}
		t.Logf("round %d: %d flushed blocks intact (%d punched), %d leaked clusters", round, checked, zeroes, check.Leaks)
	}
	// Leaks repaired by blockexport check, the image is clean and reads
	// as before.
	before := readAll(t, toRaw(t, img, dir))
	if code, res := checkJSON(t, bin, "check", "-r", "leaks", "--output=json", img); code != 0 {
		t.Fatalf("blockexport check -r leaks: exit %d %v", code, res)
	}
	qemuImgCheck(t, img)
	mustEqualBytes(t, "the image after its leaks were repaired", readAll(t, toRaw(t, img, dir)), before)
}

// TestQcow2GrowableExport: writes past the end grow the image, truncate
// shrinks it, and qemu-img info shows the size each time.
func TestQcow2GrowableExport(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "g.qcow2")
	createImage(t, "-f", "qcow2", img, "1M")
	virtualSize := func() int64 {
		var info struct {
			VirtualSize int64 `json:"virtual-size"`
		}
		out := run(t, "qemu-img", "info", "-U", "--output=json", img)
		if err := json.Unmarshal([]byte(out), &info); err != nil {
			t.Fatal(err)
		}
		return info.VirtualSize
	}
	mnt := filepath.Join(dir, "mnt")
	d := startExport(t, img, mnt, "-w", "--growable")
	f, err := os.OpenFile(mnt, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	tail := bytes.Repeat([]byte{0xab}, 64<<10)
	if _, err := f.WriteAt(tail, 3<<20); err != nil {
		t.Fatalf("write past the end of a growable export: %v", err)
	}
	if st, _ := f.Stat(); st.Size() != 3<<20+64<<10 {
		t.Fatalf("size %d after writing past the end", st.Size())
	}
	if got := virtualSize(); got != 3<<20+64<<10 {
		t.Fatalf("qemu-img info: virtual size %d after growing, want %d", got, 3<<20+64<<10)
	}
	if err := f.Truncate(2 << 20); err != nil {
		t.Fatal(err)
	}
	if got := virtualSize(); got != 2<<20 {
		t.Fatalf("qemu-img info: virtual size %d after truncate, want %d", got, 2<<20)
	}
	if _, err := f.WriteAt(tail[:4096], 2<<20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	d.stopClean()
	qemuImgCheck(t, img)
	got := readAll(t, toRaw(t, img, dir))
	want := append(make([]byte, 2<<20), tail[:4096]...)
	mustEqualBytes(t, "grown image", got, want)
}

// TestCreateCommand: images qemu-img accepts, sizes from the backing file,
// no overwriting without --force, and usage errors.
func TestCreateCommand(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "a.qcow2")
	empty := filepath.Join(dir, "empty.qcow2")
	createImage(t, "-f", "qcow2", empty, "0")
	qemuImgCheck(t, empty)
	for _, cs := range []string{"512", "4k", "64k", "2M"} {
		createImage(t, "-f", "qcow2", "--cluster-size", cs, "--force", img, "10G")
		qemuImgCheck(t, img)
		out := run(t, "qemu-img", "info", img)
		if !strings.Contains(out, "virtual size: 10 GiB") {
			t.Fatalf("qemu-img info after create --cluster-size %s:\n%s", cs, out)
		}
	}
	before := fileHash(t, img)
	if code, out := runBlockexport(t, "create", "-f", "qcow2", img, "1G"); code != 1 || !strings.Contains(out, "--force") {
		t.Fatalf("create over an existing file: exit %d, %q", code, out)
	}
	if fileHash(t, img) != before {
		t.Fatal("a refused create changed the existing file")
	}
	over := filepath.Join(dir, "over.qcow2")
	createImage(t, "-f", "qcow2", "-b", "a.qcow2", over)
	var info struct {
		VirtualSize   int64  `json:"virtual-size"`
		Backing       string `json:"backing-filename"`
		BackingFormat string `json:"backing-filename-format"`
	}
	if err := json.Unmarshal([]byte(run(t, "qemu-img", "info", "--output=json", over)), &info); err != nil {
		t.Fatal(err)
	}
	if info.VirtualSize != 10<<30 || info.Backing != "a.qcow2" || info.BackingFormat != "qcow2" {
		t.Fatalf("overlay: %+v", info)
	}
	rawImg := filepath.Join(dir, "r.raw")
	createImage(t, rawImg, "3M")
	if st, err := os.Stat(rawImg); err != nil || st.Size() != 3<<20 {
		t.Fatalf("raw image: %v", err)
	}
	for _, args := range [][]string{
		{"create", "-f", "qcow2", filepath.Join(dir, "x.qcow2"), "1000"},
		{"create", "-f", "qcow2", "--cluster-size", "3000", filepath.Join(dir, "x.qcow2"), "1M"},
		{"create", "-f", "vmdk", filepath.Join(dir, "x.img"), "1M"},
		{"create", filepath.Join(dir, "x.img")},
	} {
		if code, _ := runBlockexport(t, args...); code == 0 {
			t.Fatalf("%v succeeded", args)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "x.qcow2")); err == nil {
		t.Fatal("a refused create left a file behind")
	}
}

// TestQcow2HostFull: a qcow2 image on a host file system that fills up.
// Writes get ENOSPC (not EIO), what was written and flushed before reads
// back, the exporter keeps serving and exits, and the image is never
// corrupt (tmpfs has no FALLOC_FL_ZERO_RANGE: the fallback path runs).
func TestQcow2HostFull(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(smallHost(t, dir, "1m"), "full.qcow2")
	createImage(t, "-f", "qcow2", "--cluster-size", "4k", img, "8M")
	mnt := filepath.Join(dir, "mnt")
	d := startExport(t, img, mnt, "-w")
	f, err := os.OpenFile(mnt, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	first := bytes.Repeat([]byte{7}, 64<<10)
	if _, err := f.WriteAt(first, 0); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	block := bytes.Repeat([]byte{8}, 64<<10)
	var werr error
	for off := int64(64 << 10); off < 8<<20 && werr == nil; off += int64(len(block)) {
		_, werr = f.WriteAt(block, off)
	}
	if !errors.Is(werr, syscall.ENOSPC) {
		t.Fatalf("filling a full host: %v, want ENOSPC", werr)
	}
	got := make([]byte, len(first))
	if _, err := f.ReadAt(got, 0); err != nil || !bytes.Equal(got, first) {
		t.Fatalf("read after ENOSPC: %v", err)
	}
	f.Close()
	d.stop() // the last write-back may fail for want of space: exit 0 or 1
	if strings.Contains(d.log(), "panic") {
		t.Fatalf("the exporter panicked:\n%s", d.log())
	}
	out, _ := exec.Command("qemu-img", "check", "-f", "qcow2", "--output=json", img).Output()
	var check struct {
		Corruptions int `json:"corruptions"`
	}
	if err := json.Unmarshal(out, &check); err != nil || check.Corruptions != 0 {
		t.Fatalf("qemu-img check after ENOSPC: %v\n%s", err, out)
	}
	mustEqualBytes(t, "flushed data", readAll(t, toRaw(t, img, dir))[:len(first)], first)
}
