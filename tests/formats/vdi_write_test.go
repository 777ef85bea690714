package formats

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// infoWithoutFilename is info --output=json of img by qemu-img, less the
// file's name.
func infoWithoutFilename(t *testing.T, img string) map[string]any {
	t.Helper()
	m, ok := harness.JSONOf(t, "qemu-img", "info", "--output=json", img).(map[string]any)
	if !ok {
		t.Fatalf("qemu-img info of %s: not an object", img)
	}
	delete(m, "filename")
	return m
}

// vdiCheckClean fails the test unless qemu-img check finds img clean.
func vdiCheckClean(t *testing.T, img string) {
	t.Helper()
	if out, err := exec.Command("qemu-img", "check", "-f", "vdi", img).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img check %s: %v\n%s", img, err, out)
	}
}

// TestVdiCreateAsQemuImg: create -f vdi with qemu-img's options makes an
// image whose qemu-img info equals that of qemu-img create's for the same
// command, which qemu-img check finds clean; what qemu-img refuses is
// refused, and leaves no file.
func TestVdiCreateAsQemuImg(t *testing.T) {
	dir := t.TempDir()
	for i, args := range [][]string{
		{"8M"}, {"-o", "static=on", "8M"}, {"0"}, {"1000"}, {"-o", "static=on", "1"},
		{"-o", "preallocation=full,nocow=on,extent_size_hint=1M", "3M"}, {"-o", "static=off", "100G"},
		{"-o", "size=5M"}, {"-o", "static=on,size=2M"},
	} {
		ours, theirs := filepath.Join(dir, fmt.Sprintf("o%d.vdi", i)), filepath.Join(dir, fmt.Sprintf("q%d.vdi", i))
		opts, size := args, []string(nil)
		if !strings.HasPrefix(args[len(args)-1], "size=") && !strings.HasPrefix(args[len(args)-1], "static=") {
			opts, size = args[:len(args)-1], args[len(args)-1:]
		}
		harness.Run(t, "qemu-img", append(append(append([]string{"create", "-q", "-f", "vdi"}, opts...), theirs), size...)...)
		if code, out := harness.RunBlockexport(t, append(append(append([]string{"create", "-f", "vdi"}, opts...), ours), size...)...); code != 0 {
			t.Fatalf("create %v: exit %d\n%s", args, code, out)
		}
		if got, want := infoWithoutFilename(t, ours), infoWithoutFilename(t, theirs); !reflect.DeepEqual(got, want) {
			t.Errorf("create %v: qemu-img info\n%v\nwant (qemu-img create's)\n%v", args, got, want)
		}
		vdiCheckClean(t, ours)
		var so, sq unix.Stat_t
		unix.Stat(ours, &so)
		unix.Stat(theirs, &sq)
		if so.Size != sq.Size {
			t.Errorf("create %v: a file of %d bytes, qemu-img's %d", args, so.Size, sq.Size)
		}
	}
	for _, args := range [][]string{
		{"-o", "static=maybe", "1M"}, {"-o", "cluster_size=2M", "1M"}, {"-o", "preallocation=metadata", "1M"},
		{"-o", "subformat=fixed", "1M"}, {"-o", "backing_file=x.vdi", "1M"}, {"5000T"},
	} {
		p := filepath.Join(dir, "refused.vdi")
		if out, err := exec.Command("qemu-img", append(append([]string{"create", "-q", "-f", "vdi"}, args[:len(args)-1]...), p, args[len(args)-1])...).CombinedOutput(); err == nil {
			t.Fatalf("qemu-img create %v succeeds:\n%s", args, out)
		}
		os.Remove(p)
		code, out := harness.RunBlockexport(t, append(append([]string{"create", "-f", "vdi"}, args[:len(args)-1]...), p, args[len(args)-1])...)
		if code == 0 || strings.Count(strings.TrimSpace(out), "\n") != 0 {
			t.Errorf("create %v: exit %d, want a one-line refusal:\n%s", args, code, out)
		}
		if _, err := os.Stat(p); err == nil {
			t.Errorf("create %v: refused, but left a file", args)
		}
	}
}

