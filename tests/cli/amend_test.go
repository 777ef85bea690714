package cli

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// The amend verb is judged against qemu-img amend 7.2 itself: the same
// options on copies of the same image must give the same exit status,
// the same first line of stderr, the same qemu-img info, the same
// qemu-img check verdict and the same guest data.

// amendImages are the images the differential runs on: each builds
// NAME.qcow2 in a directory with qemu-img and qemu-io.
var amendImages = map[string][][]string{
	"plain": {
		{"qemu-img", "create", "-q", "-f", "qcow2", "IMG", "64M"},
		{"qemu-io", "-c", "write -P 1 0 1M", "-c", "write -z 2M 1M", "-c", "write -c -P 2 4M 64k", "IMG"},
	},
	"snapshots": {
		{"qemu-img", "create", "-q", "-f", "qcow2", "IMG", "64M"},
		{"qemu-io", "-c", "write -P 1 0 1M", "-c", "write -c -P 2 4M 64k", "IMG"},
		{"qemu-img", "snapshot", "-c", "s1", "IMG"},
		{"qemu-io", "-c", "write -P 3 512k 1M", "-c", "write -z 8M 128k", "IMG"},
	},
	"bitmaps": {
		{"qemu-img", "create", "-q", "-f", "qcow2", "IMG", "64M"},
		{"qemu-io", "-c", "write -P 1 0 1M", "IMG"},
		{"qemu-img", "bitmap", "--add", "IMG", "bm0"},
		{"qemu-img", "bitmap", "--add", "--disable", "IMG", "bm1"},
	},
	"backing": {
		{"qemu-img", "create", "-q", "-f", "qcow2", "base.qcow2", "64M"},
		{"qemu-io", "-c", "write -P 9 0 8M", "base.qcow2"},
		{"qemu-img", "create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", "IMG"},
		{"qemu-io", "-c", "write -P 1 0 1M", "-c", "write -z 2M 1M", "-c", "write -z 1M 64k", "IMG"},
	},
	"zstd-compressed": {
		{"qemu-img", "create", "-q", "-f", "qcow2", "-o", "compression_type=zstd", "IMG", "64M"},
		{"qemu-io", "-c", "write -c -P 2 0 64k", "IMG"},
	},
	"zstd-uncompressed": {
		{"qemu-img", "create", "-q", "-f", "qcow2", "-o", "compression_type=zstd", "IMG", "64M"},
		{"qemu-io", "-c", "write -P 2 0 64k", "IMG"},
	},
	"lazy-dirty": {
		{"qemu-img", "create", "-q", "-f", "qcow2", "-o", "lazy_refcounts=on", "IMG", "64M"},
		// abort leaves the image dirty, its refcounts never written.
		{"!", "qemu-io", "-c", "write -P 1 0 1M", "-c", "write -P 2 4M 1M", "-c", "abort", "IMG"},
	},
	"v2-snapshot": {
		{"qemu-img", "create", "-q", "-f", "qcow2", "-o", "compat=0.10", "IMG", "64M"},
		{"qemu-io", "-c", "write -P 1 0 1M", "IMG"},
		{"qemu-img", "snapshot", "-c", "s1", "IMG"},
	},
	"snapshot-of-other-size": {
		{"qemu-img", "create", "-q", "-f", "qcow2", "IMG", "64M"},
		{"qemu-img", "snapshot", "-c", "s1", "IMG"},
		{"qemu-img", "resize", "-q", "IMG", "128M"},
	},
}

// buildAmendImage makes image name as path in dir.
func buildAmendImage(t *testing.T, dir, name, path string) {
	t.Helper()
	for _, args := range amendImages[name] {
		mayFail := args[0] == "!"
		if mayFail {
			args = args[1:]
		}
		args = slices.Clone(args)
		for i := range args {
			if args[i] == "IMG" {
				args[i] = path
			}
		}
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil && !mayFail {
			t.Fatalf("%v: %v\n%s", args, err, out)
		}
	}
}

// amendOutcome is what an amend leaves, in the terms compared.
type amendOutcome struct {
	status      int
	firstLine   string // of stderr, without the program's name
	info        string // qemu-img info --output=json, less what differs by layout
	checkStatus int
}

func runStatus(t *testing.T, dir string, args ...string) (int, string, string) {
	t.Helper()
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Dir = dir
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0, stdout.String(), stderr.String()
	case errors.As(err, &ee):
		return ee.ExitCode(), stdout.String(), stderr.String()
	}
	t.Fatalf("%v: %v", args, err)
	return 0, "", ""
}

