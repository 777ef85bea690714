package formats

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// vhdxInfo is qemu-img info's JSON of a VHDX image, less its name.
func vhdxInfo(t *testing.T, img string) map[string]any {
	t.Helper()
	m := harness.JSONOf(t, "qemu-img", "info", "-f", "vhdx", "--output=json", img).(map[string]any)
	delete(m, "filename")
	return m
}

// TestVhdxCreateEqualsQemuImg: create -f vhdx with qemu-img 7.2's -o keys
// makes what qemu-img makes (qemu-img info's JSON equal, the disk usage
// included: the same extents are written), qemu-img check finds it clean,
// and qemu-img and we read zeroes; every refusal is qemu-img's, one line,
// before a file is made.
func TestVhdxCreateEqualsQemuImg(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct{ size, opts string }{
		{"100M", ""}, {"0", ""}, {"3G", ""}, {"200G", ""}, {"64T", ""}, {"2500k", "subformat=fixed,block_size=1M"},
		{"20M", "subformat=fixed"}, {"20M", "subformat=fixed,block_state_zero=off"}, {"1G", "block_state_zero=off"},
		{"1G", "log_size=1536k,block_size=1536k"}, {"1G", "log_size=4M,block_size=512M"}, {"1G", "block_size=512k,log_size=512k"},
		{"1G", "preallocation=falloc,nocow=on,extent_size_hint=1M"}, {"10M", "subformat=dynamic,block_state_zero=on"},
		{"1G", "block_size=18446744073709551615,log_size=0x2M"},
	} {
		name := strings.NewReplacer("=", "-", ",", "-").Replace(c.size + "-" + c.opts)
		ours, theirs := filepath.Join(dir, name+".vhdx"), filepath.Join(dir, name+"-qemu.vhdx")
		args := []string{"-f", "vhdx"}
		if c.opts != "" {
			args = append(args, "-o", c.opts)
		}
		harness.CreateImage(t, append(args, ours, c.size)...)
		harness.Run(t, "qemu-img", append(append([]string{"create", "-q"}, args...), theirs, c.size)...)
		if got, want := vhdxInfo(t, ours), vhdxInfo(t, theirs); !reflect.DeepEqual(got, want) {
			t.Errorf("%s %s: info\n got %v\nwant %v", c.size, c.opts, got, want)
		}
		if code, out := exitOf(t, "qemu-img", "check", "-f", "vhdx", ours); code != 0 {
			t.Errorf("%s %s: qemu-img check exit %d\n%s", c.size, c.opts, code, out)
		}
		if c.size != "0" && !strings.HasSuffix(c.size, "T") && !strings.HasSuffix(c.size, "00G") {
			blank := filepath.Join(dir, "blank.raw")
			harness.Run(t, "qemu-img", "create", "-q", "-f", "raw", blank, c.size)
			harness.Run(t, "qemu-img", "compare", "-q", "-f", "raw", "-F", "vhdx", blank, ours)
			if code, out := harness.RunBlockexport(t, "compare", blank, ours); code != 0 {
				t.Errorf("%s %s: our compare with zeroes: exit %d\n%s", c.size, c.opts, code, out)
			}
			os.Remove(blank)
		}
		os.Remove(ours)
		os.Remove(theirs)
	}
	for _, c := range [][]string{
		{"-o", "subformat=Fixed", "1M"}, {"-o", "block_size=3M", "1G"}, {"-o", "block_size=-1", "1G"}, {"-o", "block_size=big", "1G"},
		{"-o", "log_size=0", "1G"}, {"-o", "log_size=8G", "1G"}, {"-o", "block_state_zero=maybe", "1G"}, {"-o", "foo=1", "1G"},
		{"-o", "cluster_size=1M", "1G"}, {"-o", "preallocation=metadata", "1G"}, {"-o", "nocow=x", "1G"}, {"-o", "subformat=dynamic", "65T"}, {"-o", "block_size=16E", "1G"}, {"-o", "log_size=0x1.5M", "1G"},
		{"-b", "base.vhdx", "1G"},
	} {
		p := filepath.Join(dir, "refused.vhdx")
		qcode, qout := exitOf(t, "qemu-img", append(append([]string{"create", "-q", "-f", "vhdx"}, c[:2]...), p, c[2])...)
		os.Remove(p) // qemu-img leaves an empty file behind for some
		code, out := harness.RunBlockexport(t, append(append([]string{"create", "-f", "vhdx"}, c[:2]...), p, c[2])...)
		if qcode == 0 || code == 0 || strings.Count(strings.TrimSpace(out), "\n") != 0 {
			t.Errorf("%v: exit %d (qemu-img %d), want a one-line refusal:\n%s", c, code, qcode, out)
		}
		// qemu-img's words: its message after "qemu-img: PATH: ".
		words := qout[strings.LastIndex(strings.SplitN(qout, "\n", 2)[0], ": ")+2:]
		if words = strings.SplitN(words, "\n", 2)[0]; !strings.Contains(out, words) {
			t.Errorf("%v: %q, want qemu-img's words %q", c, out, words)
		}
		if _, err := os.Stat(p); err == nil {
			t.Errorf("%v: a refused create left a file", c)
		}
	}
}

