package cli

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// The bitmap verb is judged against qemu-img bitmap 7.2 itself: the same
// operations on copies of the same images must leave the same bitmaps
// (qemu-img info), the same dirty blocks (qemu-nbd -B, nbdinfo --map),
// the same exit status and the same words, and qemu-img check clean.

// orderedBitmaps is `qemu-img info --output=json`'s bitmap list, in the
// directory's order.
func orderedBitmaps(t *testing.T, img string) []harness.QemuBitmap {
	t.Helper()
	var info struct {
		FormatSpecific struct {
			Data struct {
				Bitmaps []harness.QemuBitmap `json:"bitmaps"`
			} `json:"data"`
		} `json:"format-specific"`
	}
	if err := json.Unmarshal([]byte(harness.Run(t, "qemu-img", "info", "-U", "--output=json", img)), &info); err != nil {
		t.Fatal(err)
	}
	return info.FormatSpecific.Data.Bitmaps
}

// bitmapState is what a bitmap operation leaves: the list, and the dirty
// blocks of each bitmap qemu-nbd can export (not those in use).
func bitmapState(t *testing.T, img string) string {
	t.Helper()
	list := orderedBitmaps(t, img)
	s := fmt.Sprintf("%+v", list)
	for _, b := range list {
		if !slicesContains(b.Flags, "in-use") {
			s += fmt.Sprintf("\n%s: %s", b.Name, dirtyBlocks(t, img, b.Name))
		}
	}
	return s
}

// dirtyBlocks is bitmap's dirty extents as nbdinfo --map reads them from
// qemu-nbd -B (started by nbdinfo on a socket of its own: no wait for a
// listener, no race).
func dirtyBlocks(t *testing.T, img, bitmap string) string {
	t.Helper()
	out := harness.Run(t, "nbdinfo", "--map=qemu:dirty-bitmap:"+bitmap, "--", "[", "qemu-nbd", "-r", "-f", "qcow2", "-B", bitmap, img, "]")
	var dirty []string
	for _, l := range strings.Split(out, "\n") {
		if f := strings.Fields(l); len(f) >= 3 && f[2] == "1" {
			dirty = append(dirty, f[0]+"+"+f[1])
		}
	}
	return strings.Join(dirty, " ")
}

func slicesContains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// qemuCheckStatus is qemu-img check's exit status on img.
func qemuCheckStatus(t *testing.T, img string) (int, string) {
	t.Helper()
	out, err := exec.Command("qemu-img", "check", img).CombinedOutput()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode(), string(out)
	}
	if err != nil {
		t.Fatal(err)
	}
	return 0, string(out)
}

