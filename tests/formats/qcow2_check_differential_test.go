package formats

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// A differential run of check against qemu-img check (7.2), as issue 25
// describes it: an image made by qemu-img with data and a snapshot, one
// field corrupted per case, then each tool, on its own copy, checks it
// with no repair, with -r leaks and with -r all. The exit statuses and the
// JSON counts must be the same; after a repair the guest data ours left
// must be at least what qemu-img's left, and where qemu-img left the file
// untouched (a refused repair) ours must be untouched too.

// checkCounts are the fields of qemu-img check's JSON that the run compares.
// The allocation figures are compared too; image-end-offset is compared
// except after -r all, whose rebuilt structures go to fresh clusters at
// the end of the file where qemu-img reuses free ones inside it (so that
// a kill leaves the old structures intact).
var checkCounts = []string{"corruptions", "leaks", "check-errors", "corruptions-fixed", "leaks-fixed",
	"allocated-clusters", "fragmented-clusters", "compressed-clusters", "total-clusters", "image-end-offset"}

// checkRun is one checker's run: exit status, the counts (nil when it
// printed no JSON, as when the check failed), and its stderr.
type checkRun struct {
	code   int
	counts map[string]int64
	stderr string
}

func (r checkRun) String() string {
	if r.counts == nil {
		return fmt.Sprintf("exit %d, no JSON", r.code)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "exit %d", r.code)
	for _, k := range checkCounts {
		if r.counts[k] != 0 {
			fmt.Fprintf(&b, " %s=%d", k, r.counts[k])
		}
	}
	return b.String()
}

// runCheck runs name check [-r mode] --output=json img.
func runCheck(t *testing.T, name, mode, img string) checkRun {
	t.Helper()
	args := []string{"check", "-f", "qcow2", "--output=json"}
	if mode != "" {
		args = append(args, "-r", mode)
	}
	// A hang is a finding, not a stuck suite.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, append(args, img)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	r := checkRun{stderr: stderr.String()}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		r.code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("%s %v: %v", name, args, err)
	}
	if ctx.Err() != nil {
		t.Fatalf("%s %v: still running after a minute", name, args)
	}
	if len(bytes.TrimSpace(out)) > 0 {
		m := map[string]any{}
		if err := json.Unmarshal(out, &m); err != nil {
			t.Fatalf("%s %v: exit %d, not JSON: %v\n%s", name, args, r.code, err, out)
		}
		r.counts = map[string]int64{}
		for _, k := range checkCounts {
			if v, ok := m[k].(float64); ok {
				r.counts[k] = int64(v)
			}
		}
	}
	return r
}

// corruptionLayout is where the base image keeps what the cases corrupt.
type corruptionLayout struct {
	cs, size                     int64
	l1, rt, snapTable, snapL1    int64
	rb0, l2, data0, dataPrivate  int64 // data0 is shared with the snapshot
	l1Entry0, l2Entry0, l2Entry1 uint64
}

func corruptionLayoutOf(t *testing.T, img string) corruptionLayout {
	t.Helper()
	b, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	be := binary.BigEndian
	l := corruptionLayout{cs: 1 << be.Uint32(b[20:]), size: int64(len(b))}
	l.l1 = int64(be.Uint64(b[40:]))
	l.rt = int64(be.Uint64(b[48:]))
	l.snapTable = int64(be.Uint64(b[64:]))
	l.snapL1 = int64(be.Uint64(b[l.snapTable:]))
	l.rb0 = int64(be.Uint64(b[l.rt:]))
	l.l1Entry0 = be.Uint64(b[l.l1:])
	l.l2 = int64(l.l1Entry0 & 0x00fffffffffffe00)
	l.l2Entry0 = be.Uint64(b[l.l2:])
	l.l2Entry1 = be.Uint64(b[l.l2+8:])
	l.data0 = int64(l.l2Entry0 & 0x00fffffffffffe00)
	l.dataPrivate = int64(l.l2Entry1 & 0x00fffffffffffe00)
	if be.Uint32(b[96:]) != 4 || l.l2Entry0&(1<<63) != 0 || l.l2Entry1&(1<<63) == 0 || l.snapL1 == 0 {
		t.Fatalf("the base image is not laid out as the cases expect: %+v", l)
	}
	return l
}

func patch64(t *testing.T, img string, off int64, v uint64) {
	t.Helper()
	patchFile(t, img, off, binary.BigEndian.AppendUint64(nil, v))
}