// vdiAllocated is the header's count of allocated blocks.
func vdiAllocated(t *testing.T, img string) uint32 {
	t.Helper()
	f, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 4)
	if _, err := f.ReadAt(b, vdiBlocksAlloc); err != nil {
		t.Fatal(err)
	}
	return binary.LittleEndian.Uint32(b)
}

// TestVdiConvertReadsBackIdentical: convert -O vdi, dynamic and static,
// through the page cache and O_DIRECT, and convert -n into a VDI qemu-img
// made, give images qemu-img compare finds identical to the source and
// qemu-img check clean; a dynamic image allocates no block of zeroes.
func TestVdiConvertReadsBackIdentical(t *testing.T) {
	dir := t.TempDir()
	src := vdiRawWithHoles(t, dir)
	for _, c := range []struct {
		name string
		args []string
	}{
		{"dynamic", nil}, {"static", []string{"-o", "static=on"}}, {"dynamic O_DIRECT", []string{"-t", "none"}},
		{"static writeback", []string{"-o", "static=on", "-t", "writeback"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			dst := filepath.Join(t.TempDir(), "c.vdi")
			if code, out := harness.RunBlockexport(t, append(append([]string{"convert", "-f", "raw", "-O", "vdi"}, c.args...), src, dst)...); code != 0 {
				t.Fatalf("convert: exit %d\n%s", code, out)
			}
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "vdi", src, dst)
			vdiCheckClean(t, dst)
			ref := filepath.Join(t.TempDir(), "q.vdi")
			harness.Run(t, "qemu-img", append(append([]string{"convert", "-f", "raw", "-O", "vdi"}, c.args...), src, ref)...)
			ours, theirs := vdiAllocated(t, dst), vdiAllocated(t, ref)
			if ours > theirs {
				t.Errorf("%d blocks allocated, qemu-img's %d: blocks of zeroes allocated", ours, theirs)
			}
		})
	}
	t.Run("into an existing image", func(t *testing.T) {
		dst := filepath.Join(t.TempDir(), "n.vdi")
		harness.Run(t, "qemu-img", "create", "-q", "-f", "vdi", dst, "64M")
		if code, out := harness.RunBlockexport(t, "convert", "-n", "-f", "raw", "-O", "vdi", src, dst); code != 0 {
			t.Fatalf("convert -n: exit %d\n%s", code, out)
		}
		harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "vdi", src, dst)
		vdiCheckClean(t, dst)
	})
}

// vdiIoScript is a qemu-io command list: writes that allocate, writes in
// place and across blocks, zeroes over data and over nothing, discards,
// flushes, and two writes in flight at once that allocate one block
// (side by side: overlapping ones may land in either order, and two
// writers of the same script would then differ by chance).
var vdiIoScript = []string{
	"write -P 0x11 0 4k", "write -P 0x22 1020k 8k", "write -P 0x33 10M 64k", "write -z 10M 4k",
	"write -z 20M 2M", "flush", "discard 1M 1M", "write -P 0x44 63M 1M", "write -P 0x55 5M 3M",
	"write -z -u 6M 1M", "aio_write -P 0x66 30M 4k", "aio_write -P 0x67 30724k 4k", "aio_flush", "flush",
}

func qemuIoArgs(script []string) []string {
	var a []string
	for _, c := range script {
		a = append(a, "-c", c)
	}
	return a
}