// bitmapImages are the images the cases run on, all 64 MiB but big:
// img has bitmaps a (64 KiB granularity, enabled), b (512 bytes,
// disabled) and c (enabled), each with blocks dirty; other has o dirty
// elsewhere; inuse has bitmap u left in use by a killed writer; big (128
// MiB) has z; v2 is a compat=0.10 image; raw a raw one.
func bitmapImages(t *testing.T, dir string) map[string]string {
	t.Helper()
	qio := func(img string, cmds ...string) {
		args := []string{"-f", "qcow2"}
		for _, c := range cmds {
			args = append(args, "-c", c)
		}
		harness.Run(t, "qemu-io", append(args, img)...)
	}
	p := func(n string) string { return filepath.Join(dir, n) }
	m := map[string]string{"IMG": p("img.qcow2"), "OTHER": p("other.qcow2"), "INUSE": p("inuse.qcow2"),
		"BIG": p("big.qcow2"), "V2": p("v2.qcow2"), "RAW": p("raw.img")}
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", m["IMG"], "64M")
	qio(m["IMG"], "write -P 0xaa 0 1M")
	harness.Run(t, "qemu-img", "bitmap", "--add", m["IMG"], "a")
	harness.Run(t, "qemu-img", "bitmap", "--add", "-g", "512", m["IMG"], "b")
	qio(m["IMG"], "write 4M 100k", "write 20M 3k")
	harness.Run(t, "qemu-img", "bitmap", "--disable", m["IMG"], "b")
	qio(m["IMG"], "write 30M 64k")
	harness.Run(t, "qemu-img", "bitmap", "--add", m["IMG"], "c")
	qio(m["IMG"], "write 40M 1M")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", m["OTHER"], "64M")
	harness.Run(t, "qemu-img", "bitmap", "--add", "-g", "1M", m["OTHER"], "o")
	qio(m["OTHER"], "write 50M 10k", "write 63M 1M")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", m["INUSE"], "64M")
	harness.Run(t, "qemu-img", "bitmap", "--add", m["INUSE"], "u")
	harness.Run(t, "qemu-img", "bitmap", "--add", m["INUSE"], "ok")
	// qemu-io killed while the image is open for writing: u stays in use.
	exec.Command("qemu-io", "-f", "qcow2", "-c", "write 8M 64k", "-c", "sigraise 9", m["INUSE"]).Run()
	if b := harness.QemuBitmaps(t, m["INUSE"]); !slicesContains(b["u"].Flags, "in-use") {
		t.Fatalf("the fixture's bitmap u is not in use: %+v", b)
	}
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", m["BIG"], "128M")
	harness.Run(t, "qemu-img", "bitmap", "--add", m["BIG"], "z")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "compat=0.10", m["V2"], "64M")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "raw", m["RAW"], "64M")
	return m
}

// nodeName is what differs between the two tools' words: qemu-img names
// an image by its block node (#block123), blockexport by its path.
var nodeName = regexp.MustCompile(`#block[0-9]+|/[^ ']*/copy-[a-z]+/[a-z0-9]+\.(qcow2|img)`)

// wordsOf is an error output without the program's name and warnings,
// images named alike.
func wordsOf(out string) string {
	var lines []string
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		if strings.HasPrefix(l, "WARNING") || strings.HasPrefix(l, "  ") || strings.Contains(l, "level=WARN") {
			continue
		}
		l = strings.TrimPrefix(strings.TrimPrefix(l, "qemu-img: "), "blockexport: ")
		lines = append(lines, nodeName.ReplaceAllString(l, "NODE"))
	}
	return strings.Join(lines, "\n")
}

// bitmapCases are command lines for `bitmap` (IMG and the other fixture
// names stand for the images): the operations and their mistakes.
var bitmapCases = [][]string{
	{"--add", "IMG", "new"},
	{"--add", "-g", "512", "--disable", "IMG", "new"},
	{"--add", "-g", "1k", "IMG", "new"},
	{"--add", "-g", "0", "IMG", "new"},
	{"--add", "-g", "256", "IMG", "new"},
	{"--add", "-g", "3000", "IMG", "new"},
	{"--add", "-g", "2147483648", "IMG", "new"},
	{"--add", "-g", "4294967296", "IMG", "new"},
	{"--add", "-g", "4294967808", "IMG", "new"},
	{"--add", "-g", "abc", "IMG", "new"},
	{"--add", "IMG", ""},
	{"--add", "IMG", strings.Repeat("n", 1023)},
	{"--add", "IMG", strings.Repeat("n", 1024)},
	{"--add", "IMG", "a"},
	{"--add", "--add", "IMG", "new"},
	{"--add", "--remove", "--add", "IMG", "new"},
	{"--remove", "IMG", "b"},
	{"--remove", "--remove", "IMG", "a"},
	{"--remove", "IMG", "nope"},
	{"--clear", "IMG", "a"},
	{"--clear", "--disable", "--enable", "IMG", "c"},
	{"--enable", "IMG", "b"},
	{"--disable", "IMG", "a"},
	{"--enable", "IMG", "nope"},
	{"--merge", "b", "IMG", "a"},
	{"--merge", "a", "IMG", "b"},
	{"--merge", "c", "--clear", "--merge", "b", "IMG", "a"},
	{"--merge", "nope", "IMG", "a"},
	{"--merge", "a", "IMG", "nope"},
	{"--add", "-g", "4k", "--merge", "b", "--merge", "a", "IMG", "new"},
	{"--merge", "o", "-b", "OTHER", "IMG", "c"},
	{"--merge", "o", "-b", "OTHER", "-F", "qcow2", "--disable", "IMG", "b"},
	{"--merge", "nope", "-b", "OTHER", "IMG", "c"},
	{"--merge", "z", "-b", "BIG", "IMG", "a"},
	{"--merge", "x", "-b", "RAW", "-F", "raw", "IMG", "a"},
	{"--remove", "INUSE", "u"},
	{"--enable", "INUSE", "u"},
	{"--disable", "INUSE", "u"},
	{"--clear", "INUSE", "u"},
	{"--merge", "u", "INUSE", "ok"},
	{"--merge", "ok", "INUSE", "u"},
	{"--add", "INUSE", "u"},
	{"--add", "V2", "new"},
	{"--add", "-f", "raw", "RAW", "new"},
	{"--clear", "-f", "raw", "RAW", "new"},
	{"IMG", "a"},
	{"--add", "IMG"},
	{"--remove", "-g", "512", "IMG", "a"},
	{"--remove", "-b", "OTHER", "IMG", "a"},
	{"--merge", "a", "-F", "qcow2", "IMG", "b"},
	{"--merge", "a", "-b", "IMG", "IMG", "c"},
}