func amendResult(t *testing.T, dir, img string, status int, stderr string) amendOutcome {
	t.Helper()
	first, _, _ := strings.Cut(stderr, "\n")
	first = strings.TrimPrefix(strings.TrimPrefix(first, "blockexport: "), "qemu-img: ")
	_, info, _ := runStatus(t, dir, "qemu-img", "info", "-U", "--output=json", img)
	var kept []string
	for _, l := range strings.Split(info, "\n") {
		if !strings.Contains(l, "actual-size") && !strings.Contains(l, "filename") && !strings.Contains(l, "dirty-flag") {
			kept = append(kept, l)
		}
	}
	check, _, _ := runStatus(t, dir, "qemu-img", "check", img)
	return amendOutcome{status: status, firstLine: first, info: strings.Join(kept, "\n"), checkStatus: check}
}

// amendCases are the options run on each image: every option on the
// plain image, and on the others those that meet what they hold.
var amendCases = map[string][]string{
	"plain": {"compat=0.10", "compat=1.1", "refcount_bits=1", "refcount_bits=8", "refcount_bits=64",
		"lazy_refcounts=on", "lazy_refcounts=off", "backing_file=other.qcow2", "size=128M", "size=32M",
		"compat=0.10,refcount_bits=8", "cluster_size=4096", "refcount_bits=3", "compat=0.9", "lazy_refcounts=maybe",
		"refcount_bits=8,compat=0.10,refcount_bits=16", "foo=1", "compat=1.1,", "compat=1.1,,", "size=abc"},
	"snapshots":              {"compat=0.10", "compat=1.1", "refcount_bits=1", "refcount_bits=2", "size=32M"},
	"bitmaps":                {"compat=0.10", "refcount_bits=64", "lazy_refcounts=on", "size=128M", "size=32M"},
	"backing":                {"compat=0.10", "refcount_bits=8", "backing_file=base.qcow2,backing_fmt=qcow2", "backing_file=base.qcow2", "backing_fmt=raw"},
	"zstd-compressed":        {"compat=0.10", "refcount_bits=8"},
	"zstd-uncompressed":      {"compat=0.10"},
	"lazy-dirty":             {"lazy_refcounts=off", "compat=0.10", "refcount_bits=8", "cluster_size=4096"},
	"v2-snapshot":            {"compat=1.1", "refcount_bits=8", "lazy_refcounts=on", "size=128M", "compat=0.10,refcount_bits=16"},
	"snapshot-of-other-size": {"compat=0.10", "size=32M"},
}

// TestAmendMatchesQemuImg runs each case on copies of its image with
// blockexport amend and qemu-img amend.
func TestAmendMatchesQemuImg(t *testing.T) {
	for _, name := range slices.Sorted(func(yield func(string) bool) {
		for k := range amendCases {
			if !yield(k) {
				return
			}
		}
	}) {
		for _, opt := range amendCases[name] {
			t.Run(name+"/"+opt, func(t *testing.T) {
				t.Parallel() // each case builds its image in a directory of its own
				dir := t.TempDir()
				buildAmendImage(t, dir, name, "img.qcow2")
				data, err := os.ReadFile(filepath.Join(dir, "img.qcow2"))
				if err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(dir, "theirs.qcow2"), data, 0o644); err != nil {
					t.Fatal(err)
				}
				status, _, stderr := runStatus(t, dir, harness.Bin, "amend", "-o", opt, "img.qcow2")
				if strings.Contains(stderr, "panic") {
					t.Fatalf("blockexport amend panicked:\n%s", stderr)
				}
				ours := amendResult(t, dir, "img.qcow2", status, stderr)
				status, _, stderr = runStatus(t, dir, "qemu-img", "amend", "-o", opt, "theirs.qcow2")
				theirs := amendResult(t, dir, "theirs.qcow2", status, stderr)
				if ours != theirs {
					t.Errorf("blockexport amend -o %s: exit %d, %q, check exit %d; qemu-img: exit %d, %q, check exit %d",
						opt, ours.status, ours.firstLine, ours.checkStatus, theirs.status, theirs.firstLine, theirs.checkStatus)
					if ours.info != theirs.info {
						t.Errorf("qemu-img info differs:\n%s\nqemu-img's copy:\n%s", ours.info, theirs.info)
					}
				}
				if code, _, out := runStatus(t, dir, "qemu-img", "compare", "img.qcow2", "theirs.qcow2"); code != 0 {
					t.Errorf("the guest data differs from qemu-img's copy (compare exit %d): %s", code, out)
				}
			})
		}
	}
}

