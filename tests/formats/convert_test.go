package formats

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// convertSource writes a raw image of size bytes with holes, runs of zero
// bytes stored as data, runs of one repeated byte (compressible) and
// random data, in 4 KiB to 1 MiB pieces at sector-aligned offsets.
func convertSource(t *testing.T, dir, name string, size int64, seed uint64) string {
	t.Helper()
	path := filepath.Join(dir, name)
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(seed, 0xc0))
	for range 48 {
		off := r.Int64N(size) &^ 511
		n := min([]int64{4096, 65536, 300 << 10, 1 << 20, 1500}[r.IntN(5)], size-off)
		buf := make([]byte, n)
		switch r.IntN(3) {
		case 0: // zeroes written as data
		case 1:
			for i := range buf {
				buf[i] = byte(r.IntN(4) + 'a')
			}
		default:
			for i := range buf {
				buf[i] = byte(r.Uint32())
			}
		}
		if _, err := f.WriteAt(buf, off); err != nil {
			t.Fatal(err)
		}
	}
	return path
}

// qemuCompare runs qemu-img compare and fails the test unless the
// images are identical.
func qemuCompare(t *testing.T, what string, args ...string) {
	t.Helper()
	out, err := exec.Command("qemu-img", append([]string{"compare"}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: qemu-img compare %v: %v\n%s", what, args, err, out)
	}
}

// qemuCheckClean fails the test unless qemu-img check finds img clean.
func qemuCheckClean(t *testing.T, what, img string) {
	t.Helper()
	out, err := exec.Command("qemu-img", "check", img).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: qemu-img check %s: %v\n%s", what, img, err, out)
	}
}

func convert(t *testing.T, args ...string) {
	t.Helper()
	if code, out := harness.RunBlockexport(t, append([]string{"convert"}, args...)...); code != 0 {
		t.Fatalf("blockexport convert %v: exit %d\n%s", args, code, out)
	}
}

// Every source format read here, made by qemu-img from one raw image with
// holes and zero runs, converts into every kind of target so that
// qemu-img compare finds the target identical to the source and qemu-img
// check finds every qcow2 target clean.
func TestConvertEveryFormatToEveryTargetEqualsSource(t *testing.T) {
	dir := t.TempDir()
	const size = 6 << 20
	orig := convertSource(t, dir, "orig.raw", size, 1)
	type src struct{ name, path, format string }
	srcs := []src{{"raw", orig, "raw"}}
	for _, s := range []struct{ name, fmt string }{
		{"qcow2", "qcow2"}, {"qcow2-compressed", "qcow2"}, {"vmdk", "vmdk"}, {"vmdk-stream", "vmdk"},
		{"vhdx", "vhdx"}, {"vpc", "vpc"}, {"vdi", "vdi"},
	} {
		p := filepath.Join(dir, "src-"+s.name)
		args := []string{"convert", "-f", "raw", "-O", s.fmt}
		switch s.name {
		case "qcow2-compressed":
			args = append(args, "-c")
		case "vmdk-stream":
			args = append(args, "-o", "subformat=streamOptimized")
		}
		harness.Run(t, "qemu-img", append(args, orig, p)...)
		srcs = append(srcs, src{s.name, p, s.fmt})
	}
	// The backing file for -B: the original with a few changes, so that
	// some ranges equal it and some do not.
	base := filepath.Join(dir, "base.qcow2")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "qcow2", convertSource(t, dir, "base.raw", size, 1), base)
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x55 1M 64k", "-c", "write -z 3M 128k", base)

	targets := []struct {
		name string
		args []string
		qcow bool
	}{
		{"raw", []string{"-O", "raw"}, false},
		{"qcow2", []string{"-O", "qcow2", "-W", "-m", "4"}, true},
		// -t none: O_DIRECT and chunks of 2 MiB (a 6 MiB image of 4 KiB
		// to 1 MiB pieces: chunks with several data runs and holes).
		{"raw-direct", []string{"-O", "raw", "-t", "none", "-W", "-m", "16"}, false},
		{"qcow2-direct", []string{"-O", "qcow2", "-t", "none"}, true},
		{"qcow2-zlib", []string{"-O", "qcow2", "-c"}, true},
		{"qcow2-zstd", []string{"-O", "qcow2", "-c", "-o", "compression_type=zstd,cluster_size=16k"}, true},
		{"backing", []string{"-O", "qcow2", "-B", base, "-F", "qcow2"}, true},
	}
	for _, s := range srcs {
		for _, tg := range targets {
			t.Run(s.name+"/"+tg.name, func(t *testing.T) {
				t.Parallel() // the sources are only read; each target is its own file
				dst := filepath.Join(t.TempDir(), "dst")
				convert(t, append(append([]string{"-f", s.format}, tg.args...), s.path, dst)...)
				what := s.name + " -> " + tg.name
				// Against the original raw: a vpc source may be larger (CHS
				// geometry), its tail zeroes, which compare accepts.
				qemuCompare(t, what, "-f", s.format, s.path, dst)
				qemuCompare(t, what, "-f", "raw", orig, dst)
				if tg.qcow {
					qemuCheckClean(t, what, dst)
				}
			})
		}
	}
}