// TestVhdxConvertReadsBack: convert -O vhdx (dynamic, fixed, without
// ZERO blocks, 1 MiB blocks, O_DIRECT with parallel out-of-order writes)
// of a raw disk with holes and zero runs and of its qcow2: qemu-img
// compare finds the source's bytes, qemu-img check finds it clean, and
// our compare agrees; convert -n then writes another disk into the
// last one in place, which qemu-img reads back, check clean.
func TestVhdxConvertReadsBack(t *testing.T) {
	dir := t.TempDir()
	src := vdiRawWithHoles(t, dir)
	qsrc := filepath.Join(dir, "src.qcow2")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "qcow2", src, qsrc)
	for _, c := range []struct {
		opts string
		args []string
	}{
		{"", nil}, {"subformat=fixed", nil}, {"subformat=fixed,block_state_zero=off", nil}, {"block_state_zero=off,block_size=1M", nil},
		{"", []string{"-t", "none", "-W", "-m", "8"}}, {"subformat=fixed", []string{"-t", "none", "-W", "-m", "8"}},
	} {
		for _, from := range []string{src, qsrc} {
			img := filepath.Join(dir, "c.vhdx")
			args := append([]string{"convert", "-O", "vhdx"}, c.args...)
			if c.opts != "" {
				args = append(args, "-o", c.opts)
			}
			if code, out := harness.RunBlockexport(t, append(args, from, img)...); code != 0 {
				t.Fatalf("convert %v: exit %d\n%s", args, code, out)
			}
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "vhdx", src, img)
			if code, out := exitOf(t, "qemu-img", "check", "-f", "vhdx", img); code != 0 {
				t.Errorf("%v %s: qemu-img check exit %d\n%s", args, from, code, out)
			}
			if code, out := harness.RunBlockexport(t, "compare", src, img); code != 0 {
				t.Errorf("%v %s: our compare: exit %d\n%s", args, from, code, out)
			}
			// qemu-img's conversion has the same virtual and block size
			// (its disk usage differs: it appends a fixed disk's blocks).
			qimg := filepath.Join(dir, "q.vhdx")
			qargs := []string{"convert", "-O", "vhdx"}
			if c.opts != "" {
				qargs = append(qargs, "-o", c.opts)
			}
			harness.Run(t, "qemu-img", append(qargs, from, qimg)...)
			got, want := vhdxInfo(t, img), vhdxInfo(t, qimg)
			delete(got, "actual-size")
			delete(want, "actual-size")
			if !reflect.DeepEqual(got, want) {
				t.Errorf("%v %s: info\n got %v\nwant %v", args, from, got, want)
			}
		}
	}
	// convert -n writes the existing image in place (through its log).
	img := filepath.Join(dir, "c.vhdx")
	other := filepath.Join(dir, "other.raw")
	vhdxCopy(t, src, other)
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x5c 1M 3M", "-c", "write -z 0 64k", other)
	if code, out := harness.RunBlockexport(t, "convert", "-n", "-f", "raw", "-O", "vhdx", other, img); code != 0 {
		t.Fatalf("convert -n into a VHDX: exit %d\n%s", code, out)
	}
	harness.Run(t, "qemu-img", "check", "-f", "vhdx", img)
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "vhdx", other, img)
}

// vhdxCopy copies the file src to dst.
func vhdxCopy(t *testing.T, src, dst string) {
	t.Helper()
	harness.Run(t, "cp", "--sparse=always", src, dst)
}

// vhdxWriteOps are qemu-io commands written both into a VHDX image in
// place and into a raw copy of its disk: allocations, writes across a
// 1 MiB block boundary and to the disk's end, zeroes of whole and part
// blocks (the disk is 64 MiB).
var vhdxWriteOps = []string{
	"write -P 0x11 0 4096",
	"write -P 0x22 1048000 5000",
	"write -P 0x33 40M 3M",
	"write -z 8M 2M",
	"write -P 0x44 67107840 1024",
	"write -z 20M 100k",
	"write -P 0x55 33554431 2",
	"write -z -u 48M 8M",
}