// runBitmapCase runs one case with prog on fresh copies of the fixtures
// in dir, and returns the exit status, the words and what the image
// operated on holds after.
func runBitmapCase(t *testing.T, prog string, fixtures map[string]string, dir string, args []string) (int, string, string, string) {
	t.Helper()
	copies := map[string]string{}
	for k, p := range fixtures {
		c := filepath.Join(dir, strings.ToLower(k)+filepath.Ext(p))
		harness.Run(t, "cp", "--sparse=always", p, c)
		copies[k] = c
	}
	var argv []string
	target := "" // the last image named, but for -b's
	for i, a := range args {
		if c, ok := copies[a]; ok {
			if i == 0 || args[i-1] != "-b" {
				target = c
			}
			a = c
		}
		argv = append(argv, a)
	}
	cmd := exec.Command(prog, append([]string{"bitmap"}, argv...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	if target == "" || strings.HasSuffix(target, ".img") {
		return code, wordsOf(stderr.String()), "", target
	}
	return code, wordsOf(stderr.String()), bitmapState(t, target), target
}

func TestBitmapVerbMatchesQemuImg(t *testing.T) {
	fixtures := bitmapImages(t, t.TempDir())
	for i, args := range bitmapCases {
		name := strings.Join(args, " ")
		if len(name) > 60 {
			name = name[:60]
		}
		t.Run(fmt.Sprintf("%d %s", i, name), func(t *testing.T) {
			t.Parallel() // the fixtures are copied, never written
			qDir, oDir := filepath.Join(t.TempDir(), "copy-qemu"), filepath.Join(t.TempDir(), "copy-ours")
			os.MkdirAll(qDir, 0o755)
			os.MkdirAll(oDir, 0o755)
			qCode, qWords, qState, _ := runBitmapCase(t, "qemu-img", fixtures, qDir, args)
			oCode, oWords, oState, target := runBitmapCase(t, harness.Bin, fixtures, oDir, args)
			if qCode != oCode {
				t.Errorf("exit status %d, qemu-img's %d", oCode, qCode)
			}
			if qWords != oWords {
				t.Errorf("says\n%s\nqemu-img says\n%s", oWords, qWords)
			}
			if qState != oState {
				t.Errorf("leaves\n%s\nqemu-img leaves\n%s", oState, qState)
			}
			if target != "" && strings.HasSuffix(target, ".qcow2") {
				if code, out := qemuCheckStatus(t, target); code != 0 {
					t.Errorf("qemu-img check exits %d:\n%s", code, out)
				}
			}
		})
	}
}

// TestBitmapVerbRefusesALockedImage: an image a QEMU tool has open is
// refused in qemu-img's words, exit 1, and left alone.
func TestBitmapVerbRefusesALockedImage(t *testing.T) {
	img := filepath.Join(t.TempDir(), "locked.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", img, "64M")
	harness.HoldImage(t, img)
	code, out := harness.RunBlockexport(t, "bitmap", "--add", img, "bm")
	want := fmt.Sprintf("Could not open '%s': Failed to get \"write\" lock\nIs another process using the image [%s]?", img, img)
	if code != 1 || wordsOf(out) != wordsOf(want) {
		t.Errorf("exit %d, says %q; want exit 1, %q", code, out, want)
	}
	if b := harness.QemuBitmaps(t, img); len(b) != 0 {
		t.Errorf("the locked image has bitmaps %+v", b)
	}
}

// TestBitmapVerbKilledLeavesBitmapsBeforeOrAfter kills the verb at random
// moments of --add, --remove and --merge on an image whose bitmaps take
// many clusters: each time qemu-img check finds no corruption (leaks at
// most) and the bitmaps and their dirty blocks are as before or as after.
func TestBitmapVerbKilledLeavesBitmapsBeforeOrAfter(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=4096", base, "4G")
	harness.Run(t, "qemu-img", "bitmap", "--add", "-g", "512", base, "fine")
	harness.Run(t, "qemu-img", "bitmap", "--add", "-g", "512", base, "dst")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write 0 4M", "-c", "write 1G 8M", "-c", "write 3G 16M", base)
	harness.Run(t, "qemu-img", "bitmap", "--clear", base, "dst")
	ops := [][]string{
		{"--add", "-g", "512", "new"},
		{"--remove", "fine"},
		{"--merge", "fine", "dst"},
	}
	before := bitmapState(t, base)
	rng := rand.New(rand.NewPCG(46, 1))
	for k, op := range ops {
		after := filepath.Join(dir, fmt.Sprintf("after%d.qcow2", k))
		harness.Run(t, "cp", "--sparse=always", base, after)
		argv := append([]string{"bitmap"}, op[:len(op)-1]...)
		argv = append(argv, after, op[len(op)-1])
		start := time.Now()
		if code, out := harness.RunBlockexport(t, argv...); code != 0 {
			t.Fatalf("%v: exit %d\n%s", op, code, out)
		}
		took := time.Since(start) // the kills land anywhere in a run this long
		want := bitmapState(t, after)
		if want == before {
			t.Fatalf("%v changes nothing the test can see", op)
		}
		seen := map[string]int{}
		const kills = 20
		for i := range kills {
			img := filepath.Join(dir, fmt.Sprintf("killed%d-%d.qcow2", k, i))
			harness.Run(t, "cp", "--sparse=always", base, img)
			argv := append([]string{"bitmap"}, op[:len(op)-1]...)
			argv = append(argv, img, op[len(op)-1])
			cmd := exec.Command(harness.Bin, argv...)
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			time.Sleep(time.Duration(rng.Int64N(int64(took) * 5 / 4)))
			cmd.Process.Signal(syscall.SIGKILL)
			cmd.Wait()
			code, out := qemuCheckStatus(t, img)
			if code != 0 && code != 3 {
				t.Fatalf("%v killed: qemu-img check exits %d\n%s", op, code, out)
			}
			switch got := bitmapState(t, img); got {
			case before:
				seen["before"]++
			case want:
				seen["after"]++
			default:
				t.Fatalf("%v killed: the bitmaps are\n%s\nneither as before\n%s\nnor as after\n%s", op, got, before, want)
			}
			os.Remove(img)
		}
		t.Logf("%v killed %d times within %v: %v", op, kills, took, seen)
	}
}