// An image past the 64 MiB of progress after which the target's write-back
// is started (and past the qcow2 target's 64 MiB steps of growing ahead)
// converts as a small one does, in every cache mode.
func TestConvertPastWriteBehindStartInEveryCacheMode(t *testing.T) {
	dir := t.TempDir()
	const size = 200 << 20
	src := filepath.Join(dir, "big.raw")
	f, err := os.Create(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(7, 7))
	buf := make([]byte, 640<<10)
	for off := int64(0); off < size; off += 1 << 20 {
		for i := range buf {
			buf[i] = byte(r.Uint32())
		}
		if _, err := f.WriteAt(buf, off+int64(r.IntN(256))*512); err != nil {
			t.Fatal(err)
		}
	}
	f.Close()
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"raw", []string{"-O", "raw", "-m", "16", "-W"}},
		{"raw-writeback", []string{"-O", "raw", "-t", "writeback"}},
		{"qcow2", []string{"-O", "qcow2", "-m", "16", "-W"}},
		{"qcow2-direct", []string{"-O", "qcow2", "-t", "none", "-W"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dst := filepath.Join(t.TempDir(), "dst")
			convert(t, append(append([]string{"-f", "raw"}, tc.args...), src, dst)...)
			qemuCompare(t, tc.name, "-f", "raw", src, dst)
			if tc.args[1] == "qcow2" {
				qemuCheckClean(t, tc.name, dst)
			}
		})
	}
}

// A -B target holds only what differs from its backing file: where the
// source equals the backing file, nothing is allocated.
func TestConvertWithBackingWritesOnlyDifferences(t *testing.T) {
	dir := t.TempDir()
	src := convertSource(t, dir, "src.raw", 4<<20, 2)
	base := filepath.Join(dir, "base.qcow2")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "qcow2", src, base)
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x77 2M 64k", src)
	dst := filepath.Join(dir, "dst.qcow2")
	convert(t, "-O", "qcow2", "-B", base, "-F", "qcow2", src, dst)
	qemuCompare(t, "-B", src, dst)
	qemuCheckClean(t, "-B", dst)
	var m []struct {
		Start, Length int64
		Depth         int
		Data          bool
	}
	out := harness.Run(t, "qemu-img", "map", "--output=json", dst)
	if err := json.Unmarshal([]byte(out), &m); err != nil {
		t.Fatal(err)
	}
	var top int64
	for _, e := range m {
		if e.Depth == 0 && e.Data {
			top += e.Length
		}
	}
	if top != 64<<10 {
		t.Fatalf("the -B target allocates %d bytes of data itself, want the 64 KiB that differ:\n%s", top, out)
	}
}