func patch32(t *testing.T, img string, off int64, v uint32) {
	t.Helper()
	patchFile(t, img, off, binary.BigEndian.AppendUint32(nil, v))
}

// setCorruptionRefcount sets the 16-bit refcount of the cluster at host offset off.
func setCorruptionRefcount(t *testing.T, img string, l corruptionLayout, off int64, v uint16) {
	t.Helper()
	patchFile(t, img, l.rb0+2*(off/l.cs), binary.BigEndian.AppendUint16(nil, v))
}

// corruptionCase is one corruption. differ names, by mode ("", "leaks", "all"),
// the runs whose status or counts may differ from qemu-img's, and why; the
// safety checks hold for them all the same.
type corruptionCase struct {
	name    string
	corrupt func(t *testing.T, img string, l corruptionLayout)
	differ  map[string]string
}

func corruptionCases() []corruptionCase {
	const bit63 = uint64(1) << 63
	return []corruptionCase{
		// The refcount table.
		{name: "reftable entry to a data cluster", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.rt, uint64(l.data0)) }},
		{name: "reftable entry to the L1 table", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.rt, uint64(l.l1)) }},
		{name: "reftable entry to an L2 table", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.rt, uint64(l.l2)) }},
		{name: "reftable entry to the reftable", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.rt, uint64(l.rt)) }},
		{name: "reftable entry to the snapshot L1", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.rt, uint64(l.snapL1)) }},
		{name: "two reftable entries, one block", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.rt+8, uint64(l.rb0)) }},
		{name: "reftable entry misaligned", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.rt, uint64(l.rb0+512)) },
			differ: map[string]string{"all": "qemu-img marks the image corrupt when it reads the misaligned block, and its rebuild then fails (exit 1, image left marked corrupt); ours rebuilds in fresh clusters and the image checks clean with all data"}},
		{name: "reftable entry reserved bits", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.rt, uint64(l.rb0)|1) },
			differ: map[string]string{"all": "qemu-img's rebuild puts a refcount block in a cluster its IMRT thinks free, the old block the bad entry still names; its own overlap check stops it (exit 1, image marked corrupt); ours rebuilds past the end and the image checks clean with all data"}},
		{name: "reftable entry past EOF", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.rt, uint64(l.size+16*l.cs)) }},
		{name: "second reftable entry past EOF", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.rt+8, uint64(l.size+16*l.cs)) }},
		{name: "reftable entry bit 63", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.rt, uint64(l.rb0)|bit63) }},
		{name: "reftable entry missing", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.rt, 0) }},
		// Refcount block entries.
		{name: "leaked cluster", corrupt: func(t *testing.T, img string, l corruptionLayout) {
			if err := os.Truncate(img, l.size+l.cs); err != nil {
				t.Fatal(err)
			}
			setCorruptionRefcount(t, img, l, l.size, 1)
		}},
		{name: "refcount too high", corrupt: func(t *testing.T, img string, l corruptionLayout) { setCorruptionRefcount(t, img, l, l.dataPrivate, 2) }},
		{name: "refcount zero for data", corrupt: func(t *testing.T, img string, l corruptionLayout) { setCorruptionRefcount(t, img, l, l.dataPrivate, 0) }},
		{name: "refcount too low for shared data", corrupt: func(t *testing.T, img string, l corruptionLayout) { setCorruptionRefcount(t, img, l, l.data0, 1) }},
		{name: "refcount zero for the L1 table", corrupt: func(t *testing.T, img string, l corruptionLayout) { setCorruptionRefcount(t, img, l, l.l1, 0) }},
		{name: "refcount zero for the refcount block", corrupt: func(t *testing.T, img string, l corruptionLayout) { setCorruptionRefcount(t, img, l, l.rb0, 0) }},
		{name: "refcount two for the refcount block", corrupt: func(t *testing.T, img string, l corruptionLayout) { setCorruptionRefcount(t, img, l, l.rb0, 2) }},
		// L1 entries.
		{name: "L1 entry misaligned", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.l1, l.l1Entry0+512) }},
		{name: "L1 entry past EOF", corrupt: func(t *testing.T, img string, l corruptionLayout) {
			patch64(t, img, l.l1, bit63|uint64(l.size+16*l.cs))
		}},
		{name: "L1 entry reserved bits", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.l1, l.l1Entry0|1<<56) }},
		{name: "L1 entry COPIED missing", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.l1, l.l1Entry0&^bit63) }},
		{name: "L1 entry to the reftable", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.l1, bit63|uint64(l.rt)) }},
		{name: "L1 entry to the refcount block", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.l1, bit63|uint64(l.rb0)) }},
		// L2 entries.
		{name: "L2 entry misaligned", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.l2+8, l.l2Entry1+512) }},
		{name: "L2 zero entry misaligned", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.l2+8, l.l2Entry1+512|1) }},
		{name: "L2 entry past EOF", corrupt: func(t *testing.T, img string, l corruptionLayout) {
			patch64(t, img, l.l2+8, bit63|uint64(l.size+16*l.cs))
		}},
		{name: "L2 entry reserved bits", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.l2+8, l.l2Entry1|2) }},
		{name: "L2 entry to the L1 table", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.l2+8, bit63|uint64(l.l1)) }},
		{name: "L2 entry to the refcount block", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.l2+8, bit63|uint64(l.rb0)) }},
		{name: "L2 entry to the header", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.l2+8, bit63|512) }},
		{name: "L2 entry COPIED missing", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.l2+8, l.l2Entry1&^bit63) }},
		{name: "L2 entry COPIED on shared data", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.l2, l.l2Entry0|bit63) }},
		{name: "two L2 entries, one cluster", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.l2+8*8, l.l2Entry1) }},
		// Header fields and tables.
		{name: "L1 table misaligned", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, 40, uint64(l.l1+512)) }},
		{name: "L1 table past EOF", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, 40, uint64(l.size+16*l.cs)) }},
		{name: "L1 table bit 63", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, 40, uint64(l.l1)|bit63) }},
		{name: "reftable past EOF", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, 48, uint64(l.size+16*l.cs)) }},
		{name: "snapshot table past EOF", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, 64, uint64(l.size+16*l.cs)) }},
		{name: "snapshot table misaligned", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, 64, uint64(l.snapTable+8)) }},
		{name: "snapshot table bit 63", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, 64, uint64(l.snapTable)|bit63) }},
		{name: "snapshot L1 past EOF", corrupt: func(t *testing.T, img string, l corruptionLayout) {
			patch64(t, img, l.snapTable, uint64(l.size+16*l.cs))
		}},
		{name: "snapshot L1 bit 63", corrupt: func(t *testing.T, img string, l corruptionLayout) {
			patch64(t, img, l.snapTable, uint64(l.snapL1)|bit63)
		}},
		{name: "snapshot L1 misaligned", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, l.snapTable, uint64(l.snapL1+512)) }},
		{name: "snapshot L1 too large", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch32(t, img, l.snapTable+8, 1<<23) }},
		{name: "snapshot extra data too large", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch32(t, img, l.snapTable+36, 2000) }},
		{name: "snapshot count too large", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch32(t, img, 60, 70000) }},
		{name: "dirty bit and a leak", corrupt: func(t *testing.T, img string, l corruptionLayout) {
			patch64(t, img, 72, 1)
			if err := os.Truncate(img, l.size+l.cs); err != nil {
				t.Fatal(err)
			}
			setCorruptionRefcount(t, img, l, l.size, 1)
		}},
		{name: "corrupt bit", corrupt: func(t *testing.T, img string, l corruptionLayout) { patch64(t, img, 72, 2) }},
	}
}