// vhdxWritesEqualARawCopy writes vhdxWriteOps into a copy of img, half
// through a FUSE export (fuse -w), half over NBD (nbd -w), and the same
// into a raw copy of src, its disk: then qemu-img check finds the copy
// clean and qemu-img compare finds it identical to the raw copy.
func vhdxWritesEqualARawCopy(t *testing.T, img, src string) {
	t.Helper()
	dir := t.TempDir()
	w, raw := filepath.Join(dir, "w.vhdx"), filepath.Join(dir, "w.raw")
	vhdxCopy(t, img, w)
	vhdxCopy(t, src, raw)
	half := len(vhdxWriteOps) / 2
	mnt := filepath.Join(dir, "wmnt")
	d := harness.StartExport(t, w, mnt, "-w")
	for _, op := range vhdxWriteOps[:half] {
		harness.Run(t, "qemu-io", "-f", "raw", "-c", op, mnt)
		harness.Run(t, "qemu-io", "-f", "raw", "-c", op, raw)
	}
	d.StopClean()
	srv := harness.StartNBD(t, w, false, "-w")
	for _, op := range vhdxWriteOps[half:] {
		harness.Run(t, "qemu-io", "-f", "raw", "-c", op, srv.URI)
		harness.Run(t, "qemu-io", "-f", "raw", "-c", op, raw)
	}
	srv.StopClean()
	harness.Run(t, "qemu-img", "check", "-f", "vhdx", w)
	harness.Run(t, "qemu-img", "compare", "-f", "vhdx", "-F", "raw", w, raw)
}

// TestVhdxWrittenByQemuThenByUs: an image QEMU wrote in place (qemu-io
// through its log) is written here in place, and an image written here is
// written again by QEMU: each reads back what both wrote (qemu-img
// compare with a raw copy written the same way), qemu-img check clean.
func TestVhdxWrittenByQemuThenByUs(t *testing.T) {
	dir := t.TempDir()
	img, raw := filepath.Join(dir, "d.vhdx"), filepath.Join(dir, "d.raw")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "vhdx", "-o", "block_size=1M", img, "64M")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "raw", raw, "64M")
	for _, op := range []string{"write -P 0x61 1M 3M", "write -P 0x62 30M 4k"} {
		harness.Run(t, "qemu-io", "-f", "vhdx", "-c", op, img)
		harness.Run(t, "qemu-io", "-f", "raw", "-c", op, raw)
	}
	vhdxWritesEqualARawCopy(t, img, raw)
	// The other way: ours, then QEMU's.
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, img, mnt, "-w")
	for _, op := range []string{"write -P 0x63 2M 2M", "write -P 0x64 50M 1M"} {
		harness.Run(t, "qemu-io", "-f", "raw", "-c", op, mnt)
		harness.Run(t, "qemu-io", "-f", "raw", "-c", op, raw)
	}
	d.StopClean()
	for _, op := range []string{"write -P 0x65 2M 4k", "write -P 0x66 60M 1M"} {
		harness.Run(t, "qemu-io", "-f", "vhdx", "-c", op, img)
		harness.Run(t, "qemu-io", "-f", "raw", "-c", op, raw)
	}
	harness.Run(t, "qemu-img", "check", "-f", "vhdx", img)
	harness.Run(t, "qemu-img", "compare", "-f", "vhdx", "-F", "raw", img, raw)
}

