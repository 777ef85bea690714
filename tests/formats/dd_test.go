package formats

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestDdMatchesQemuImg: qemu-img dd's output for raw and qcow2 inputs
// and outputs over block sizes, counts and skips, edge cases included
// (count past the end, skip past the end, bs=0, 1 and 2^31, bad numbers,
// unknown operands): the same message and exit status, raw outputs
// byte-equal, qcow2 outputs of equal contents that check clean.
func TestDdMatchesQemuImg(t *testing.T) {
	dir := t.TempDir()
	raw := harness.RandomImage(t, dir, 5_000_000, 46)
	q := filepath.Join(dir, "in.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", q, "8M")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0xaa 0 1M", "-c", "write -P 0xbb 7M 64k", "-c", "write -P 1 20000 3000", q)
	cases := [][]string{
		{}, {"bs=1M", "count=2", "skip=1"}, {"bs=1M", "skip=10"}, {"bs=1M", "skip=100"},
		{"bs=0"}, {"bs=3G"}, {"bs=2G"}, {"bs=1Q"}, {"count=-1"},
		{"skip=9223372036854775807"}, {"skip=9223372036854775808"}, {"b=5"}, {"foo"},
		{"bs=1000", "skip=4999"}, {"bs=1000", "skip=5000"}, {"bs=1000", "skip=5001"},
		{"bs=1000", "skip=2", "count=3"}, {"bs=1.5k", "count=1"}, {"bs=1k", "count=1.5k"},
		{"bs=1", "count=7000"}, {"count=100000000"}, {"bs=4096", "count=1000", "skip=500"},
		{"skip=1", "count=18446744073709551615"}, {"bs=64k", "skip=127"}, {"count=0"},
	}
	for _, in := range []struct{ format, path string }{{"raw", raw}, {"qcow2", q}} {
		for _, out := range []string{"raw", "qcow2"} {
			// Most of the time is qemu-img dd copying at its 512-byte
			// default: the four pairs, which only read the inputs and
			// write outputs of their own, run side by side.
			t.Run(in.format+" to "+out, func(t *testing.T) {
				t.Parallel()
				dir := t.TempDir()
				for _, c := range cases {
					theirs, mine := filepath.Join(dir, "theirs.out"), filepath.Join(dir, "mine.out")
					os.Remove(theirs)
					os.Remove(mine)
					args := append([]string{"dd", "-f", in.format, "-O", out}, c...)
					args = append(args, "if="+in.path, "of="+theirs)
					runBoth(t, args, func(a string) string {
						if a == "of="+theirs {
							return "of=" + mine
						}
						return a
					})
					_, errT := os.Stat(theirs)
					_, errM := os.Stat(mine)
					if (errT == nil) != (errM == nil) {
						t.Errorf("%v: output exists: qemu-img %v, blockexport %v", args, errT == nil, errM == nil)
						continue
					}
					if errT != nil {
						continue
					}
					if out == "raw" {
						harness.Run(t, "cmp", theirs, mine)
					} else {
						sameImages(t, "qcow2", theirs, mine)
					}
				}
			})
		}
	}
}

// TestDdReplacesAnExistingOutput: as qemu-img dd, an existing output is
// created anew at the copied size, not refused or written into.
func TestDdReplacesAnExistingOutput(t *testing.T) {
	dir := t.TempDir()
	in := harness.RandomImage(t, dir, 1<<20, 7)
	out := filepath.Join(dir, "out.raw")
	if err := os.WriteFile(out, make([]byte, 3<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	if code, msg := harness.RunBlockexport(t, "dd", "-f", "raw", "bs=4k", "count=16", "if="+in, "of="+out); code != 0 {
		t.Fatalf("dd: exit %d\n%s", code, msg)
	}
	if fi, err := os.Stat(out); err != nil || fi.Size() != 64<<10 {
		t.Fatalf("output after dd: %v, %v; want 65536 bytes", fi, err)
	}
}