// corruptionBaseImage makes the image the cases start from: 64 KiB clusters,
// data before and after an internal snapshot (so some clusters are shared
// and some are the active layer's alone).
func corruptionBaseImage(t *testing.T, dir string) string {
	t.Helper()
	img := filepath.Join(dir, "base.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", img, "8M")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 0 256k", "-c", "write -P 0x33 1M 64k", img)
	harness.Run(t, "qemu-img", "snapshot", "-c", "s1", img)
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x77 64k 64k", "-c", "write -P 0x11 4M 128k", img)
	return img
}

// guestBytes returns the guest data of img as qemu-img reads it, or nil when
// qemu-img cannot read it.
func guestBytes(t *testing.T, img string) []byte {
	t.Helper()
	raw := img + ".raw"
	if err := exec.Command("qemu-img", "convert", "-f", "qcow2", "-O", "raw", img, raw).Run(); err != nil {
		return nil
	}
	defer os.Remove(raw)
	return harness.ReadAll(t, raw)
}

// keptLess returns the first 4 KiB block (as a guest offset) where
// want agrees with orig and got does not, or -1.
func keptLess(orig, want, got []byte) int64 {
	const blk = 4096
	for off := 0; off < len(orig); off += blk {
		end := min(off+blk, len(orig))
		if end > len(want) || !bytes.Equal(orig[off:end], want[off:end]) {
			continue
		}
		if end > len(got) || !bytes.Equal(orig[off:end], got[off:end]) {
			return int64(off)
		}
	}
	return -1
}

