package qcow2

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/blockexport/blockexport/aio"
)

// snapshotImage makes an image with 4 KiB clusters, data, a compressed
// cluster and one snapshot taken by qemu-img, then changes the data.
func snapshotImage(t *testing.T, dir string) string {
	t.Helper()
	img := filepath.Join(dir, "base.qcow2")
	for _, args := range [][]string{
		{"qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=4096", img, "8M"},
		{"qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 0 3M", "-c", "write -c -P 0x33 5M 4k", img},
		{"qemu-img", "snapshot", "-c", "s1", img},
		{"qemu-io", "-f", "qcow2", "-c", "write -P 0x77 1M 64k", img},
	} {
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v (apt-get install qemu-utils)\n%s", args, err, out)
		}
	}
	return img
}

// openSnapshotTest opens img for writing through f's wrapper.
func openSnapshotTest(t *testing.T, img string, wrap func(aio.File) aio.File) *Image {
	t.Helper()
	f, err := aio.Open(img, aio.Options{Backend: aio.Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	q, err := New(context.Background(), wrap(f), Options{Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	return q
}

// TestSnapshotTableEncodingIsQemus: the table written for qemu-img's own
// entries is byte for byte the table qemu-img wrote.
func TestSnapshotTableEncodingIsQemus(t *testing.T) {
	dir := t.TempDir()
	img := snapshotImage(t, dir)
	if out, err := exec.Command("qemu-img", "snapshot", "-c", "second-snapshot", img).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img snapshot: %v\n%s", err, out)
	}
	q := openSnapshotTest(t, img, func(f aio.File) aio.File { return f })
	defer q.Close()
	raw, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	off := int64(q.h.snapshotsOffset)
	got := encodeSnapshotTable(q.snaps)
	if want := raw[off : off+q.snapTableBytes]; !bytes.Equal(got[:len(want)], want) || len(got)-len(want) >= 8 {
		t.Fatalf("encoded table (%d bytes) differs from qemu-img's (%d bytes)\n% x\n% x", len(got), len(want), got, want)
	}
	if len(q.snaps) != 2 || q.snaps[1].Name != "second-snapshot" || q.snaps[1].ID != "2" {
		t.Fatalf("snapshots read: %+v", q.Snapshots())
	}
}

// snapshotNamesOf is qemu-img snapshot -l's list of img, without dates.
func snapshotNamesOf(t *testing.T, img string) string {
	t.Helper()
	out, err := exec.Command("qemu-img", "snapshot", "-l", img).CombinedOutput()
	if err != nil {
		t.Fatalf("qemu-img snapshot -l: %v\n%s", err, out)
	}
	var names []string
	for _, l := range strings.Split(string(out), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] != "ID" && f[0] != "Snapshot" {
			names = append(names, f[0]+" "+f[1])
		}
	}
	return strings.Join(names, ",")
}

// consistentAfterCut fails unless qemu-img check finds at most leaks, or
// COPIED flags out of step with a refcount (the moment between the two
// writes, which QEMU's own snapshot code has too) and nothing else.
func consistentAfterCut(t *testing.T, img, what string) {
	t.Helper()
	out, err := exec.Command("qemu-img", "check", img).CombinedOutput()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return
	case errors.As(err, &ee) && ee.ExitCode() == 3:
		return
	case errors.As(err, &ee) && ee.ExitCode() == 2:
		for _, l := range strings.Split(string(out), "\n") {
			if strings.HasPrefix(l, "ERROR") && !strings.Contains(l, "OFLAG_COPIED") {
				t.Fatalf("%s: qemu-img check: %s\n%s", what, l, out)
			}
		}
		t.Logf("%s: COPIED flags out of step with refcounts, as after a crash of QEMU there", what)
		return
	}
	t.Fatalf("%s: qemu-img check: %v\n%s", what, err, out)
}

// TestSnapshotStepsCutAtEveryWriteLeaveAConsistentImage cuts create,
// delete and apply after each of their writes, as a process killed there
// leaves the file: the image checks consistent, and the snapshot list and
// the active layer read as before the step or as after it.
func TestSnapshotStepsCutAtEveryWriteLeaveAConsistentImage(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	base := snapshotImage(t, dir)
	pristine, err := os.ReadFile(base)
	if err != nil {
		t.Fatal(err)
	}
	steps := []struct {
		name string
		do   func(q *Image) error
	}{
		{"create", func(q *Image) error { return q.CreateSnapshot(ctx, "s2", time.Unix(1e9, 0)) }},
		{"delete", func(q *Image) error { return q.DeleteSnapshot(ctx, "s1") }},
		{"apply", func(q *Image) error { return q.ApplySnapshot(ctx, "s1") }},
	}
	beforeData, beforeNames := qemuRawBytes(t, base), snapshotNamesOf(t, base)
	for _, st := range steps {
		img := filepath.Join(dir, st.name+".qcow2")
		if err := os.WriteFile(img, pristine, 0o644); err != nil {
			t.Fatal(err)
		}
		counter := &killedFile{n: 1 << 30}
		q := openSnapshotTest(t, img, func(f aio.File) aio.File { counter.File = f; return counter })
		if err := st.do(q); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		if err := q.Close(); err != nil {
			t.Fatal(err)
		}
		afterData, afterNames := qemuRawBytes(t, img), snapshotNamesOf(t, img)
		if st.name == "apply" && !bytes.Equal(afterData[1<<20:1<<20+4096], bytes.Repeat([]byte{0x5a}, 4096)) {
			t.Fatal("apply: the active layer does not read as the snapshot")
		}
		t.Logf("%s: %d writes, each cut after", st.name, counter.writes)
		for n := range counter.writes {
			what := fmt.Sprintf("%s cut after %d of %d writes", st.name, n, counter.writes)
			if err := os.WriteFile(img, pristine, 0o644); err != nil {
				t.Fatal(err)
			}
			q := openSnapshotTest(t, img, func(f aio.File) aio.File { return &killedFile{File: f, n: n} })
			if err := st.do(q); err == nil {
				t.Fatalf("%s: no error", what)
			}
			q.Close() // its writes fail too: the file stays as cut
			consistentAfterCut(t, img, what)
			data, names := qemuRawBytes(t, img), snapshotNamesOf(t, img)
			before := bytes.Equal(data, beforeData) && names == beforeNames
			after := bytes.Equal(data, afterData) && names == afterNames
			if !before && !after {
				t.Fatalf("%s: reads neither as before (%s) nor as after (%s): %s", what, beforeNames, afterNames, names)
			}
		}
	}
}
