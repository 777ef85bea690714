package formats

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// The check command against qemu-img check: the same findings (as JSON
// counts) and exit status on clean and broken images, and repairs that
// qemu-img check then finds clean, with the data unchanged.

// qcowLayout is what the tests need of a qcow2 file to break it: cluster
// size, the first refcount block and the first L2 table.
type qcowLayout struct {
	cs, refBlock, l2 int64
}

func layoutOf(t *testing.T, img string) qcowLayout {
	t.Helper()
	b, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	be := binary.BigEndian
	cs := int64(1) << be.Uint32(b[20:])
	if order := be.Uint32(b[96:]); order != 4 {
		t.Fatalf("refcount order %d; these tests patch 16-bit refcounts", order)
	}
	rt := int64(be.Uint64(b[48:]))
	l1 := int64(be.Uint64(b[40:]))
	return qcowLayout{cs: cs, refBlock: int64(be.Uint64(b[rt:])) &^ (cs - 1), l2: int64(be.Uint64(b[l1:]) & 0x00fffffffffffe00)}
}

func patchFile(t *testing.T, img string, off int64, b []byte) {
	t.Helper()
	f, err := os.OpenFile(img, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

func setRefcount(t *testing.T, img string, l qcowLayout, cluster int64, v uint16) {
	patchFile(t, img, l.refBlock+2*cluster, binary.BigEndian.AppendUint16(nil, v))
}

// l2Entry returns L2 entry i of the first L2 table.
func l2Entry(t *testing.T, img string, l qcowLayout, i int64) uint64 {
	t.Helper()
	f, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var b [8]byte
	if _, err := f.ReadAt(b[:], l.l2+8*i); err != nil {
		t.Fatal(err)
	}
	return binary.BigEndian.Uint64(b[:])
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestCheckAgreesWithQemuImg: clean images (data, compressed clusters, a
// snapshot shared with the active layer) and images broken four ways get
// the same counts and exit status from both checkers; `-r all` (and
// `-r leaks` where leaks are all there is) leaves an image qemu-img check
// finds clean, reading as before.
func TestCheckAgreesWithQemuImg(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", base, "8M")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 0 256k", "-c", "write -P 0x33 1M 64k", "-c", "write -P 0x11 4M 128k", base)

	compressed := filepath.Join(dir, "compressed.qcow2")
	harness.Run(t, "qemu-img", "convert", "-c", "-f", "qcow2", "-O", "qcow2", base, compressed)
	snap := filepath.Join(dir, "snap.qcow2")
	copyFile(t, base, snap)
	harness.Run(t, "qemu-img", "snapshot", "-c", "s1", snap)
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x77 64k 64k", snap)
	for _, img := range []string{base, compressed, snap} {
		t.Run("clean/"+filepath.Base(img), func(t *testing.T) {
			if got := harness.CompareChecks(t, img); got["corruptions"] != nil || got["leaks"] != nil {
				t.Fatalf("a clean image has findings: %v", got)
			}
		})
	}

	l := layoutOf(t, base)
	dataCluster := int64(l2Entry(t, base, l, 0)&0x00fffffffffffe00) / l.cs
	broken := []struct {
		name   string
		break_ func(t *testing.T, img string)
		leaks  bool // leaks and nothing worse: -r leaks repairs it
	}{
		{"leaked cluster", func(t *testing.T, img string) {
			st, _ := os.Stat(img)
			if err := os.Truncate(img, st.Size()+l.cs); err != nil {
				t.Fatal(err)
			}
			setRefcount(t, img, l, st.Size()/l.cs, 1)
		}, true},
		{"refcount too high", func(t *testing.T, img string) { setRefcount(t, img, l, dataCluster, 2) }, false},
		{"refcount too low", func(t *testing.T, img string) { setRefcount(t, img, l, dataCluster, 0) }, false},
		{"COPIED flag missing", func(t *testing.T, img string) {
			patchFile(t, img, l.l2, binary.BigEndian.AppendUint64(nil, l2Entry(t, img, l, 0)&^(1<<63)))
		}, false},
	}
	for _, b := range broken {
		t.Run(b.name, func(t *testing.T) {
			img := filepath.Join(t.TempDir(), "broken.qcow2")
			copyFile(t, base, img)
			b.break_(t, img)
			got := harness.CompareChecks(t, img)
			if got["corruptions"] == nil && got["leaks"] == nil {
				t.Fatalf("the broken image checks clean: %v", got)
			}
			modes := []string{"all"}
			if b.leaks {
				modes = append(modes, "leaks")
			}
			for _, mode := range modes {
				fixed := filepath.Join(t.TempDir(), "fixed.qcow2")
				copyFile(t, img, fixed)
				code, res := harness.CheckJSON(t, harness.Bin, "check", "-r", mode, "--output=json", fixed)
				if code != 0 || res["corruptions"] != nil || res["leaks"] != nil {
					t.Fatalf("check -r %s: exit %d %v", mode, code, res)
				}
				if res["leaks-fixed"] == nil && res["corruptions-fixed"] == nil {
					t.Fatalf("check -r %s repaired nothing it reports: %v", mode, res)
				}
				if code, q := harness.CheckJSON(t, "qemu-img", "check", "-f", "qcow2", "--output=json", fixed); code != 0 {
					t.Fatalf("after check -r %s, qemu-img check: exit %d %v", mode, code, q)
				}
				harness.Run(t, "qemu-img", "compare", "-f", "qcow2", "-F", "qcow2", base, fixed)
			}
		})
	}
}

// TestCheckRawAndRefusals: a raw image has no checks, with or without a
// repair (exit 63, as qemu-img check); an image exported writable is
// neither checked nor repaired (its metadata may change under the check),
// as qemu-img check refuses it.
func TestCheckRawAndRefusals(t *testing.T) {
	dir := t.TempDir()
	raw := harness.SparseImage(t, dir, "r.raw", 3<<20)
	for _, args := range [][]string{{"check", "--output=json", raw}, {"check", "-r", "all", raw}} {
		if code, out := harness.RunBlockexport(t, args...); code != 63 || !strings.Contains(out, "does not support checks") {
			t.Fatalf("%v: exit %d\n%s", args, code, out)
		}
	}

	img := filepath.Join(dir, "busy.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", img, "4M")
	d := harness.StartExport(t, img, filepath.Join(dir, "busy.mnt"), "-w")
	for _, args := range [][]string{{"check", img}, {"check", "-r", "leaks", img}} {
		code, out := harness.RunBlockexport(t, args...)
		if code != 1 || !strings.Contains(out, "in use") {
			t.Fatalf("%v on an image exported writable: exit %d\n%s", args, code, out)
		}
	}
	d.StopClean()
	if code, out := harness.RunBlockexport(t, "check", img); code != 0 {
		t.Fatalf("check after the export ended: exit %d\n%s", code, out)
	}
}
