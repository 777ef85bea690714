package formats

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// resizePair makes two identical images, one for qemu-img and one for
// blockexport: 64 MiB with data at the start and near the end, prepared
// further by setup (a snapshot, an older compat).
func resizePair(t *testing.T, format string, createOpts []string, setup ...string) (theirs, mine string) {
	t.Helper()
	dir := t.TempDir()
	theirs, mine = filepath.Join(dir, "theirs."+format), filepath.Join(dir, "mine."+format)
	for _, p := range []string{theirs, mine} {
		harness.Run(t, "qemu-img", append(append([]string{"create", "-q", "-f", format}, createOpts...), p, "64M")...)
		harness.Run(t, "qemu-io", "-f", format, "-c", "write -P 0xaa 0 4M", "-c", "write -P 0xbb 60M 1M", p)
		for _, s := range setup {
			harness.Run(t, "sh", "-c", strings.ReplaceAll(s, "IMG", p))
		}
	}
	return theirs, mine
}

// sameImages fails unless the two images have the same virtual size and
// contents, and (qcow2) mine checks clean.
func sameImages(t *testing.T, format, theirs, mine string) {
	t.Helper()
	size := func(p string) string {
		out := harness.Run(t, "qemu-img", "info", "-f", format, "--output", "json", p)
		i := strings.Index(out, `"virtual-size"`)
		return out[i : i+strings.IndexByte(out[i:], ',')]
	}
	if a, b := size(theirs), size(mine); a != b {
		t.Errorf("virtual size: qemu-img %s, blockexport %s", a, b)
	}
	if out, err := exec.Command("qemu-img", "compare", "-f", format, "-F", format, theirs, mine).CombinedOutput(); err != nil {
		t.Errorf("qemu-img compare: %v\n%s", err, out)
	}
	if format == "qcow2" {
		if out, err := exec.Command("qemu-img", "check", mine).CombinedOutput(); err != nil {
			t.Errorf("qemu-img check: %v\n%s", err, out)
		}
	}
}

// TestResizeMatchesQemuImg: grow, shrink, relative sizes, preallocation
// and every refusal (no --shrink, bad sizes, 2^63, unaligned qcow2 sizes)
// of raw and qcow2 images: the same message, exit status, virtual size
// and data as qemu-img resize.
func TestResizeMatchesQemuImg(t *testing.T) {
	cases := [][]string{
		{"IMG", "+1G"}, {"IMG", "32M"}, {"--shrink", "IMG", "32M"}, {"--shrink", "IMG", "--", "-1M"},
		{"IMG", "-1M"}, {"--shrink", "IMG", "-1M"}, {"IMG", "-1G"}, {"IMG", "1Q"}, {"IMG", "-1"},
		{"IMG", "9223372036854775808"}, {"IMG", "18446744073709551616"}, {"IMG", "9223372036854775807"},
		{"IMG", "+9223372036854775807"}, {"--shrink", "IMG", "0"}, {"IMG", "+0"}, {"-q", "IMG", "+1M"},
		{"IMG", "+1000"}, {"--shrink", "IMG", "-1000"}, {"--shrink", "IMG", "33554944"},
		{"--preallocation=full", "IMG", "+3M"}, {"--preallocation=falloc", "IMG", "+3M"},
		{"--preallocation=metadata", "IMG", "+3M"}, {"--preallocation=bogus", "IMG", "+3M"},
		{"--preallocation=full", "IMG", "+0"}, {"--preallocation=full", "--shrink", "IMG", "1M"},
		{"IMG"}, {"IMG", "1M", "extra"}, {"IMG", "4P"}, {"IMG", "1.5M"}, {"IMG", "+"},
		{"IMG", "9223372035781033985"},
	}
	for _, format := range []string{"raw", "qcow2"} {
		t.Run(format, func(t *testing.T) {
			t.Parallel() // each case resizes a fresh pair of its own
			for _, c := range cases {
				theirs, mine := resizePair(t, format, nil)
				args := append([]string{"resize", "-f", format}, c...)
				runBoth(t, replaceArg(args, "IMG", theirs), func(a string) string {
					if a == theirs {
						return mine
					}
					return a
				})
				sameImages(t, format, theirs, mine)
			}
		})
	}
}

