package formats

import (
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// runBoth runs `qemu-img ARGS` and `blockexport ARGS` (each with its own
// image paths: mine maps qemu-img's arguments to blockexport's) and fails
// unless the exit status and the output (qemu-img's name read as ours)
// are the same.
func runBoth(t *testing.T, args []string, mine func(string) string) {
	t.Helper()
	q := exec.Command("qemu-img", args...)
	qout, qerr := q.CombinedOutput()
	theirs := strings.ReplaceAll(string(qout), "qemu-img", "blockexport")
	b := make([]string, len(args))
	for i, a := range args {
		b[i] = mine(a)
	}
	code, out := harness.RunBlockexport(t, b...)
	qcode := 0
	var ee *exec.ExitError
	if errors.As(qerr, &ee) {
		qcode = ee.ExitCode()
	} else if qerr != nil {
		t.Fatalf("qemu-img %v: %v (install qemu-utils)", args, qerr)
	}
	if code != qcode || out != theirs {
		t.Errorf("%v:\nqemu-img (exit %d):\n%s\nblockexport (exit %d):\n%s", args, qcode, theirs, code, out)
	}
}

func same(s string) string { return s }

// TestMeasureMatchesQemuImg: required, fully allocated and bitmaps sizes,
// human and JSON, for every source format read here (sparse, full,
// compressed, with backing, with bitmaps) and raw and qcow2 targets with
// the -o options qemu-img takes.
func TestMeasureMatchesQemuImg(t *testing.T) {
	dir := t.TempDir()
	sources := qemuOutputImages(t)
	full := filepath.Join(dir, "full.raw")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "raw", full, "3M")
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 9 0 3M", full)
	odd := harness.SparseImage(t, dir, "odd.raw", 1000)
	v2 := filepath.Join(dir, "v2.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "compat=0.10", v2, "5M")
	sources = append(sources, full, odd, v2)
	for _, f := range []string{"vhdx", "vpc", "vdi"} {
		p := filepath.Join(dir, "a."+f)
		harness.Run(t, "qemu-img", "convert", "-O", f, sources[0], p)
		sources = append(sources, p)
	}
	targets := [][]string{
		{"-O", "raw"}, {},
		{"-O", "qcow2"},
		{"-O", "qcow2", "-o", "cluster_size=4k,compat=0.10"},
		{"-O", "qcow2", "-o", "cluster_size=2M,refcount_bits=1"},
		{"-O", "qcow2", "-o", "preallocation=full"},
		{"-O", "qcow2", "-o", "preallocation=metadata,extended_l2=on"},
		{"-O", "qcow2", "-o", "backing_file=x"},
	}
	for _, src := range sources {
		for _, tg := range targets {
			for _, out := range []string{"human", "json"} {
				args := append(append([]string{"measure", "--output", out}, tg...), src)
				runBoth(t, args, same)
			}
		}
	}
}

// TestMeasureRefusesAsQemuImg: bad sizes, options, formats and argument
// lists are refused with qemu-img's message and status 1, and --size
// measures an empty image as qemu-img does.
func TestMeasureRefusesAsQemuImg(t *testing.T) {
	img := qemuOutputImages(t)[0]
	for _, args := range [][]string{
		{}, {"--size", "1G", img}, {img, img}, {"--output", "bogus", img},
		{"-O", "bogus", img}, {"-O", "vmdk", img},
		{"--size", "-1"}, {"--size", "1Q"}, {"--size", "9223372036854775808"}, {"--size", "8E"},
		{"--size", "0"}, {"--size", "1000"}, {"--size", "1.5k", "-O", "qcow2"}, {"--size", "0x10"},
		{"-O", "qcow2", "--size", "9223372036854775807"}, {"-O", "qcow2", "--size", "2P", "--output", "json"},
		{"-O", "qcow2", "-o", "preallocation=bogus", img}, {"-O", "qcow2", "-o", "cluster_size=3k", img},
		{"-O", "qcow2", "-o", "cluster_size=1Q", img}, {"-O", "qcow2", "-o", "compat=2", img},
		{"-O", "qcow2", "-o", "foo=1", img}, {"-o", "cluster_size=4k", img},
		{"-O", "qcow2", "-o", "refcount_bits=3", img}, {"-O", "qcow2", "-o", "compat=0.10,refcount_bits=8", img},
		{"-O", "qcow2", "-o", "extended_l2=maybe", img},
	} {
		runBoth(t, append([]string{"measure"}, args...), same)
	}
}
