package qcow2

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/blockexport/blockexport/aio"

	"github.com/blockexport/blockexport/formats/internal/driver"
)

// A repair killed at any write leaves an image whose guest data is intact
// and that a second repair makes clean: the rebuild writes its refcount
// structures in fresh clusters and switches the header to them last.

// errKilled is the write that did not happen because the process died.
var errKilled = errors.New("killed")

// killedFile lets the first n writes through and drops the rest, as a
// process killed after its n-th write would leave the file.
type killedFile struct {
	aio.File
	n, writes int
}

func (k *killedFile) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	if k.writes >= k.n {
		return 0, errKilled
	}
	k.writes++
	return k.File.WriteAt(ctx, p, off)
}

func qemuRawBytes(t *testing.T, img string) []byte {
	t.Helper()
	raw := img + ".raw"
	if out, err := exec.Command("qemu-img", "convert", "-f", "qcow2", "-O", "raw", img, raw).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img convert %s: %v\n%s", img, err, out)
	}
	defer os.Remove(raw)
	b, err := os.ReadFile(raw)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// baseImageWithSnapshot makes an image with data and a snapshot: the first
// cluster is shared with the snapshot (refcount 2, COPIED clear).
func baseImageWithSnapshot(t *testing.T, dir string) (string, []byte) {
	t.Helper()
	img := filepath.Join(dir, "base.qcow2")
	for _, args := range [][]string{
		{"qemu-img", "create", "-q", "-f", "qcow2", img, "8M"},
		{"qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 0 256k", "-c", "write -P 0x33 1M 64k", img},
		{"qemu-img", "snapshot", "-c", "s1", img},
		{"qemu-io", "-f", "qcow2", "-c", "write -P 0x77 64k 64k", img},
	} {
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out)
		}
	}
	b, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	return img, b
}

// crashCases are the damage the kill test repairs: a refcount table
// entry naming a data cluster (a rebuild), and a shared cluster whose
// refcount dropped to one with its COPIED flag set, as a lost increment
// leaves it (a refcount raised, a flag cleared).
var crashCases = []struct {
	name   string
	break_ func(b []byte)
}{
	{"reftable entry on data", func(b []byte) {
		be := binary.BigEndian
		rt := be.Uint64(b[48:])
		l2 := be.Uint64(b[be.Uint64(b[40:]):]) & l1OffsetMask
		be.PutUint64(b[rt:], be.Uint64(b[l2:])&l2OffsetMask)
	}},
	{"shared cluster at refcount one, COPIED", func(b []byte) {
		be := binary.BigEndian
		rb := be.Uint64(b[be.Uint64(b[48:]):])
		l2 := be.Uint64(b[be.Uint64(b[40:]):]) & l1OffsetMask
		e := be.Uint64(b[l2:])
		be.PutUint16(b[rb+2*((e&l2OffsetMask)>>16):], 1)
		be.PutUint64(b[l2:], e|oflagCopied)
	}},
}

// copiedOnShared returns qemu-img check's complaints about a COPIED
// flag set on a cluster whose refcount is not one: the state in which a
// write lands in place on a cluster a snapshot shares.
func copiedOnShared(t *testing.T, img string) []string {
	t.Helper()
	out, _ := exec.Command("qemu-img", "check", "-f", "qcow2", img).CombinedOutput()
	var bad []string
	for _, line := range strings.Split(string(out), "\n") {
		if !strings.Contains(line, "OFLAG_COPIED") || strings.HasSuffix(line, "refcount=1") {
			continue
		}
		// "entry=8..." is an entry with the flag set.
		if i := strings.Index(line, "entry="); i >= 0 && strings.HasPrefix(line[i+len("entry="):], "8") {
			bad = append(bad, line)
		}
	}
	return bad
}

func checkWith(t *testing.T, img string, repair, killAfter int) (int, error) {
	t.Helper()
	f, err := openTestFile(img, testOpts{Backend: "threads", Writable: repair != RepairNone})
	if err != nil {
		t.Fatal(err)
	}
	k := &killedFile{File: f, n: killAfter}
	_, err = Check(context.Background(), k, driver.Options{}, repair) // closes k
	return k.writes, err
}