// TestAmendRefusesWhatQemuImgRefusesBeforeAnyChange: usage, help and an
// image held by another QEMU process.
func TestAmendRefusesWhatQemuImgRefusesBeforeAnyChange(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "img.qcow2")
	buildAmendImage(t, dir, "plain", img)
	for _, tc := range []struct {
		args   []string
		status int
		want   string
	}{
		{[]string{"amend", img}, 1, "Must specify options (-o)"},
		{[]string{"amend", "-o", "", img}, 1, "Invalid option list: "},
		{[]string{"amend", "-o", "help"}, 1, "Expecting one image file name"},
		{[]string{"amend", "-f", "qcow2", "-o", "help"}, 0, "refcount_bits=<num>    - Width of a reference count entry in bits"},
		{[]string{"amend", "-o", "compat=1.1", filepath.Join(dir, "missing.qcow2")}, 1, "Could not open"},
	} {
		code, out := harness.RunBlockexport(t, tc.args...)
		if code != tc.status || !strings.Contains(out, tc.want) {
			t.Errorf("blockexport %v: exit %d\n%s\nwant exit %d and %q", tc.args, code, out, tc.status, tc.want)
		}
	}
	raw := filepath.Join(dir, "disk.raw")
	if err := os.WriteFile(raw, make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	if code, out := harness.RunBlockexport(t, "amend", "-f", "raw", "-o", "size=2M", raw); code != 1 || !strings.Contains(out, "Format driver 'raw' does not support option amendment") {
		t.Errorf("amend of a raw image: exit %d\n%s", code, out)
	}
	before, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	harness.HoldImage(t, img)
	code, out := harness.RunBlockexport(t, "amend", "-o", "refcount_bits=8", img)
	if code != 1 || !strings.Contains(out, `Failed to get "write" lock`) {
		t.Fatalf("amend of an image qemu-io holds: exit %d\n%s", code, out)
	}
	after, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	if string(before) != string(after) {
		t.Fatal("a refused amend changed the image")
	}
}