// -n writes into an existing target: zero runs are written as zeroes over
// what was there (a raw file of 0xff, an NBD export), unless
// --target-is-zero says the target reads as zeroes.
func TestConvertIntoExistingTargetWritesZeroRuns(t *testing.T) {
	dir := t.TempDir()
	const size = 4 << 20
	src := convertSource(t, dir, "src.raw", size, 3)
	ff := filepath.Join(dir, "ff.raw")
	if err := os.WriteFile(ff, bytes.Repeat([]byte{0xff}, size), 0o644); err != nil {
		t.Fatal(err)
	}
	convert(t, "-n", "-O", "raw", src, ff)
	qemuCompare(t, "-n onto 0xff", src, ff)

	q := filepath.Join(dir, "t.qcow2")
	harness.Run(t, "qemu-img", "create", "-f", "qcow2", q, fmt.Sprint(size))
	convert(t, "-n", "--target-is-zero", "-O", "qcow2", src, q)
	qemuCompare(t, "-n --target-is-zero", src, q)
	qemuCheckClean(t, "-n qcow2", q)
	// Without -O the existing TARGET's format is probed (qemu-img would
	// write raw bytes over the qcow2 metadata).
	q2 := filepath.Join(dir, "t2.qcow2")
	harness.Run(t, "qemu-img", "create", "-f", "qcow2", q2, fmt.Sprint(size))
	convert(t, "-n", src, q2)
	qemuCompare(t, "-n onto qcow2 without -O", src, q2)
	qemuCheckClean(t, "-n qcow2 without -O", q2)

	nb := filepath.Join(dir, "nbd.raw")
	if err := os.WriteFile(nb, bytes.Repeat([]byte{0xee}, size), 0o644); err != nil {
		t.Fatal(err)
	}
	srv := harness.StartNBD(t, nb, false, "-w")
	convert(t, "-n", src, srv.URI)
	qemuCompare(t, "-n onto NBD", src, srv.URI)

	small := filepath.Join(dir, "small.raw")
	harness.SparseImage(t, dir, "small.raw", size/2)
	if code, out := harness.RunBlockexport(t, "convert", "-n", src, small); code == 0 || !strings.Contains(out, "smaller than the source") {
		t.Fatalf("-n onto a smaller target: exit %d\n%s", code, out)
	}
}

// slowNBDServe serves file read-only through nbdkit with 150 ms a read,
// on a socket of its own, until the test ends.
func slowNBDServe(t *testing.T, file string) (uri string) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "slow.sock")
	cmd := exec.Command("nbdkit", "--exit-with-parent", "-f", "-U", sock, "--filter=delay", "file", file, "rdelay=150ms")
	if err := cmd.Start(); err != nil {
		t.Fatalf("nbdkit (apt-get install nbdkit): %v", err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	for i := 0; ; i++ {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if i > 100 {
			t.Fatal("nbdkit did not start")
		}
		time.Sleep(50 * time.Millisecond)
	}
	return "nbd+unix:///?socket=" + sock
}

// startConvert starts a convert and returns it with its output buffer.
func startConvert(t *testing.T, args ...string) (*exec.Cmd, *bytes.Buffer) {
	t.Helper()
	var out bytes.Buffer
	cmd := exec.Command(harness.Bin, append([]string{"convert"}, args...)...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return cmd, &out
}

// SIGINT mid-convert: a new raw target is truncated to what was
// converted, and holds exactly the source's bytes there; a qcow2 target
// is consistent (qemu-img check clean); both say so and exit 130. SIGKILL
// leaves a qcow2 target qemu-img check calls at worst leaky, never corrupt.
func TestConvertInterruptedLeavesConsistentTarget(t *testing.T) {
	dir := t.TempDir()
	file := harness.RandomImage(t, dir, 48<<20, 9)
	want := harness.ReadAll(t, file)
	for _, c := range []struct {
		name string
		sig  syscall.Signal
		args []string
	}{
		{"raw-sigint", syscall.SIGINT, []string{"-O", "raw", "-m", "2"}},
		{"qcow2-sigint", syscall.SIGINT, []string{"-O", "qcow2", "-m", "2", "-W"}},
		{"qcow2-sigterm", syscall.SIGTERM, []string{"-O", "qcow2", "-m", "2"}},
		{"qcow2-c-sigint", syscall.SIGINT, []string{"-O", "qcow2", "-c", "-m", "2"}},
		{"qcow2-sigkill", syscall.SIGKILL, []string{"-O", "qcow2", "-m", "2", "-W"}},
		{"qcow2-c-sigkill", syscall.SIGKILL, []string{"-O", "qcow2", "-c", "-m", "2"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			// A server of its own: one a killed convert left busy with
			// its queued delayed reads once held the next for 30 s.
			uri := slowNBDServe(t, file)
			dst := filepath.Join(t.TempDir(), "dst")
			cmd, out := startConvert(t, append(c.args, uri, dst)...)
			// Signal it mid-way: once the target exists and has grown
			// (under load, 1.5 s was once before the target was made),
			// then a little later.
			for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
				if st, err := os.Stat(dst); err == nil && st.Size() > 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("no target after 30 s; convert says:\n%s", out)
				}
			}
			time.Sleep(500 * time.Millisecond)
			cmd.Process.Signal(c.sig)
			err := cmd.Wait()
			code := cmd.ProcessState.ExitCode()
			if c.sig == syscall.SIGKILL {
				chk, _ := exec.Command("qemu-img", "check", dst).CombinedOutput()
				if e := exec.Command("qemu-img", "check", dst).Run(); e != nil {
					if ee, ok := e.(*exec.ExitError); !ok || ee.ExitCode() != 3 {
						t.Fatalf("after SIGKILL qemu-img check: %v (want clean or leaks only)\n%s", e, chk)
					}
				}
				return
			}
			if code != 130 || !strings.Contains(out.String(), "interrupted") {
				t.Fatalf("%v: exit %d (%v), want 130 and a message\n%s", c.sig, code, err, out)
			}
			if strings.Count(strings.TrimSpace(out.String()), "\n") != 0 {
				t.Fatalf("SIGINT: want one line, got\n%s", out)
			}
			if c.args[1] == "raw" {
				got := harness.ReadAll(t, dst)
				if len(got) == 0 || len(got) >= len(want) {
					t.Fatalf("raw target is %d bytes after SIGINT, want part of %d\n%s", len(got), len(want), out)
				}
				harness.MustEqualBytes(t, "the converted prefix", got, want[:len(got)])
				return
			}
			qemuCheckClean(t, c.name, dst)
			// What it holds is the source's, where it holds anything.
			harness.Run(t, "qemu-img", "info", dst)
		})
	}
}

