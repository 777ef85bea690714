package qcow2

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/aio"
)

// layout is where qemu-img put an image's metadata, read from the file
// itself (not through the code under test).
type layout struct {
	cs, l1, rt, rb, l2 int64
}

func readLayout(t *testing.T, p string) layout {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	be := binary.BigEndian
	l := layout{cs: 1 << be.Uint32(b[20:]), l1: int64(be.Uint64(b[40:])), rt: int64(be.Uint64(b[48:]))}
	l.rb = int64(be.Uint64(b[l.rt:]))
	l.l2 = int64(be.Uint64(b[l.l1:]) & l1OffsetMask)
	return l
}

// setRefcount16 stores the 16-bit refcount of host cluster c (in the first
// refcount block) in the file.
func setRefcount16(t *testing.T, p string, l layout, c int64, v uint16) {
	patch(t, p, l.rb+c*2, binary.BigEndian.AppendUint16(nil, v))
}

func corruptBit(t *testing.T, p string) bool {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return binary.BigEndian.Uint64(b[72:])&incCorrupt != 0
}

// TestWritesNeverLandOnMetadata: with a refcount too low, or an L2 or L1
// entry pointing at metadata, the write that would land on it fails with
// ErrCorrupt (EIO to clients), the image is marked corrupt (QEMU's
// "Preventing invalid write on metadata"), one line names the structure,
// later writes and writable opens are refused, and nothing else in the
// file changes.
func TestWritesNeverLandOnMetadata(t *testing.T) {
	cases := []struct {
		name   string
		break_ func(t *testing.T, p string, l layout)
		write  func(q *Image) error
		want   string // the structure named
	}{
		{"L1 cluster at refcount 0, then an allocation", func(t *testing.T, p string, l layout) {
			setRefcount16(t, p, l, l.l1/l.cs, 0)
		}, func(q *Image) error { _, err := q.WriteAt(context.Background(), make([]byte, 4096), 3<<16); return err }, "active L1 table"},
		{"refcount table cluster at refcount 0", func(t *testing.T, p string, l layout) {
			setRefcount16(t, p, l, l.rt/l.cs, 0)
		}, func(q *Image) error { _, err := q.WriteAt(context.Background(), make([]byte, 4096), 3<<16); return err }, "refcount table"},
		{"snapshot's L1 table at refcount 0, then an allocation", func(t *testing.T, p string, l layout) {
			tool(t, "qemu-img", "snapshot", "-c", "s", p)
			b, _ := os.ReadFile(p)
			st := binary.BigEndian.Uint64(b[64:])
			snapL1 := int64(binary.BigEndian.Uint64(b[st:]))
			setRefcount16(t, p, l, snapL1/l.cs, 0)
		}, func(q *Image) error { _, err := q.WriteAt(context.Background(), make([]byte, 4096), 3<<16); return err }, "inactive L1 table"},
		{"L2 entry -> L1 table", func(t *testing.T, p string, l layout) {
			patch(t, p, l.l2, be64(uint64(l.l1)|oflagCopied))
		}, func(q *Image) error { _, err := q.WriteAt(context.Background(), make([]byte, 4096), 0); return err }, "active L1 table"},
		{"L2 entry -> L1 table, inline write", func(t *testing.T, p string, l layout) {
			patch(t, p, l.l2, be64(uint64(l.l1)|oflagCopied))
		}, func(q *Image) error {
			ctx := context.Background()
			q.ReadAt(ctx, make([]byte, 512), 0) // caches the L2 table
			done, err := q.TryWriteAt(make([]byte, 4096), 0)
			if !done {
				return errors.New("the inline write did not run")
			}
			return err
		}, "active L1 table"},
		{"L2 entry -> its own L2 table", func(t *testing.T, p string, l layout) {
			patch(t, p, l.l2, be64(uint64(l.l2)|oflagCopied))
		}, func(q *Image) error { _, err := q.WriteAt(context.Background(), make([]byte, 4096), 0); return err }, "active L2 table"},
		{"L2 entry -> refcount table", func(t *testing.T, p string, l layout) {
			patch(t, p, l.l2, be64(uint64(l.rt)|oflagCopied))
		}, func(q *Image) error { _, err := q.WriteAt(context.Background(), make([]byte, 4096), 100); return err }, "refcount table"},
		{"L2 entry -> refcount block", func(t *testing.T, p string, l layout) {
			patch(t, p, l.l2, be64(uint64(l.rb)|oflagCopied))
		}, func(q *Image) error { return q.WriteZeroes(context.Background(), 10, 100, false) }, "refcount block"},
		{"L1 entry -> refcount table", func(t *testing.T, p string, l layout) {
			patch(t, p, l.l1, be64(uint64(l.rt)|oflagCopied))
		}, func(q *Image) error { _, err := q.WriteAt(context.Background(), make([]byte, 4096), 1<<16); return err }, "refcount table"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "m.qcow2")
			tool(t, "qemu-img", "create", "-q", "-f", "qcow2", p, "4M")
			qio(t, p, "write -P 1 0 64k", "write -P 2 64k 64k")
			l := readLayout(t, p)
			c.break_(t, p, l)
			before, _ := os.ReadFile(p)
			var logs bytes.Buffer
			q, err := openTest(p, testOpts{Writable: true, Backend: aio.Threads, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
			if err != nil {
				t.Fatal(err)
			}
			err = c.write(q)
			if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("write: %v; want ErrCorrupt naming the %s", err, c.want)
			}
			// Refused from now on, with no second log line.
			if _, err := q.WriteAt(context.Background(), []byte{1}, 2<<16); !errors.Is(err, ErrCorrupt) {
				t.Errorf("a later write: %v; want it refused", err)
			}
			if err := q.Close(); err != nil {
				t.Fatalf("close: %v", err)
			}
			if n := strings.Count(logs.String(), "preventing invalid write on metadata"); n != 1 || !strings.Contains(logs.String(), c.want) {
				t.Errorf("log has %d lines about it, want one naming the %s:\n%s", n, c.want, logs.String())
			}
			if !corruptBit(t, p) {
				t.Error("the corrupt bit is not set")
			}
			// Nothing that was there changed; a refused allocating write may
			// have left its data in a cluster past the old end, which is
			// free again.
			after, _ := os.ReadFile(p)
			copy(after[72:80], before[72:80])
			if d := firstDiff(before, after); d < len(before) {
				t.Errorf("the file changed at byte %#x besides the corrupt bit", d)
			}
			if _, err := openTest(p, testOpts{Writable: true, Backend: aio.Threads}); err == nil || !strings.Contains(err.Error(), "corrupt") {
				t.Errorf("a writable open after: %v; want it refused", err)
			}
			if out := tool(t, "qemu-img", "info", "--output=json", p); !strings.Contains(out, `"corrupt": true`) {
				t.Errorf("qemu-img info does not see the corrupt bit:\n%s", out)
			}
		})
	}
}

