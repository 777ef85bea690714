package formats

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// vdi* are offsets of the VDI header fields the crafted files change.
const (
	vdiOffBmap      = 0x154
	vdiOffData      = 0x158
	vdiDiskSize     = 0x170
	vdiBlocksInImg  = 0x180
	vdiBlocksAlloc  = 0x184
	vdiUnallocated  = 0xffffffff
	vdiDiscarded    = 0xfffffffe
	vdiMaxBlocks    = (1<<31 - 512) / 4 // QEMU 7.2: a block map of at most BDRV_REQUEST_MAX_BYTES
	vdiBlocksOneOff = vdiMaxBlocks + 1
)

// checkOutcome is one tool's check of a file: exit status, parsed JSON and
// the ERROR lines it printed.
type checkOutcome struct {
	code   int
	json   map[string]any
	errors []string
	out    string
}

func qemuCheck(t *testing.T, args ...string) checkOutcome {
	t.Helper()
	cmd := exec.Command("qemu-img", append([]string{"check"}, args...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	r := checkOutcome{}
	if err := cmd.Run(); err != nil {
		var ee *exec.ExitError
		if !errors.As(err, &ee) {
			t.Fatal(err)
		}
		r.code = ee.ExitCode()
	}
	r.out = stdout.String() + stderr.String()
	parseCheck(&r, stdout.String(), stderr.String())
	return r
}

func ourCheck(t *testing.T, args ...string) checkOutcome {
	t.Helper()
	cmd := exec.Command(harness.Bin, append([]string{"check"}, args...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	r := checkOutcome{}
	if err := cmd.Run(); err != nil {
		var ee *exec.ExitError
		if !errors.As(err, &ee) {
			t.Fatal(err)
		}
		r.code = ee.ExitCode()
	}
	r.out = stdout.String() + stderr.String()
	parseCheck(&r, stdout.String(), stderr.String())
	return r
}

func parseCheck(r *checkOutcome, stdout, stderr string) {
	if strings.HasPrefix(strings.TrimSpace(stdout), "{") {
		json.Unmarshal([]byte(stdout), &r.json)
	}
	for _, l := range strings.Split(stderr, "\n") {
		if strings.HasPrefix(l, "ERROR: ") {
			r.errors = append(r.errors, l)
		}
	}
}

// craftVdi writes a copy of base with its header fields and block-map
// entries changed.
func craftVdi(t *testing.T, base, dst string, fields map[int]uint64, entries map[int]uint32, truncate int64) {
	t.Helper()
	b, err := os.ReadFile(base)
	if err != nil {
		t.Fatal(err)
	}
	bmap := int(binary.LittleEndian.Uint32(b[vdiOffBmap:]))
	for i, e := range entries {
		binary.LittleEndian.PutUint32(b[bmap+4*i:], e)
	}
	for off, v := range fields {
		if off == vdiDiskSize {
			binary.LittleEndian.PutUint64(b[off:], v)
		} else {
			binary.LittleEndian.PutUint32(b[off:], uint32(v))
		}
	}
	if truncate > 0 {
		b = b[:truncate]
	}
	if err := os.WriteFile(dst, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestVdiCheckAsQemuImg: `check` of VDI images, clean and damaged
// (duplicate block-map entries, entries past the header's block count,
// allocated counts wrong, a block map past the end of the file, header
// fields at 0, their maximum and one past it), exits as qemu-img check
// does, with the same JSON (keys and values) and the same ERROR lines;
// the file is unchanged. Where QEMU finds nothing but reads wrong data
// (a data block past the end of the file), ours finds a corruption,
// stated. -r is refused as QEMU refuses it (exit 63).
func TestVdiCheckAsQemuImg(t *testing.T) {
	dir := t.TempDir()
	src := harness.RandomImage(t, dir, 8<<20, 41)
	// Holes: blocks 2, 5 unallocated once converted.
	f, err := os.OpenFile(src, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range []int64{2, 5} {
		f.WriteAt(make([]byte, 1<<20), b<<20)
	}
	f.Close()
	dyn := filepath.Join(dir, "dyn.vdi")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vdi", src, dyn)
	static := filepath.Join(dir, "static.vdi")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vdi", "-o", "static=on", src, static)
	empty := filepath.Join(dir, "empty.vdi")
	harness.Run(t, "qemu-img", "create", "-f", "vdi", empty, "4M")
	b, _ := os.ReadFile(dyn)
	allocated := uint64(binary.LittleEndian.Uint32(b[vdiBlocksAlloc:]))
	if allocated != 6 {
		t.Fatalf("converted image has %d blocks allocated, want 6", allocated)
	}
	// The dynamic image's map: blocks 0 1 _ 2 3 _ 4 5 (data blocks in order).
	cases := []struct {
		name     string
		base     string
		fields   map[int]uint64
		entries  map[int]uint32
		truncate int64
		// ours: a deliberate difference from qemu-img (exit status ours
		// gives); 0 where both agree.
		ours int
	}{
		{name: "clean dynamic", base: dyn},
		{name: "clean static", base: static},
		{name: "clean empty", base: empty},
		{name: "discarded entry", base: dyn, entries: map[int]uint32{2: vdiDiscarded}},
		{name: "duplicate entry", base: dyn, entries: map[int]uint32{3: 1}},
		{name: "three entries on one block", base: dyn, entries: map[int]uint32{0: 4, 1: 4, 3: 4}},
		{name: "entry too large", base: dyn, entries: map[int]uint32{6: 8}},
		{name: "entry 0xfffffffd", base: dyn, entries: map[int]uint32{7: 0xfffffffd}},
		{name: "allocated count 0", base: dyn, fields: map[int]uint64{vdiBlocksAlloc: 0}},
		{name: "allocated count one more", base: dyn, fields: map[int]uint64{vdiBlocksAlloc: allocated + 1}},
		{name: "allocated count max", base: dyn, fields: map[int]uint64{vdiBlocksAlloc: 0xffffffff}},
		{name: "block map past the end", base: dyn, fields: map[int]uint64{vdiOffBmap: 64 << 20}},
		{name: "block map at the header", base: dyn, fields: map[int]uint64{vdiOffBmap: 0}},
		{name: "block map half past the end", base: dyn, truncate: 0},
		{name: "blocks in image 0", base: dyn, fields: map[int]uint64{vdiBlocksInImg: 0}},
		{name: "blocks in image 0, disk 0", base: empty, fields: map[int]uint64{vdiBlocksInImg: 0, vdiDiskSize: 0}},
		{name: "blocks in image one more", base: dyn, fields: map[int]uint64{vdiBlocksInImg: 9}},
		{name: "blocks in image max+1", base: dyn, fields: map[int]uint64{vdiBlocksInImg: vdiBlocksOneOff}},
		{name: "disk size max+1", base: dyn, fields: map[int]uint64{vdiDiskSize: uint64(vdiMaxBlocks)<<20 + 1}},
		{name: "disk size 2^64-1", base: dyn, fields: map[int]uint64{vdiDiskSize: 1<<64 - 1}},
		{name: "disk size 0", base: dyn, fields: map[int]uint64{vdiDiskSize: 0}},
		{name: "unaligned map", base: dyn, fields: map[int]uint64{vdiOffBmap: 513}},
		// QEMU checks nothing of where data lies, and reads zeroes there.
		{name: "data block past the end", base: dyn, fields: map[int]uint64{vdiOffData: 1 << 30}, ours: 2},
	}
	// The map half past the end: cut the file inside the map, after entry 3.
	bmap := int64(binary.LittleEndian.Uint32(b[vdiOffBmap:]))
	cases[13].truncate = bmap + 4*4
	cases[13].ours = 0 // the 4 lost entries read as data block 0: duplicates, as in QEMU
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			img := filepath.Join(t.TempDir(), "x.vdi")
			craftVdi(t, c.base, img, c.fields, c.entries, c.truncate)
			before := harness.FileHash(t, img)
			for _, out := range [][]string{nil, {"--output", "json"}} {
				args := append(append([]string{}, out...), "-f", "vdi", img)
				q, o := qemuCheck(t, args...), ourCheck(t, args...)
				if c.ours != 0 {
					if o.code != c.ours {
						t.Fatalf("%v: exit %d, want %d (qemu-img: %d)\n%s", out, o.code, c.ours, q.code, o.out)
					}
					t.Logf("qemu-img exits %d here, ours %d by design:\n%s", q.code, o.code, o.out)
					continue
				}
				if o.code != q.code {
					t.Fatalf("%v: exit %d, qemu-img's %d\nours:\n%s\nqemu-img:\n%s", out, o.code, q.code, o.out, q.out)
				}
				if !reflect.DeepEqual(o.json, q.json) {
					t.Fatalf("%v: JSON %v, qemu-img's %v", out, o.json, q.json)
				}
				if !slices.Equal(o.errors, q.errors) {
					t.Fatalf("%v: ERROR lines\n%s\nqemu-img's\n%s", out, strings.Join(o.errors, "\n"), strings.Join(q.errors, "\n"))
				}
			}
			for _, r := range []string{"leaks", "all"} {
				q, o := qemuCheck(t, "-r", r, "-f", "vdi", img), ourCheck(t, "-r", r, "-f", "vdi", img)
				if o.code != q.code && c.ours == 0 {
					t.Fatalf("-r %s: exit %d, qemu-img's %d\nours:\n%s\nqemu-img:\n%s", r, o.code, q.code, o.out, q.out)
				}
			}
			if harness.FileHash(t, img) != before {
				t.Fatal("check changed the file")
			}
		})
	}
}

// TestVdiCheckOfHugeBlockMapIsBounded: a 1 MiB file whose header claims
// the most blocks QEMU allows (2^29-128, a 2 GiB block map, nearly all past
// the end of the file, each read as data block 0): every duplicate is
// counted, the ERROR lines are bounded, and the check takes little
// memory (QEMU would hold the whole map, and a second one as large).
func TestVdiCheckOfHugeBlockMapIsBounded(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.vdi")
	harness.Run(t, "qemu-img", "create", "-f", "vdi", base, "4M")
	img := filepath.Join(dir, "huge.vdi")
	craftVdi(t, base, img, map[int]uint64{vdiBlocksInImg: vdiMaxBlocks}, nil, 0)
	// Peak memory from time(1): Go starts children with vfork, so the
	// child's own ru_maxrss carries the (race-built) test binary's (see
	// checkExit).
	peak := filepath.Join(dir, "peak")
	cmd := exec.Command("/usr/bin/time", "-f", "%M", "-o", peak, harness.Bin, "check", "--output", "json", img)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 2 {
		t.Fatalf("check: %v, want exit 2\n%s", err, stderr.String())
	}
	var res map[string]any
	if err := json.Unmarshal(stdout.Bytes(), &res); err != nil {
		t.Fatal(err)
	}
	// 4 unallocated entries in the file; the rest are zero entries: the
	// first takes block 0, each other is a duplicate; and the count of
	// allocated entries is not the header's 0.
	want := float64(vdiMaxBlocks - 4 - 1 + 1)
	if res["corruptions"] != want {
		t.Fatalf("corruptions %v, want %v", res["corruptions"], want)
	}
	if n := strings.Count(stderr.String(), "\n"); n > 1100 {
		t.Fatalf("%d lines on stderr, want them bounded", n)
	}
	b, err := os.ReadFile(peak)
	if err != nil {
		t.Fatalf("time(1) wrote no peak: %v", err)
	}
	f := strings.Fields(strings.TrimSpace(string(b)))
	kib, err := strconv.ParseInt(f[len(f)-1], 10, 64)
	if err != nil {
		t.Fatalf("time(1) peak %q: %v", b, err)
	}
	if kib > 200<<10 {
		t.Fatalf("check held %d MiB", kib>>10)
	}
}