// TestQcow2CheckAndRepairMatchQemuImgOnCorruptions is the differential run.
func TestQcow2CheckAndRepairMatchQemuImgOnCorruptions(t *testing.T) {
	dir := t.TempDir()
	base := corruptionBaseImage(t, dir)
	l := corruptionLayoutOf(t, base)
	orig := guestBytes(t, base)
	if orig == nil {
		t.Fatal("qemu-img cannot read the base image")
	}
	cases := corruptionCases()
	if len(cases) < 34 {
		t.Fatalf("%d cases; the issue's run had 34", len(cases))
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel() // each case has its own copy; the base is only read
			cdir := t.TempDir()
			broken := filepath.Join(cdir, "broken.qcow2")
			copyFile(t, base, broken)
			c.corrupt(t, broken, l)
			compareCheckRuns(t, broken, orig, c.differ)
		})
	}
}

// compareCheckRuns runs both checkers on copies of broken with no repair, -r
// leaks and -r all, and compares them; orig is the guest data before the
// corruption. differ names the runs allowed to differ, and why.
func compareCheckRuns(t *testing.T, broken string, orig []byte, differ map[string]string) {
	t.Helper()
	cdir := filepath.Dir(broken)
	brokenBytes := harness.ReadAll(t, broken)
	for _, mode := range []string{"", "leaks", "all"} {
		qImg := filepath.Join(cdir, "q"+mode+".qcow2")
		oImg := filepath.Join(cdir, "o"+mode+".qcow2")
		copyFile(t, broken, qImg)
		copyFile(t, broken, oImg)
		q := runCheck(t, "qemu-img", mode, qImg)
		o := runCheck(t, harness.Bin, mode, oImg)
		label := "check"
		if mode != "" {
			label += " -r " + mode
		}
		same := q.code == o.code && (q.counts == nil) == (o.counts == nil)
		if same && q.counts != nil {
			for _, k := range checkCounts {
				same = same && (q.counts[k] == o.counts[k] || k == "image-end-offset" && mode == "all")
			}
		}
		if why, ok := differ[mode]; ok {
			t.Logf("%s: qemu-img %v, blockexport %v (expected to differ: %s)", label, q, o, why)
		} else if !same {
			t.Errorf("%s: qemu-img %v, blockexport %v\nqemu-img said:\n%s\nblockexport said:\n%s", label, q, o, q.stderr, o.stderr)
		}
		if strings.Contains(q.stderr, "need to rebuild refcount structures") && !strings.Contains(o.stderr, "need to rebuild refcount structures") {
			t.Errorf("%s: qemu-img refuses, needing a rebuild; ours does not say so:\n%s", label, o.stderr)
		}
		if strings.Contains(o.stderr, "panic:") || strings.Contains(o.stderr, "goroutine ") {
			t.Errorf("%s: blockexport panicked:\n%s", label, o.stderr)
		}
		if mode == "" {
			if !bytes.Equal(harness.ReadAll(t, oImg), brokenBytes) {
				t.Errorf("check without -r changed the image")
			}
			continue
		}
		// Safety after a repair.
		if bytes.Equal(harness.ReadAll(t, qImg), brokenBytes) && !bytes.Equal(harness.ReadAll(t, oImg), brokenBytes) {
			t.Errorf("%s: qemu-img left the image untouched, blockexport changed it", label)
		}
		qData, oData := guestBytes(t, qImg), guestBytes(t, oImg)
		switch {
		case qData == nil:
		case oData == nil:
			t.Errorf("%s: qemu-img reads its repaired image, not ours", label)
		default:
			if off := keptLess(orig, qData, oData); off >= 0 {
				t.Errorf("%s: our repair lost guest data at %#x that qemu-img's kept", label, off)
			}
		}
		// What qemu-img check makes of each repaired image.
		qq, qo := runCheck(t, "qemu-img", "", qImg), runCheck(t, "qemu-img", "", oImg)
		if qo.code > qq.code && qq.code != 1 {
			t.Errorf("%s: qemu-img check finds qemu-img's repair %v, ours %v\n%s", label, qq, qo, qo.stderr)
		}
		if _, ok := differ[mode]; ok && qo.code != 0 {
			// A difference is allowed only where ours does better.
			t.Errorf("%s: differs from qemu-img, and qemu-img check finds our repair %v\n%s", label, qo, qo.stderr)
		}
	}
}