// TestVhdxSurvivesKill9: the exporter (fuse -w) of a fresh dynamic VHDX
// of 1 MiB blocks is killed with SIGKILL (three times) at a random moment while
// writers write 4 KiB blocks over the disk (most allocate a block: a BAT
// change through the log at the next fsync), punch holes (whole-block
// ones change the BAT too) and fsync. Each time: QEMU replays what the
// log holds (qemu-img check -r all on a copy, exit 0) and reads back
// every block acknowledged before its writer's last successful fsync and
// not touched since; our check -r all on another copy exits and counts
// as qemu-img's and leaves the same disk; our export of the next round
// replays the image itself.
func TestVhdxSurvivesKill9(t *testing.T) {
	const (
		blockSize = 4096
		perMiB    = 32 // MiBs in the disk
		writers   = 4
	)
	dir := t.TempDir()
	img := filepath.Join(dir, "crash.vhdx")
	harness.CreateImage(t, "-f", "vhdx", "-o", "block_size=1M", img, "32M")
	durable := map[int]uint64{}
	r := rand.New(rand.NewPCG(53, 53))
	qcopy, ocopy := filepath.Join(dir, "q.vhdx"), filepath.Join(dir, "o.vhdx")
	for round := 1; round <= 3; round++ {
		mnt := filepath.Join(dir, fmt.Sprintf("mnt%d", round))
		d := harness.StartExport(t, img, mnt, "-w")
		f, err := os.OpenFile(mnt, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		var mu sync.Mutex
		var wg sync.WaitGroup
		for w := range writers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				wr := rand.New(rand.NewPCG(uint64(round), uint64(w)))
				buf := make([]byte, blockSize)
				pending := map[int]uint64{}
				for seq := uint64(1); ; seq++ {
					// Each writer has its own MiBs (VHDX blocks), so that
					// a whole block it zeroes holds only its own writes.
					b := (w+writers*wr.IntN(perMiB/writers))*256 + wr.IntN(256)
					v := uint64(round)<<40 | uint64(b)<<20 | seq
					mu.Lock()
					delete(durable, b) // unsure until synced
					mu.Unlock()
					whole := false
					switch wr.IntN(16) {
					case 0: // a whole 1 MiB block zeroed: its BAT entry ZERO
						b -= b % 256
						v, whole = 0, true
						mu.Lock()
						for i := b; i < b+256; i++ {
							delete(durable, i)
						}
						mu.Unlock()
						if err := syscall.Fallocate(int(f.Fd()), 0x01|0x02, int64(b)*blockSize, 256*blockSize); err != nil {
							return
						}
					case 1:
						v = 0
						if err := syscall.Fallocate(int(f.Fd()), 0x01|0x02, int64(b)*blockSize, blockSize); err != nil {
							return
						}
					default:
						for j := 0; j < blockSize; j += 8 {
							binary.LittleEndian.PutUint64(buf[j:], v)
						}
						if _, err := f.WriteAt(buf, int64(b)*blockSize); err != nil {
							return
						}
					}
					pending[b] = v
					if whole {
						for i := b + 1; i < b+256; i++ {
							if _, ok := pending[i]; ok {
								pending[i] = 0
							}
						}
					}
					if seq%8 == 0 {
						if err := f.Sync(); err != nil {
							return
						}
						mu.Lock()
						for pb, pv := range pending {
							durable[pb] = pv
						}
						mu.Unlock()
						clear(pending)
					}
				}
			}()
		}
		time.Sleep(time.Duration(150+r.IntN(300)) * time.Millisecond)
		d.Cmd.Process.Signal(syscall.SIGKILL)
		wg.Wait()
		f.Close()
		d.Wait(10 * time.Second)
		syscall.Unmount(mnt, syscall.MNT_DETACH)
		harness.WaitUnlocked(t, img)

		vhdxCopy(t, img, qcopy)
		vhdxCopy(t, img, ocopy)
		if code, _ := exitOf(t, "qemu-img", "check", "-f", "vhdx", qcopy); code != 0 {
			t.Logf("round %d: killed with a log to replay (qemu-img check without -r: exit %d)", round, code)
		}
		// check -r all, ours and QEMU's, on copies: the same exit (0),
		// the same counts, the same disk.
		qcode, qjson := vhdxCheckOf(t, "qemu-img", "-r", "all", "-f", "vhdx", qcopy)
		ocode, ojson := vhdxCheckOf(t, harness.Bin, "-r", "all", ocopy)
		delete(qjson, "filename")
		delete(ojson, "filename")
		if qcode != 0 || ocode != qcode || !reflect.DeepEqual(ojson, qjson) {
			t.Fatalf("round %d: check -r all: exit %d %v, qemu-img's exit %d %v", round, ocode, ojson, qcode, qjson)
		}
		harness.Run(t, "qemu-img", "compare", "-f", "vhdx", "-F", "vhdx", ocopy, qcopy)
		raw := filepath.Join(dir, fmt.Sprintf("round%d.raw", round))
		harness.Run(t, "qemu-img", "convert", "-f", "vhdx", "-O", "raw", qcopy, raw)
		content := harness.ReadAll(t, raw)
		checked := 0
		for b, v := range durable {
			got := binary.LittleEndian.Uint64(content[b*blockSize:])
			if got != v || !bytes.Equal(content[b*blockSize:b*blockSize+8], content[(b+1)*blockSize-8:(b+1)*blockSize]) {
				t.Fatalf("round %d: block %d reads %#x, fsynced %#x", round, b, got, v)
			}
			checked++
		}
		t.Logf("round %d: %d fsynced blocks read back", round, checked)
		if round == 1 && checked == 0 {
			t.Fatal("no write was fsynced before the kill: nothing was checked")
		}
		os.Remove(raw)
	}
}