// TestResizeWithSnapshotsMatchesQemuImg: a v3 image with an internal
// snapshot grows and shrinks as in qemu-img 7.2, the snapshot keeping its
// data; a v2 one is refused in qemu-img's words.
func TestResizeWithSnapshotsMatchesQemuImg(t *testing.T) {
	snap := "qemu-img snapshot -c s1 IMG && qemu-io -c 'write -P 0xcc 0 1M' -c 'write -P 0xdd 40M 64k' IMG >/dev/null"
	for _, c := range []struct {
		create []string
		args   []string
	}{
		{nil, []string{"IMG", "+1G"}},
		{nil, []string{"--shrink", "IMG", "32M"}},
		{nil, []string{"--shrink", "IMG", "1M"}},
		{[]string{"-o", "compat=0.10"}, []string{"IMG", "+1M"}},
	} {
		theirs, mine := resizePair(t, "qcow2", c.create, snap)
		runBoth(t, replaceArg(append([]string{"resize"}, c.args...), "IMG", theirs), func(a string) string {
			if a == theirs {
				return mine
			}
			return a
		})
		sameImages(t, "qcow2", theirs, mine)
		dir := t.TempDir()
		a, b := filepath.Join(dir, "theirs.raw"), filepath.Join(dir, "mine.raw")
		harness.Run(t, "qemu-img", "convert", "-l", "s1", "-O", "raw", theirs, a)
		harness.Run(t, "qemu-img", "convert", "-l", "s1", "-O", "raw", mine, b)
		harness.Run(t, "cmp", a, b)
	}
}

// TestResizeRawPreallocationAllocates: falloc and full leave the grown
// part allocated on the host, as qemu-img's do.
func TestResizeRawPreallocationAllocates(t *testing.T) {
	for _, mode := range []string{"falloc", "full"} {
		p := harness.SparseImage(t, t.TempDir(), "p.raw", 1<<20)
		if code, out := harness.RunBlockexport(t, "resize", "-f", "raw", "--preallocation="+mode, p, "+8M"); code != 0 {
			t.Fatalf("resize --preallocation=%s: exit %d\n%s", mode, code, out)
		}
		out := harness.Run(t, "du", "-k", p)
		var kib int
		if _, err := fmt.Sscan(out, &kib); err != nil || kib < 8<<10 {
			t.Errorf("--preallocation=%s: du says %q, want at least 8 MiB allocated", mode, out)
		}
	}
}

func replaceArg(args []string, from, to string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		if a == from {
			a = to
		}
		out[i] = a
	}
	return out
}

// TestResizeHelpBeforeTheSize: the size is taken off before the flags
// are parsed, and -h among them still shows the help, touching nothing.
func TestResizeHelpBeforeTheSize(t *testing.T) {
	p := harness.SparseImage(t, t.TempDir(), "h.raw", 1<<20)
	code, out := harness.RunBlockexport(t, "resize", "-h", p, "2M")
	if code != 0 || !strings.Contains(out, "Usage:") {
		t.Fatalf("resize -h: exit %d\n%s", code, out)
	}
	if out := harness.Run(t, "stat", "-c", "%s", p); strings.TrimSpace(out) != "1048576" {
		t.Fatalf("resize -h changed the image's size to %s", out)
	}
}

// bitmapsSeen is what QEMU's tools see of img's bitmaps: qemu-img info's
// JSON list (names, flags, granularity) and each consistent bitmap's dirty
// blocks as qemu-nbd exports them.
func bitmapsSeen(t *testing.T, img string) string {
	t.Helper()
	var info struct {
		FormatSpecific struct {
			Data struct {
				Bitmaps []harness.QemuBitmap `json:"bitmaps"`
			} `json:"data"`
		} `json:"format-specific"`
	}
	if err := json.Unmarshal([]byte(harness.Run(t, "qemu-img", "info", "-U", "--output", "json", img)), &info); err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, bm := range info.FormatSpecific.Data.Bitmaps { // in directory order
		fmt.Fprintf(&b, "%s %v %d\n", bm.Name, bm.Flags, bm.Granularity)
	}
	for _, bm := range info.FormatSpecific.Data.Bitmaps {
		if !slices.Contains(bm.Flags, "in-use") {
			fmt.Fprintf(&b, "%s dirty %v\n", bm.Name, harness.DirtyRanges(t, img, bm.Name))
		}
	}
	return b.String()
}