// A full disk ends the convert with one line naming ENOSPC.
func TestConvertOnFullDiskFailsInOneLine(t *testing.T) {
	dir := t.TempDir()
	src := harness.RandomImage(t, dir, 8<<20, 4)
	small := harness.SmallHost(t, dir, "2m")
	for _, f := range []string{"raw", "qcow2"} {
		code, out := harness.RunBlockexport(t, "convert", "-O", f, src, filepath.Join(small, "dst."+f))
		lines := strings.Split(strings.TrimSpace(out), "\n")
		if code == 0 || len(lines) != 1 || !strings.Contains(out, "no space left on device") {
			t.Fatalf("-O %s onto a 2 MiB tmpfs: exit %d, want one line naming ENOSPC:\n%s", f, code, out)
		}
		os.Remove(filepath.Join(small, "dst."+f))
	}
}

// compare agrees with qemu-img compare: the exit status and the whole
// output (the first differing offset included) on identical images,
// one byte apart, different sizes, and different allocation with -s.
func TestCompareAgreesWithQemuImg(t *testing.T) {
	dir := t.TempDir()
	const size = 4 << 20
	a := convertSource(t, dir, "a.raw", size, 5)
	aq := filepath.Join(dir, "a.qcow2")
	harness.Run(t, "qemu-img", "convert", "-O", "qcow2", a, aq)
	acomp := filepath.Join(dir, "ac.qcow2")
	harness.Run(t, "qemu-img", "convert", "-c", "-O", "qcow2", a, acomp)
	b := filepath.Join(dir, "b.raw")
	harness.Run(t, "cp", "--sparse=always", a, b)
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x5a 3000001 1", b)
	bq := filepath.Join(dir, "b.qcow2")
	harness.Run(t, "qemu-img", "convert", "-O", "qcow2", b, bq)
	big := filepath.Join(dir, "big.raw")
	harness.Run(t, "cp", "--sparse=always", a, big)
	if err := os.Truncate(big, size+1<<20); err != nil {
		t.Fatal(err)
	}
	bigDirty := filepath.Join(dir, "bigdirty.raw")
	harness.Run(t, "cp", "--sparse=always", big, bigDirty)
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 1 4500000 10", bigDirty)
	zq := filepath.Join(dir, "z.qcow2") // a's data, with zero clusters where a has holes' neighbours
	harness.Run(t, "cp", aq, zq)
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -z 0 64k", zq)
	odd := filepath.Join(dir, "odd.raw") // 1000 bytes: QEMU counts whole sectors
	if err := os.WriteFile(odd, bytes.Repeat([]byte{9}, 1000), 0o644); err != nil {
		t.Fatal(err)
	}
	oddq := filepath.Join(dir, "odd.qcow2")
	harness.Run(t, "qemu-img", "convert", "-O", "qcow2", odd, oddq)
	pairs := [][]string{
		{odd, oddq}, {"-s", odd, oddq},
		{a, aq}, {aq, acomp}, {a, b}, {aq, bq}, {bq, a}, {a, big}, {big, a}, {a, bigDirty}, {bigDirty, aq},
		{"-s", a, aq}, {"-s", aq, aq}, {"-s", a, big}, {"-s", aq, zq}, {"-s", a, b}, {"-s", aq, acomp},
	}
	for _, p := range pairs {
		qout, qerr := exec.Command("qemu-img", append([]string{"compare"}, p...)...).CombinedOutput()
		qcode := 0
		if ee, ok := qerr.(*exec.ExitError); ok {
			qcode = ee.ExitCode()
		}
		code, out := harness.RunBlockexport(t, append([]string{"compare"}, p...)...)
		if code != qcode || out != string(qout) {
			t.Errorf("compare %v: exit %d\n%s\nqemu-img compare: exit %d\n%s", p, code, out, qcode, qout)
		}
	}
	if code, out := harness.RunBlockexport(t, "compare", a, filepath.Join(dir, "missing")); code != 2 {
		t.Errorf("compare with a missing image: exit %d, want 2\n%s", code, out)
	}
}