// TestCompressedEntryIntoTheHeader: overwriting a compressed cluster whose
// entry points into the header must not free (and punch out) the header's
// cluster, which the next allocation would hand out.
func TestCompressedEntryIntoTheHeader(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.qcow2")
	tool(t, "qemu-img", "create", "-q", "-f", "qcow2", p, "4M")
	qio(t, p, "write -c -P 7 0 64k")
	l := readLayout(t, p)
	b, _ := os.ReadFile(p)
	e := binary.BigEndian.Uint64(b[l.l2:])
	x := 62 - (16 - 8)      // offset bits for 64 KiB clusters
	e = e&^(1<<x-1) | 0x200 // same sector count, data in the header
	patch(t, p, l.l2, be64(e))
	header := slices64k(t, p)
	var logs bytes.Buffer
	q, err := openTest(p, testOpts{Writable: true, Backend: aio.Threads, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	data := bytes.Repeat([]byte{9}, 64<<10)
	if _, err := q.WriteAt(ctx, data, 0); err != nil {
		t.Fatalf("the write itself is fine: %v", err)
	}
	if err := q.Flush(ctx); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "image header") {
		t.Fatalf("flush: %v; want the header's free refused", err)
	}
	if _, err := q.WriteAt(ctx, data, 1<<20); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("a write after: %v; want it refused", err)
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	got := slices64k(t, p)
	copy(got[72:80], header[72:80])
	if !bytes.Equal(got, header) {
		t.Fatalf("the header cluster changed at byte %d", firstDiff(got, header))
	}
	if !corruptBit(t, p) || !strings.Contains(logs.String(), "image header") {
		t.Fatalf("corrupt bit %v; log:\n%s", corruptBit(t, p), logs.String())
	}
	l2 := readLayout(t, p)
	b, _ = os.ReadFile(p)
	if rc := binary.BigEndian.Uint16(b[l2.rb:]); rc != 1 {
		t.Fatalf("the header's refcount is %d, want 1", rc)
	}
	// What was written reads back, through QEMU.
	out := tool(t, "qemu-io", "-r", "-f", "qcow2", "-c", "read -P 9 0 64k", p)
	if strings.Contains(out, "Pattern verification failed") {
		t.Fatalf("written data lost:\n%s", out)
	}
}

func slices64k(t *testing.T, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b[:64<<10]
}

func TestMetaMapOverlap(t *testing.T) {
	m := &metaMap{clusters: map[int64]metaUse{}}
	m.setRange(metaHeader, 0, 1, 512)
	m.setRange(metaL1, 10*512, 3*512, 512) // clusters 10-12
	m.setSnapshotL1s([]metaRange{{100, 104, metaSnapL1}, {50, 51, metaSnapL1}, {60, 70, metaSnapL1}})
	m.addL2(20, 1)
	m.addRB(30, 1)
	m.addL2(40, 1)
	m.addL2(40, -1) // unlinked again
	for _, c := range []struct {
		a, b  int64
		allow metaKind
		want  metaKind
	}{
		{0, 1, metaNone, metaHeader}, {1, 10, metaNone, metaNone}, {12, 13, metaNone, metaL1},
		{13, 20, metaNone, metaNone}, {20, 21, metaNone, metaL2}, {20, 21, metaL2, metaNone},
		{30, 31, metaL2, metaRefBlock}, {40, 41, metaNone, metaNone}, {49, 50, metaNone, metaNone},
		{50, 51, metaNone, metaSnapL1}, {51, 60, metaNone, metaNone}, {65, 66, metaNone, metaSnapL1},
		{70, 100, metaNone, metaNone}, {103, 200, metaNone, metaSnapL1}, {104, 1 << 40, metaNone, metaNone},
		{0, 1 << 40, metaHeader, metaL1},
	} {
		if got := m.overlap(c.a, c.b, c.allow); got != c.want {
			t.Errorf("overlap [%d, %d) allowing %v: %v, want %v", c.a, c.b, c.allow, got, c.want)
		}
	}
}