// TestVdiWritesThroughExportsAsQemuWritesThem: the same writes, zeroes
// and discards through nbd -w and through QEMU's own vdi driver leave
// images qemu-img compare finds identical, both clean (dynamic and
// static); through fuse -w (page cache and O_DIRECT) fio's verified
// random writes read back through a second, read-only export, a punched
// hole reads as zeroes, a truncate is refused, and the image is clean.
func TestVdiWritesThroughExportsAsQemuWritesThem(t *testing.T) {
	for _, static := range []string{"off", "on"} {
		t.Run("static="+static, func(t *testing.T) {
			dir := t.TempDir()
			ours, ref := filepath.Join(dir, "w.vdi"), filepath.Join(dir, "r.vdi")
			harness.Run(t, "qemu-img", "create", "-q", "-f", "vdi", "-o", "static="+static, ours, "64M")
			harness.Run(t, "qemu-img", "create", "-q", "-f", "vdi", "-o", "static="+static, ref, "64M")
			srv := harness.StartNBD(t, ours, false, "-w")
			harness.Run(t, "qemu-io", append(append([]string{"-f", "raw"}, qemuIoArgs(vdiIoScript)...), srv.URI)...)
			srv.StopClean()
			harness.Run(t, "qemu-io", append(append([]string{"-f", "vdi"}, qemuIoArgs(vdiIoScript)...), ref)...)
			harness.Run(t, "qemu-img", "compare", "-f", "vdi", "-F", "vdi", ours, ref)
			vdiCheckClean(t, ours)
			vdiCheckClean(t, ref)

			for _, cache := range []string{"writeback", "none"} {
				mnt := filepath.Join(dir, "mnt-"+cache)
				e := harness.StartExport(t, ours, mnt, "-w", "--cache", cache)
				harness.Run(t, "fio", append(harness.FioJob("vdi", "4k", "0", "32M", 47), "--io_size=3M", "--filename="+mnt)...)
				fd, err := os.OpenFile(mnt, os.O_RDWR, 0)
				if err != nil {
					t.Fatal(err)
				}
				if err := unix.Fallocate(int(fd.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 40<<20, 3<<20); err != nil {
					t.Fatalf("punch a hole through the export: %v", err)
				}
				if err := fd.Truncate(128 << 20); err == nil {
					t.Error("a truncate of the export was taken: QEMU cannot resize a vdi")
				}
				hole := make([]byte, 3<<20)
				if _, err := fd.ReadAt(hole, 40<<20); err != nil || strings.Trim(string(hole), "\x00") != "" {
					t.Fatalf("the punched hole does not read as zeroes (%v)", err)
				}
				fd.Close()
				e.StopClean()
				vdiCheckClean(t, ours)
				rmnt := filepath.Join(dir, "rmnt-"+cache)
				r := harness.StartExport(t, ours, rmnt, "-w") // fio opens for writing, and only reads
				harness.Run(t, "fio", append(harness.FioJob("vdi", "4k", "0", "32M", 47), "--io_size=3M", "--verify_only", "--filename="+rmnt)...)
				r.StopClean()
			}
		})
	}
}

var wroteLine = regexp.MustCompile(`^wrote (\d+)/\d+ bytes at offset (\d+)`)

// TestVdiNbdWriterKilledKeepsFlushedWrites: `nbd -w` SIGKILLed while a
// client writes (each write allocating a block or writing in place, each
// followed by a flush) leaves an image qemu-img check finds clean, in
// which every write a later write's success shows was flushed reads back
// (qemu-io's pattern check); the image then takes writes again. A few
// kills at random moments.
func TestVdiNbdWriterKilledKeepsFlushedWrites(t *testing.T) {
	rng := rand.New(rand.NewPCG(47, 7))
	killed := 0
	for iter := 0; iter < 4; iter++ {
		dir := t.TempDir()
		img := filepath.Join(dir, "k.vdi")
		harness.Run(t, "qemu-img", "create", "-q", "-f", "vdi", img, "256M")
		srv := harness.StartNBD(t, img, false, "-w")
		var script []string
		pattern := map[int64]int{} // offset -> pattern
		for i := 0; i < 200; i++ {
			off := int64(i%120)<<20 + int64(i/120)*8192 // 120 allocations, then writes in place, each offset once
			p := 1 + i%250
			script = append(script, fmt.Sprintf("write -P %d %d 4k", p, off), "flush")
			pattern[off] = p
		}
		// Killed once the client has seen a random number of writes
		// done: mid-way through allocations, or through writes in place.
		// stdbuf: qemu-io's lines as they happen, not 4 KiB at a time.
		cmd := exec.Command("stdbuf", append(append([]string{"-oL", "qemu-io", "-f", "raw"}, qemuIoArgs(script)...), srv.URI)...)
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		cmd.Stderr = cmd.Stdout
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		killAt := 5 + rng.IntN(150)
		var wrote []int64
		lines := bufio.NewScanner(stdout)
		for lines.Scan() {
			if m := wroteLine.FindStringSubmatch(lines.Text()); m != nil {
				off, _ := strconv.ParseInt(m[2], 10, 64)
				wrote = append(wrote, off)
				if len(wrote) == killAt {
					srv.Cmd.Process.Signal(syscall.SIGKILL)
				}
			}
		}
		cmd.Wait()
		srv.Cmd.Process.Signal(syscall.SIGKILL) // if the client finished first
		select {
		case <-srv.Exited:
		case <-time.After(10 * time.Second):
			t.Fatal("the killed server did not exit")
		}
		harness.WaitUnlocked(t, img)
		if len(wrote) < len(script)/2 {
			killed++
		}
		vdiCheckClean(t, img)
		// Write k+1 succeeded: the flush after write k did (every
		// offset is written once).
		var checks []string
		for _, off := range wrote[:max(0, len(wrote)-1)] {
			checks = append(checks, fmt.Sprintf("read -P %d %d 4k", pattern[off], off))
		}
		if len(checks) > 0 {
			res := harness.Run(t, "qemu-io", append(append([]string{"-r", "-f", "vdi"}, qemuIoArgs(checks)...), img)...)
			if strings.Contains(res, "Pattern verification failed") {
				t.Fatalf("iteration %d: a flushed write does not read back:\n%s", iter, res)
			}
		}
		again := harness.StartNBD(t, img, false, "-w")
		harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0xee 200M 4k", "-c", "flush", again.URI)
		again.StopClean()
		vdiCheckClean(t, img)
		t.Logf("iteration %d: %d of %d writes acknowledged before the kill", iter, len(wrote), len(script)/2)
	}
	if killed == 0 {
		t.Fatal("every client finished more than half its writes before the kill: no crash mid-way was tested")
	}
}

// TestVdiFromXmountReadsAndWrites: a VDI view xmount (an independent
// writer, Debian's xmount) makes of a raw disk puts its data at 0x380,
// right after the block map, which QEMU 7.2 refuses ("unaligned data
// offset"). It reads here as the raw disk, checks clean, takes writes
// through nbd -w as a raw copy takes them, and an O_DIRECT writable open
// is refused in one line (the map's last sector holds data).
func TestVdiFromXmountReadsAndWrites(t *testing.T) {
	if _, err := exec.LookPath("xmount"); err != nil {
		t.Fatal("xmount is needed: apt-get install -y xmount")
	}
	dir := t.TempDir()
	raw := harness.RandomImage(t, dir, 96<<20, 380)
	f, err := os.OpenFile(raw, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt(make([]byte, 20<<20), 30<<20) // zeroes in the middle
	f.Close()
	mnt := filepath.Join(dir, "xm")
	os.Mkdir(mnt, 0o755)
	harness.Run(t, "xmount", "--in", "raw", raw, "--out", "vdi", mnt)
	t.Cleanup(func() {
		if harness.IsFuseMount(mnt) {
			syscall.Unmount(mnt, syscall.MNT_DETACH)
		}
	})
	img := filepath.Join(dir, "x.vdi")
	view := filepath.Join(mnt, strings.TrimSuffix(filepath.Base(raw), filepath.Ext(raw))+".vdi")
	// xmount's daemon may answer a moment after it returns.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if _, err := os.Stat(view); err == nil {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("xmount's view %s: %v", view, err)
		}
	}
	harness.Run(t, "cp", "--sparse=always", view, img)
	for try := 0; ; try++ {
		err := syscall.Unmount(mnt, 0)
		if err == nil {
			break
		}
		if try == 100 {
			t.Fatalf("unmount xmount's view: %v", err)
		}
		time.Sleep(50 * time.Millisecond) // EBUSY while cp's close is answered
	}
	b := harness.ReadAll(t, img)
	if off := uint32(b[vdiOffData]) | uint32(b[vdiOffData+1])<<8; off != 0x380 {
		t.Fatalf("xmount's data offset is %#x, the test expects 0x380", off)
	}
	if out, err := exec.Command("qemu-img", "info", "-f", "vdi", img).CombinedOutput(); err == nil || !strings.Contains(string(out), "unaligned data offset 0x380") {
		t.Fatalf("qemu-img 7.2 opens it, or refuses it otherwise (%v):\n%s", err, out)
	}
	if code, out := harness.RunBlockexport(t, "compare", "-f", "vdi", "-F", "raw", img, raw); code != 0 {
		t.Fatalf("compare: exit %d\n%s", code, out)
	}
	if code, out := harness.RunBlockexport(t, "check", img); code != 0 {
		t.Fatalf("check: exit %d\n%s", code, out)
	}
	// A discard leaves the vdi as it was and punches the raw file.
	var script []string
	for _, c := range vdiIoScript {
		if !strings.HasPrefix(c, "discard") {
			script = append(script, c)
		}
	}
	srv := harness.StartNBD(t, img, false, "-w")
	harness.Run(t, "qemu-io", append(append([]string{"-f", "raw"}, qemuIoArgs(script)...), srv.URI)...)
	srv.StopClean()
	harness.Run(t, "qemu-io", append(append([]string{"-f", "raw"}, qemuIoArgs(script)...), raw)...)
	if code, out := harness.RunBlockexport(t, "compare", "-f", "vdi", "-F", "raw", img, raw); code != 0 {
		t.Fatalf("compare after the writes: exit %d\n%s", code, out)
	}
	if code, out := harness.RunBlockexport(t, "check", img); code != 0 {
		t.Fatalf("check after the writes: exit %d\n%s", code, out)
	}
	wmnt := filepath.Join(dir, "wmnt")
	os.Mkdir(wmnt, 0o755)
	if code, out := harness.TryExport(t, wmnt, "-w", "--cache", "none", img); code != 1 || strings.Count(strings.TrimSpace(out), "\n") != 0 || !strings.Contains(out, "O_DIRECT") {
		t.Fatalf("fuse -w --cache none: exit %d, want 1 and one line naming O_DIRECT:\n%s", code, out)
	}
}

// TestVdiResizeRefusedAsQemuImg: qemu-img 7.2 cannot resize a vdi; resize
// refuses it in the same words and exit status, the file untouched.
func TestVdiResizeRefusedAsQemuImg(t *testing.T) {
	img := filepath.Join(t.TempDir(), "r.vdi")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "vdi", img, "4M")
	before := harness.FileHash(t, img)
	for _, args := range [][]string{{img, "+1M"}, {"-f", "vdi", img, "8M"}, {"--shrink", img, "1M"}} {
		q := exec.Command("qemu-img", append([]string{"resize"}, args...)...)
		qout, _ := q.CombinedOutput()
		code, out := harness.RunBlockexport(t, append([]string{"resize"}, args...)...)
		want := strings.TrimPrefix(strings.TrimSpace(string(qout)), "qemu-img: ")
		if code != q.ProcessState.ExitCode() || !strings.Contains(out, want) {
			t.Errorf("resize %v: exit %d %q; qemu-img's %d %q", args, code, out, q.ProcessState.ExitCode(), want)
		}
	}
	if harness.FileHash(t, img) != before {
		t.Fatal("a refused resize changed the file")
	}
}
