package fuse

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

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

// TestQcow2WritesThroughTheExport: a new image, an overlay over a backing
// file and a compressed image, each written through a writable export by
// a mirrored workload and by fio's verified jobs (4 KiB and 64 KiB, queue
// depth 16). QEMU then finds each image clean and reading exactly what
// was written; the backing file is untouched.
func TestQcow2WritesThroughTheExport(t *testing.T) {
	const size = 48 << 20
	newImage := func(t *testing.T, dir string) (string, string) {
		img := filepath.Join(dir, "new.qcow2")
		harness.CreateImage(t, "-f", "qcow2", img, strconv.Itoa(size))
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
			base := harness.RandomImage(t, dir, size, 21)
			img := filepath.Join(dir, "over.qcow2")
			harness.CreateImage(t, "-f", "qcow2", "-b", filepath.Base(base), "-F", "raw", img)
			return img, base
		}, nil},
		{"with an internal snapshot", func(t *testing.T, dir string) (string, string) {
			img := filepath.Join(dir, "snap.qcow2")
			harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", img, strconv.Itoa(size))
			harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x3c 0 40M", img)
			harness.Run(t, "qemu-img", "snapshot", "-c", "s1", img)
			return img, ""
		}, nil},
		{"compressed", func(t *testing.T, dir string) (string, string) {
			src := filepath.Join(dir, "src.raw")
			data := bytes.Repeat([]byte("a compressible line of text, over and over\n"), size/43+1)[:size]
			if err := os.WriteFile(src, data, 0o644); err != nil {
				t.Fatal(err)
			}
			img := filepath.Join(dir, "c.qcow2")
			harness.Run(t, "qemu-img", "convert", "-c", "-f", "raw", "-O", "qcow2", src, img)
			return img, ""
		}, nil},
	}
	for _, s := range setups {
		t.Run(s.name, func(t *testing.T) {
			t.Parallel() // each setup has its own image, mirror and export
			dir := t.TempDir()
			img, backing := s.make(t, dir)
			var backingHash [32]byte
			if backing != "" {
				backingHash = harness.FileHash(t, backing)
			}
			mirror := harness.ToRaw(t, img, dir)

			mnt := filepath.Join(dir, "mnt")
			d := harness.StartExport(t, img, mnt, append([]string{"-w"}, s.args...)...)
			mirrorWrites(t, mnt, mirror, size, 16, 60, 5)
			d.StopClean()
			harness.QemuImgCheck(t, img)
			harness.Run(t, "qemu-img", "compare", "-f", "qcow2", "-F", "raw", img, mirror)

			d = harness.StartExport(t, img, mnt, append([]string{"-w"}, s.args...)...)
			jobs := [][]string{harness.FioJob("small", "4k", "0", "24M", 1), harness.FioJob("large", "64k", "24M", "24M", 2)}
			for _, job := range jobs {
				harness.Run(t, "fio", append(job, "--io_size=12M", "--filename="+mnt)...)
			}
			d.StopClean()
			harness.QemuImgCheck(t, img)
			raw := harness.ToRaw(t, img, dir)
			for _, job := range jobs {
				harness.Run(t, "fio", append(job, "--io_size=12M", "--filename="+raw, "--verify_only")...)
			}
			if backing != "" && harness.FileHash(t, backing) != backingHash {
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
	harness.CreateImage(t, "-f", "qcow2", img, "128M")
	mnt := filepath.Join(dir, "export")
	d := harness.StartExport(t, img, mnt, "-w")
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
	d.StopClean()
	harness.QemuImgCheck(t, img)

	// A second, read-only export: the file system is clean and holds the
	// tree.
	mnt2 := filepath.Join(dir, "export2")
	harness.StartExport(t, img, mnt2)
	harness.Run(t, "e2fsck", "-fn", mnt2)
	checkTree(t, mnt2, filepath.Join(dir, "fs"), content)
}

// TestQcow2SurvivesKill9: the exporter is killed with SIGKILL at random
// moments while clients write, punch holes and fsync. Every time, qemu-img
// check finds no corruption (leaks are allowed), and every block reads
// back as the rule of [harness.WritesUnderKill] allows: what was synced
// exactly, what was written since as one of its values.
func TestQcow2SurvivesKill9(t *testing.T) {
	load := harness.KillLoad{BlockSize: 4096, Blocks: 8192, Writers: 4, SyncEvery: 16, PunchOneIn: 8} // 32 MiB
	dir := t.TempDir()
	img := filepath.Join(dir, "crash.qcow2")
	// 4 KiB clusters: many L2 tables and refcount updates per second.
	harness.CreateImage(t, "-f", "qcow2", "--cluster-size", "4k", img, strconv.Itoa(load.Blocks*load.BlockSize))
	writes := harness.NewWritesUnderKill(load)
	r := rand.New(rand.NewPCG(99, 99))
	for round := 1; round <= 6; round++ {
		mnt := filepath.Join(dir, fmt.Sprintf("mnt%d", round))
		writes.Round(t, round, img, mnt, time.Duration(50+r.IntN(400))*time.Millisecond)
		cmd := exec.Command("qemu-img", "check", "-f", "qcow2", "--output=json", img)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		var check struct {
			Corruptions int `json:"corruptions"`
			Leaks       int `json:"leaks"`
		}
		if jerr := json.Unmarshal(out, &check); jerr != nil {
			t.Fatalf("round %d: qemu-img check: %v %v\n%s%s", round, err, jerr, out, stderr.Bytes())
		}
		if check.Corruptions != 0 {
			t.Fatalf("round %d: qemu-img check finds %d corruptions\n%s", round, check.Corruptions, out)
		}
		harness.CompareChecks(t, img) // blockexport check finds the same
		got := writes.Check(t, round, harness.ReadAll(t, harness.ToRaw(t, img, dir)))
		if round > 1 && (got.Synced == 0 || got.Zeroes == 0) {
			t.Fatalf("round %d: %d synced blocks, %d of them zeroes, to check: the writers did not get going", round, got.Synced, got.Zeroes)
		}
		t.Logf("round %d: %v; %d leaked clusters", round, got, check.Leaks)
	}
	// Leaks repaired by blockexport check, the image is clean and reads
	// as before.
	before := harness.ReadAll(t, harness.ToRaw(t, img, dir))
	if code, res := harness.CheckJSON(t, harness.Bin, "check", "-r", "leaks", "--output=json", img); code != 0 {
		t.Fatalf("blockexport check -r leaks: exit %d %v", code, res)
	}
	harness.QemuImgCheck(t, img)
	harness.MustEqualBytes(t, "the image after its leaks were repaired", harness.ReadAll(t, harness.ToRaw(t, img, dir)), before)
}