// --progress json prints one JSON object per step on stdout, ending at
// 100 percent, with the done bytes never going back (-p prints
// qemu-img's percentages: TestConvertProgressAsQemuImg).
func TestConvertProgressJSONWithTheFlag(t *testing.T) {
	dir := t.TempDir()
	src := convertSource(t, dir, "src.raw", 4<<20, 6)
	cmd := exec.Command(harness.Bin, "convert", "--progress", "json", "-O", "qcow2", src, filepath.Join(dir, "dst.qcow2"))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("convert -p: %v\n%s", err, stderr.String())
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	var last struct {
		Done, Total int64
		Percent     int
		Rate        float64
	}
	prev := int64(-1)
	for _, l := range lines {
		if err := json.Unmarshal([]byte(l), &last); err != nil {
			t.Fatalf("progress line %q: %v", l, err)
		}
		if last.Done < prev || last.Total != 4<<20 {
			t.Fatalf("progress went back or lost its total: %q after %d", l, prev)
		}
		prev = last.Done
	}
	if last.Percent != 100 || last.Done != last.Total || len(lines) < 2 {
		t.Fatalf("progress ends at %+v after %d lines, want 100%%", last, len(lines))
	}
}

// A TARGET that is a file the conversion reads (the source itself, under
// another name, or its backing file) is refused before anything is
// created: creating it would truncate what is being read.
func TestConvertRefusesTargetItReads(t *testing.T) {
	dir := t.TempDir()
	src := convertSource(t, dir, "src.raw", 2<<20, 7)
	want := harness.ReadAll(t, src)
	link := filepath.Join(dir, "link.raw")
	if err := os.Symlink(src, link); err != nil {
		t.Fatal(err)
	}
	base := filepath.Join(dir, "base.qcow2")
	harness.Run(t, "qemu-img", "convert", "-O", "qcow2", src, base)
	ov := filepath.Join(dir, "ov.qcow2")
	harness.Run(t, "qemu-img", "create", "-f", "qcow2", "-b", base, "-F", "qcow2", ov)
	for _, args := range [][]string{{src, src}, {link, src}, {"-n", link, src}, {"-O", "qcow2", ov, base}} {
		code, out := harness.RunBlockexport(t, append([]string{"convert"}, args...)...)
		if code == 0 || !strings.Contains(out, "refusing to overwrite") {
			t.Fatalf("convert %v: exit %d, want a refusal\n%s", args, code, out)
		}
	}
	harness.MustEqualBytes(t, "the source after refused converts", harness.ReadAll(t, src), want)
	qemuCheckClean(t, "the backing file", base)
}