func TestCheckRepairSurvivesAKillAtEveryWrite(t *testing.T) {
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Fatal("qemu-img is needed: apt-get install -y qemu-utils")
	}
	base, baseBytes := baseImageWithSnapshot(t, t.TempDir())
	orig := qemuRawBytes(t, base)
	for _, cc := range crashCases {
		t.Run(cc.name, func(t *testing.T) {
			dir := t.TempDir()
			brokenBytes := slices.Clone(baseBytes)
			cc.break_(brokenBytes)
			full := filepath.Join(dir, "full.qcow2")
			if err := os.WriteFile(full, brokenBytes, 0o644); err != nil {
				t.Fatal(err)
			}
			before := copiedOnShared(t, full)
			total, err := checkWith(t, full, RepairAll, 1<<30)
			if err != nil || total < 2 {
				t.Fatalf("-r all: %d writes, %v", total, err)
			}
			if bad := copiedOnShared(t, full); len(bad) > 0 {
				t.Fatalf("after the repair: %v", bad)
			}
			for n := 0; n < total; n++ {
				img := filepath.Join(dir, fmt.Sprintf("k%d.qcow2", n))
				if err := os.WriteFile(img, brokenBytes, 0o644); err != nil {
					t.Fatal(err)
				}
				if _, err := checkWith(t, img, RepairAll, n); !errors.Is(err, errKilled) {
					t.Fatalf("killed after %d of %d writes: the kill was not reached: %v", n, total, err)
				}
				if got := qemuRawBytes(t, img); !bytes.Equal(got, orig) {
					t.Fatalf("killed after %d of %d writes: the guest data changed", n, total)
				}
				// The damage may remain; a flag claiming a shared
				// cluster may not have been added by the repair.
				for _, line := range copiedOnShared(t, img) {
					if !slices.Contains(before, line) {
						t.Errorf("killed after %d of %d writes: %s", n, total, line)
					}
				}
				// A second repair, uninterrupted, makes the image clean.
				if _, err := checkWith(t, img, RepairAll, 1<<30); err != nil {
					t.Fatalf("killed after %d of %d writes: the second repair: %v", n, total, err)
				}
				if out, err := exec.Command("qemu-img", "check", "-f", "qcow2", img).CombinedOutput(); err != nil {
					t.Fatalf("killed after %d of %d writes: qemu-img check after the second repair: %v\n%s", n, total, err, out)
				}
				if got := qemuRawBytes(t, img); !bytes.Equal(got, orig) {
					t.Fatalf("killed after %d of %d writes: the guest data changed after the second repair", n, total)
				}
			}
		})
	}

	// -r leaks refuses the image that needs a rebuild, writing nothing.
	broken := filepath.Join(t.TempDir(), "leaks.qcow2")
	b := slices.Clone(baseBytes)
	crashCases[0].break_(b)
	if err := os.WriteFile(broken, b, 0o644); err != nil {
		t.Fatal(err)
	}
	if n, err := checkWith(t, broken, RepairLeaks, 1<<30); !errors.Is(err, ErrNeedRebuild) || n != 0 {
		t.Fatalf("-r leaks: %d writes, %v; want none and ErrNeedRebuild", n, err)
	}
}

// TestCheckRepairRunsTheOverlapCheck: an L1 entry naming the L1 table's
// own cluster makes the COPIED repair want to write that L1 entry, which
// lies in what is now also an L2 table; the overlap check refuses, the
// check fails, and the L1 table is as it was (qemu-img fails the same
// way).
func TestCheckRepairRunsTheOverlapCheck(t *testing.T) {
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Fatal("qemu-img is needed: apt-get install -y qemu-utils")
	}
	_, b := baseImageWithSnapshot(t, t.TempDir())
	be := binary.BigEndian
	l1 := be.Uint64(b[40:])
	be.PutUint64(b[l1:], l1|oflagCopied)
	img := filepath.Join(t.TempDir(), "overlap.qcow2")
	if err := os.WriteFile(img, b, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := checkWith(t, img, RepairAll, 1<<30); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "overlap the active L2 table") {
		t.Fatalf("-r all: %v; want the write refused as overlapping an L2 table", err)
	}
	after, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	cs := int64(1) << be.Uint32(b[20:])
	if !bytes.Equal(after[l1:int64(l1)+cs], b[l1:int64(l1)+cs]) {
		t.Fatal("the L1 table was written over")
	}
}

// FuzzCheck runs check and both repairs over mutated images: whatever the
// metadata says (offsets at bit 63, tables past the end, counts at their
// limits), no panic and no hang.
func FuzzCheck(f *testing.F) {
	seeds, _ := filepath.Glob("testdata/seeds/*.qcow2")
	for _, s := range seeds {
		b, err := os.ReadFile(s)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, b []byte) {
		done := make(chan struct{})
		defer close(done)
		go func() {
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				buf := make([]byte, 1<<20)
				n := runtime.Stack(buf, true)
				panic(fmt.Sprintf("check hangs for 10s:\n%s", buf[:n]))
			}
		}()
		for _, repair := range []int{RepairNone, RepairLeaks, RepairAll} {
			p := filepath.Join(dir, "fuzz.qcow2")
			if err := os.WriteFile(p, b, 0o644); err != nil {
				t.Fatal(err)
			}
			checkWith(t, p, repair, 1<<30)
		}
	})
}