// TestResizeWithBitmapsMatchesQemuImg: an image with persistent dirty
// bitmaps (enabled at two granularities, and a disabled one) grows,
// shrinks and grows with preallocation as in qemu-img 7.2: every bitmap
// takes the new size, its bits past a smaller end dropped and the grown
// part clean, and qemu-img info, qemu-nbd's dirty blocks and qemu-img
// check agree with qemu-img's; a bitmap in use (a crashed writer's)
// refuses any resize in qemu-img's words and leaves the image as it was;
// a size too large for a bitmap resizes and leaves them all in use.
func TestResizeWithBitmapsMatchesQemuImg(t *testing.T) {
	bitmaps := "qemu-img bitmap --add IMG bm0 && qemu-img bitmap --add IMG bm1 && qemu-img bitmap --add -g 512 IMG bm2 && " +
		"qemu-io -c 'write -P 0xcc 40M 64k' -c 'write 63M 1M' -c 'write 100k 1k' IMG >/dev/null && qemu-img bitmap --disable IMG bm1"
	for _, args := range [][]string{
		{"IMG", "+1G"}, {"--shrink", "IMG", "32M"}, {"--shrink", "IMG", "40M"}, {"--preallocation=full", "IMG", "+3M"},
		{"--preallocation=metadata", "IMG", "+3M"}, {"IMG", "+0"}, {"IMG", "+1000"},
	} {
		theirs, mine := resizePair(t, "qcow2", nil, bitmaps)
		runBoth(t, replaceArg(append([]string{"resize"}, args...), "IMG", theirs), func(a string) string {
			if a == theirs {
				return mine
			}
			return a
		})
		sameImages(t, "qcow2", theirs, mine)
		if got, want := bitmapsSeen(t, mine), bitmapsSeen(t, theirs); got != want {
			t.Errorf("resize %v: the bitmaps are\n%s\nqemu-img's are\n%s", args, got, want)
		}
	}
	// A writer killed while it held the image leaves bm0 and bm2 in use.
	inUse := "qemu-io -c 'write 0 64k' -c 'sleep 60000' IMG >/dev/null & p=$!; " +
		"until qemu-img info -U IMG | grep -q in-use; do sleep 0.05; done; kill -9 $p; wait $p; true"
	for _, args := range [][]string{{"IMG", "+1M"}, {"IMG", "+0"}, {"--shrink", "IMG", "32M"}} {
		theirs, mine := resizePair(t, "qcow2", nil, bitmaps, inUse)
		before := harness.ReadAll(t, mine)
		runBoth(t, replaceArg(append([]string{"resize"}, args...), "IMG", theirs), func(a string) string {
			if a == theirs {
				return mine
			}
			return a
		})
		if !bytes.Equal(harness.ReadAll(t, mine), before) {
			t.Errorf("resize %v refused, yet the image changed", args)
		}
	}
	// Past 2 TiB, bm2's 512-byte granularity needs more than QEMU's 512
	// MiB of bitmap: qemu-img resizes, then fails to store any bitmap and
	// leaves them all in use, exit 0.
	theirs, mine := resizePair(t, "qcow2", nil, bitmaps)
	qout, qerr := exec.Command("qemu-img", "resize", theirs, "+3T").CombinedOutput()
	code, out := harness.RunBlockexport(t, "resize", mine, "+3T")
	const lost = "Bitmap 'bm2' doesn't satisfy the constraints: Too much space will be occupied by the bitmap. Use larger granularity"
	if qerr != nil || code != 0 || !strings.Contains(string(qout), lost) || !strings.Contains(out, lost) || !strings.Contains(out, "Image resized.") {
		t.Errorf("resize +3T: exit %d\n%s\nqemu-img: %v\n%s", code, out, qerr, qout)
	}
	sameImages(t, "qcow2", theirs, mine)
	if got, want := bitmapsSeen(t, mine), bitmapsSeen(t, theirs); got != want {
		t.Errorf("resize +3T: the bitmaps are\n%s\nqemu-img's are\n%s", got, want)
	}
}
