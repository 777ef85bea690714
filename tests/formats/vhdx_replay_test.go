package formats

import (
	"bytes"
	"encoding/binary"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// logDesc is one descriptor of a crafted VHDX log entry: a data
// descriptor (data, 4096 bytes) or a zero descriptor (zero bytes).
type logDesc struct {
	off  uint64
	data []byte
	zero uint64
	sig  string // another signature, for a hostile descriptor
}

// logEntry builds one log entry of sequence number seq under guid, as
// QEMU's vhdx_log_write lays it out; badData names a data sector to give
// another sequence number.
func logEntry(guid []byte, seq, fileSize uint64, descs []logDesc, badData bool) []byte {
	le := binary.LittleEndian
	descSectors := (len(descs) + 2 + 127) / 128
	nData := 0
	for _, d := range descs {
		if d.data != nil {
			nData++
		}
	}
	e := make([]byte, (descSectors+nData)*4096)
	copy(e, "loge")
	le.PutUint32(e[8:], uint32(len(e)))
	le.PutUint64(e[16:], seq)
	le.PutUint32(e[24:], uint32(len(descs)))
	copy(e[32:48], guid)
	le.PutUint64(e[48:], fileSize)
	le.PutUint64(e[56:], fileSize)
	ds := e[descSectors*4096:]
	for i, d := range descs {
		x := e[64+32*i:]
		le.PutUint64(x[16:], d.off)
		le.PutUint64(x[24:], seq)
		if d.data == nil {
			copy(x, "zero")
			le.PutUint64(x[8:], d.zero)
		} else {
			copy(x, "desc")
			copy(x[4:8], d.data[4092:])
			copy(x[8:16], d.data[:8])
			copy(ds, "data")
			s := seq
			if badData {
				s++
			}
			le.PutUint32(ds[4:], uint32(s>>32))
			copy(ds[8:4092], d.data[8:4092])
			le.PutUint32(ds[4092:], uint32(s))
			ds = ds[4096:]
		}
		if d.sig != "" {
			copy(x, d.sig)
		}
	}
	vhdxPutCRC(e)
	return e
}

// dirtyVhdx returns b with guid as both headers' log GUID and the
// entries written one after another from the log's start.
func dirtyVhdx(b, guid []byte, entries ...[]byte) []byte {
	b = bytes.Clone(b)
	for _, h := range []int{64 << 10, 128 << 10} {
		copy(b[h+48:], guid)
		vhdxPutCRC(b[h : h+4096])
	}
	at := binary.LittleEndian.Uint64(b[64<<10+72:])
	for _, e := range entries {
		copy(b[at:], e)
		at += uint64(len(e))
	}
	return b
}

// TestVhdxLogReplayAsQemu: `check -r all` replays a dirty VHDX log as
// QEMU 7.2 does at a writable open (qemu-img check -r all on a copy):
// the two files agree byte for byte past the header section, and as
// disks; the log GUID is cleared, so the image opens read-only after
// (refused before, with a line naming `blockexport check -r all`). The
// logs: two entries of data and zero descriptors; sequence gaps (QEMU
// checks sequence numbers from a run's third entry on: 1, 7 replays
// both, 1, 2, 7 the first two); an entry with a bad checksum (nothing
// replayed). Hostile logs
// are refused with the file untouched: a write past the end of the file
// or into the header section, a data sector of another sequence number
// (QEMU writes the descriptors before it first), a descriptor of an
// unknown kind (QEMU fails the open too).
func TestVhdxLogReplayAsQemu(t *testing.T) {
	dir := t.TempDir()
	src := harness.RandomImage(t, dir, 8<<20, 51)
	img := filepath.Join(dir, "good.vhdx")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vhdx", src, img)
	good := harness.ReadAll(t, img)
	size := uint64(len(good))
	guid := []byte("fx-dirty-log-gd1")
	sector := func(seed uint64) []byte { return harness.RandomBytes(4096, seed) }
	e1 := logEntry(guid, 1, size, []logDesc{
		{off: size - 16<<10, data: sector(1)}, {off: size - 12<<10, data: sector(2)}, {off: size - 64<<10, zero: 8 << 10}}, false)
	e2 := logEntry(guid, 2, size, []logDesc{{off: size - 12<<10, data: sector(3)}, {off: size - 40<<10, zero: 4 << 10}}, false)
	e7 := logEntry(guid, 7, size, []logDesc{{off: size - 4<<10, data: sector(7)}}, false)
	badCRC := bytes.Clone(e1)
	badCRC[200] ^= 1

	cases := []struct {
		name    string
		b       []byte
		refused string // ours refuses, naming this; the file untouched
	}{
		{name: "two entries", b: dirtyVhdx(good, guid, e1, e2)},
		{name: "sequence gap after the first entry", b: dirtyVhdx(good, guid, e1, e7)},
		{name: "sequence gap after the second entry", b: dirtyVhdx(good, guid, e1, e2, e7)},
		{name: "bad checksum", b: dirtyVhdx(good, guid, badCRC)},
		{name: "write past the end", refused: "past the end", b: dirtyVhdx(good, guid,
			logEntry(guid, 1, size, []logDesc{{off: size, data: sector(4)}}, false))},
		{name: "write into the headers", refused: "header section", b: dirtyVhdx(good, guid,
			logEntry(guid, 1, size, []logDesc{{off: 64 << 10, data: sector(5)}}, false))},
		{name: "data sector of another sequence", refused: "data sector", b: dirtyVhdx(good, guid,
			logEntry(guid, 1, size, []logDesc{{off: size - 64<<10, zero: 4096}, {off: size - 8<<10, data: sector(6)}}, true))},
		{name: "unknown descriptor", refused: "descriptor", b: dirtyVhdx(good, guid,
			logEntry(guid, 1, size, []logDesc{{off: size - 8<<10, data: sector(8), sig: "what"}}, false))},
		{name: "flushed offset past the end", refused: "truncated", b: dirtyVhdx(good, guid,
			logEntry(guid, 1, size+1<<20, []logDesc{{off: size - 8<<10, data: sector(9)}}, false))},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := t.TempDir()
			ours, theirs := filepath.Join(d, "ours.vhdx"), filepath.Join(d, "qemu.vhdx")
			for _, p := range []string{ours, theirs} {
				if err := os.WriteFile(p, c.b, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			dirty := !bytes.Equal(c.b, dirtyVhdx(good, guid)) && c.name != "bad checksum"
			if dirty && c.refused == "" {
				code, out := harness.RunBlockexport(t, "info", ours)
				if code == 0 || !strings.Contains(out, "blockexport check -r all "+ours) || strings.Count(strings.TrimSpace(out), "\n") != 0 {
					t.Fatalf("info on a dirty log: exit %d, want one line naming check -r all:\n%s", code, out)
				}
			}
			o := ourCheck(t, "-r", "all", "--output", "json", ours)
			q := qemuCheck(t, "-r", "all", "--output", "json", theirs)
			if c.refused != "" {
				if o.code != 1 || !strings.Contains(o.out, c.refused) {
					t.Fatalf("check -r all: exit %d, want 1 naming %q\n%s", o.code, c.refused, o.out)
				}
				if !bytes.Equal(harness.ReadAll(t, ours), c.b) {
					t.Fatal("a refused replay changed the file")
				}
				t.Logf("qemu-img check -r all: exit %d\n%s", q.code, q.out)
				return
			}
			if o.code != q.code {
				t.Fatalf("check -r all: exit %d, qemu-img's %d\nours:\n%s\nqemu-img:\n%s", o.code, q.code, o.out, q.out)
			}
			delete(o.json, "filename")
			delete(q.json, "filename")
			if !equalJSON(o.json, q.json) {
				t.Fatalf("check -r all JSON %v, qemu-img's %v", o.json, q.json)
			}
			a, b := harness.ReadAll(t, ours), harness.ReadAll(t, theirs)
			if len(a) != len(b) || !bytes.Equal(a[1<<20:], b[1<<20:]) {
				t.Fatalf("replayed files differ past the header section (sizes %d, %d)", len(a), len(b))
			}
			if dirty && bytes.Equal(a, c.b) {
				t.Fatal("nothing was replayed")
			}
			harness.Run(t, "qemu-img", "compare", "-f", "vhdx", "-F", "vhdx", ours, theirs)
			// Ours opens it read-only now, and reads what QEMU reads.
			if code, out := harness.RunBlockexport(t, "info", ours); code != 0 {
				t.Fatalf("info after the replay: exit %d\n%s", code, out)
			}
			mnt := filepath.Join(d, "mnt")
			harness.StartExport(t, ours, mnt)
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "vhdx", mnt, theirs)
			// A second replay finds nothing to do.
			if o := ourCheck(t, "-r", "all", theirs); o.code != 0 || strings.Contains(o.out, "repaired") {
				t.Fatalf("second check -r all: exit %d\n%s", o.code, o.out)
			}
		})
	}
}

// equalJSON compares two decoded JSON objects.
func equalJSON(a, b map[string]any) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}