// TestAmendRefusesDamagedImages damages the header's tables and the
// bitmap directory: amend refuses as qemu-img does (exit 1), without a
// crash, and leaves the file as it was.
func TestAmendRefusesDamagedImages(t *testing.T) {
	for _, tc := range []struct {
		name   string
		damage func(t *testing.T, b []byte, dir string)
	}{
		{"L1 table misaligned", func(t *testing.T, b []byte, _ string) { binary.BigEndian.PutUint64(b[40:], 0x30200) }},
		{"L1 table too large", func(t *testing.T, b []byte, _ string) { binary.BigEndian.PutUint32(b[36:], 1<<30) }},
		{"refcount table misaligned", func(t *testing.T, b []byte, _ string) { binary.BigEndian.PutUint64(b[48:], 0x10200) }},
		{"header length absurd", func(t *testing.T, b []byte, _ string) { binary.BigEndian.PutUint32(b[100:], 7) }},
		{"bitmap directory garbage", func(t *testing.T, b []byte, dir string) {
			off := bitmapDirectoryOffset(t, b)
			for i := range 64 {
				b[off+int64(i)] = 0xff
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			buildAmendImage(t, dir, "bitmaps", "img.qcow2")
			b, err := os.ReadFile(filepath.Join(dir, "img.qcow2"))
			if err != nil {
				t.Fatal(err)
			}
			tc.damage(t, b, dir)
			for _, name := range []string{"img.qcow2", "theirs.qcow2"} {
				if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			status, _, stderr := runStatus(t, dir, harness.Bin, "amend", "-o", "refcount_bits=8", "img.qcow2")
			theirs, _, theirErr := runStatus(t, dir, "qemu-img", "amend", "-o", "refcount_bits=8", "theirs.qcow2")
			if strings.Contains(stderr, "panic") || status != 1 || theirs != 1 {
				t.Fatalf("blockexport amend: exit %d\n%s\nqemu-img amend: exit %d\n%s", status, stderr, theirs, theirErr)
			}
			after, err := os.ReadFile(filepath.Join(dir, "img.qcow2"))
			if err != nil {
				t.Fatal(err)
			}
			if string(after) != string(b) {
				t.Fatal("a refused amend changed the image")
			}
		})
	}
}

// bitmapDirectoryOffset finds the bitmaps header extension in the
// header cluster b and returns the directory's offset.
func bitmapDirectoryOffset(t *testing.T, b []byte) int64 {
	t.Helper()
	be := binary.BigEndian
	for off := int64(be.Uint32(b[100:])); off+8 <= 65536; {
		typ, n := be.Uint32(b[off:]), int64(be.Uint32(b[off+4:]))
		if typ == 0 {
			break
		}
		if typ == 0x23852875 {
			return int64(be.Uint64(b[off+8+16:]))
		}
		off += 8 + (n+7)&^7
	}
	t.Fatal("no bitmaps extension")
	return 0
}

// TestAmendKilledLeavesAConsistentImage kills blockexport amend (SIGKILL)
// at random moments of a refcount width change and of a downgrade of an
// image with many clusters: qemu-img check finds no corruption, the
// image has the old settings or the new ones, and the guest data is as
// before.
func TestAmendKilledLeavesAConsistentImage(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=4096", base, "256M")
	harness.Run(t, "qemu-io", "-c", "write -P 7 0 64M", base)
	pristine := filepath.Join(dir, "pristine.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=4096", "-b", base, "-F", "qcow2", pristine)
	var cmds []string
	for i := range 64 {
		// Zero clusters over the backing file's data, and data between.
		cmds = append(cmds, "-c", fmt.Sprintf("write -z %d 512k", int64(i)<<20), "-c", fmt.Sprintf("write -P %d %d 256k", i, int64(i)<<20+512<<10))
	}
	harness.Run(t, "qemu-io", append(cmds, pristine)...)
	harness.Run(t, "qemu-img", "snapshot", "-c", "s1", pristine)
	want := harness.ToRaw(t, pristine, dir)
	img := filepath.Join(dir, "img.qcow2")
	r := rand.New(rand.NewPCG(46, 7))
	for _, tc := range []struct {
		opt    string
		compat []string
		bits   []string
	}{
		{"refcount_bits=64", []string{`"compat": "1.1"`}, []string{`"refcount-bits": 16`, `"refcount-bits": 64`}},
		{"compat=0.10", []string{`"compat": "1.1"`, `"compat": "0.10"`}, []string{`"refcount-bits": 16`}},
	} {
		// How long an uninterrupted run takes bounds the kill times.
		harness.Run(t, "cp", pristine, img)
		start := time.Now()
		if code, out := harness.RunBlockexport(t, "amend", "-o", tc.opt, img); code != 0 {
			t.Fatalf("amend -o %s: exit %d\n%s", tc.opt, code, out)
		}
		full := time.Since(start)
		t.Logf("amend -o %s takes %v uninterrupted", tc.opt, full)
		killed := 0
		for i := range 8 {
			harness.Run(t, "cp", pristine, img)
			cmd := exec.Command(harness.Bin, "amend", "-o", tc.opt, img)
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			time.Sleep(time.Duration(r.Int64N(int64(full))))
			cmd.Process.Signal(syscall.SIGKILL)
			if err := cmd.Wait(); err == nil {
				t.Logf("%s, kill %d: amend had finished", tc.opt, i)
			} else {
				killed++
			}
			code, _, out := runStatus(t, dir, "qemu-img", "check", img)
			if code != 0 && code != 3 {
				t.Fatalf("%s, kill %d: qemu-img check exit %d\n%s", tc.opt, i, code, out)
			}
			_, info, _ := runStatus(t, dir, "qemu-img", "info", "-U", "--output=json", img)
			if !slices.ContainsFunc(tc.compat, func(s string) bool { return strings.Contains(info, s) }) ||
				!slices.ContainsFunc(tc.bits, func(s string) bool { return strings.Contains(info, s) }) {
				t.Fatalf("%s, kill %d: neither the old settings nor the new:\n%s", tc.opt, i, info)
			}
			if code, _, out := runStatus(t, dir, "qemu-img", "compare", "-f", "qcow2", "-F", "raw", img, want); code != 0 {
				t.Fatalf("%s, kill %d: the guest data changed: %s", tc.opt, i, out)
			}
		}
		if killed == 0 {
			t.Fatalf("amend -o %s finished before every kill: no crash was tested", tc.opt)
		}
	}
}

// TestAmendDowngradeKeepsTheSnapshotsData downgrades an image whose
// active layer zeroed a cluster a snapshot shares: QEMU keeps such a
// cluster allocated with the zero flag, and its downgrade (7.2) writes
// zeroes into it, so that the snapshot loses its data there and check
// reports a COPIED flag error. Here the snapshot keeps its data and the
// active layer gets a cluster of its own.
func TestAmendDowngradeKeepsTheSnapshotsData(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "img.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", img, "64M")
	harness.Run(t, "qemu-io", "-c", "write -P 1 0 1M", img)
	harness.Run(t, "qemu-img", "snapshot", "-c", "s1", img)
	harness.Run(t, "qemu-io", "-c", "write -z 0 64k", img)
	snapshotData := func(name string) string {
		out := filepath.Join(dir, name)
		harness.Run(t, "qemu-img", "convert", "-l", "snapshot.name=s1", "-O", "raw", img, out)
		b, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	before, active := snapshotData("before.raw"), harness.ToRaw(t, img, dir)
	if code, out := harness.RunBlockexport(t, "amend", "-o", "compat=0.10", img); code != 0 {
		t.Fatalf("amend: exit %d\n%s", code, out)
	}
	harness.QemuImgCheck(t, img)
	if snapshotData("after.raw") != before {
		t.Fatal("the downgrade changed the snapshot's data")
	}
	if code, _, out := runStatus(t, dir, "qemu-img", "compare", "-f", "qcow2", "-F", "raw", img, active); code != 0 {
		t.Fatalf("the downgrade changed the active layer's data: %s", out)
	}
}
