package nbd

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
	"github.com/blockexport/blockexport/tests/internal/harness"
)

// startQemuNbd serves img with qemu-nbd (persistent, so several clients
// may connect in turn); its URI is "nbd+unix:///?socket="+Sock.
func startQemuNbd(t *testing.T, img string, args ...string) *harness.ServerProc {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "qemu-nbd.sock")
	argv := append([]string{"-t", "-k", sock}, args...)
	return harness.StartServerProc(t, sock, "qemu-nbd", append(argv, img)...)
}

// qemuMap is nbdinfo --map=CONTEXT of img served by qemu-nbd with args,
// stopped after.
func qemuMap(t *testing.T, context, img string, args ...string) string {
	t.Helper()
	q := startQemuNbd(t, img, args...)
	defer q.Kill()
	return nbdinfoMap(t, context, "nbd+unix:///?socket="+q.Sock)
}

// imageWithBitmap is a 64 MiB qcow2 image with data, the persistent
// bitmap bm0 (64 KiB granularity) and writes after it that bm0 records.
func imageWithBitmap(t *testing.T, dir string) string {
	t.Helper()
	img := filepath.Join(dir, "disk.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", img, "64M")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0xaa 0 4M", img)
	harness.Run(t, "qemu-img", "bitmap", "--add", img, "bm0")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 1 8M 100k", "-c", "write -z 20M 4k", "-c", "write -P 2 63M 1M", "-c", "discard 1M 64k", img)
	return img
}

// nbdinfoMap is nbdinfo --map=CONTEXT's extent list.
func nbdinfoMap(t *testing.T, context, uri string) string {
	t.Helper()
	return harness.Run(t, "nbdinfo", "--map="+context, uri)
}

func TestDirtyBitmapContextMatchesQemuNbd(t *testing.T) {
	img := imageWithBitmap(t, t.TempDir())
	want := qemuMap(t, "qemu:dirty-bitmap:bm0", img, "-r", "-B", "bm0")
	if !strings.Contains(want, "dirty") {
		t.Fatalf("qemu-nbd reports no dirty extent:\n%s", want)
	}
	for _, args := range [][]string{{"-B", "bm0"}, {"--bitmap", "bm0", "-w"}} {
		srv := harness.StartNBD(t, img, false, args...)
		if got := nbdinfoMap(t, "qemu:dirty-bitmap:bm0", srv.URI); got != want {
			t.Errorf("%v: blockexport's dirty bitmap\n%s\nqemu-nbd's\n%s", args, got, want)
		}
		srv.StopClean()
	}
	harness.QemuImgCheck(t, img)
}

// TestDirtyBitmapOfAWritableExportIncludesItsWrites: as qemu-nbd -B on a
// writable export, the context reports the live bitmap, which the
// export's own writes mark; and QEMU finds them there after the export.
func TestDirtyBitmapOfAWritableExportIncludesItsWrites(t *testing.T) {
	img := imageWithBitmap(t, t.TempDir())
	before := harness.DirtyRanges(t, img, "bm0")
	srv := harness.StartNBD(t, img, false, "-w", "-B", "bm0")
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 7 40M 512", "-c", "write -z 50M 200k", srv.URI)
	want := harness.DirtyRuns(64<<20, 64<<10, [2]int64{40 << 20, 512}, [2]int64{50 << 20, 200 << 10})
	for _, r := range before {
		want = harness.DirtyRuns(64<<20, 64<<10, append(runsAsRanges(want), [2]int64{r[0], r[1] - r[0]})...)
	}
	if got := dirtyRuns(t, nbdinfoMap(t, "qemu:dirty-bitmap:bm0", srv.URI)); !slices.Equal(got, want) {
		t.Errorf("live bitmap %v, want %v", got, want)
	}
	srv.StopClean()
	if got := harness.DirtyRanges(t, img, "bm0"); !slices.Equal(got, want) {
		t.Errorf("qemu-nbd reads %v after the export, want %v", got, want)
	}
}

func runsAsRanges(runs [][2]int64) [][2]int64 {
	out := make([][2]int64, len(runs))
	for i, r := range runs {
		out[i] = [2]int64{r[0], r[1] - r[0]}
	}
	return out
}

// dirtyRuns parses nbdinfo --map's dirty extents into merged [start, end)
// runs.
func dirtyRuns(t *testing.T, out string) [][2]int64 {
	t.Helper()
	var runs [][2]int64
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		var start, n, flags int64
		if _, err := fmt.Sscan(line, &start, &n, &flags); err != nil {
			t.Fatalf("nbdinfo line %q: %v", line, err)
		}
		if flags != 1 {
			continue
		}
		if k := len(runs) - 1; k >= 0 && runs[k][1] == start {
			runs[k][1] += n
		} else {
			runs = append(runs, [2]int64{start, start + n})
		}
	}
	return runs
}

// TestBackupRoundTripThroughFuseAndNbd is a backup tool's incremental
// cycle: bitmap added, writes through the FUSE export, the changed blocks
// read back through the NBD export's dirty-bitmap context, and qemu-nbd
// agreeing.
func TestBackupRoundTripThroughFuseAndNbd(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "disk.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", img, "64M")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0xaa 0 4M", img)
	harness.Run(t, "qemu-img", "bitmap", "--add", "-g", "128K", img, "bm0")
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, img, mnt, "-w", "--kernel-cache", "off")
	writes := [][2]int64{{1 << 20, 4096}, {10<<20 + 100, 300 << 10}, {64<<20 - 512, 512}}
	f, err := os.OpenFile(mnt, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	for i, w := range writes {
		if _, err := f.WriteAt(make([]byte, w[1]), w[0]); err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
		if _, err := f.WriteAt([]byte{byte(i + 1)}, w[0]); err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	d.StopClean()
	want := harness.DirtyRuns(64<<20, 128<<10, writes...)
	srv := harness.StartNBD(t, img, false, "-B", "bm0")
	if got := dirtyRuns(t, nbdinfoMap(t, "qemu:dirty-bitmap:bm0", srv.URI)); !slices.Equal(got, want) {
		t.Errorf("blockexport nbd reports %v, want %v", got, want)
	}
	srv.StopClean()
	if got := harness.DirtyRanges(t, img, "bm0"); !slices.Equal(got, want) {
		t.Errorf("qemu-nbd reports %v, want %v", got, want)
	}
}

func TestBitmapRefusedAsQemuNbdRefusesIt(t *testing.T) {
	dir := t.TempDir()
	img := imageWithBitmap(t, dir)
	code, out := harness.RunBlockexport(t, "nbd", "--listen", "unix:"+filepath.Join(dir, "s"), "-B", "nope", img)
	if code != 1 || !strings.Contains(out, "Bitmap 'nope' is not found") {
		t.Errorf("missing bitmap: exit %d, %q", code, out)
	}
	// A crash while QEMU had it open leaves bm0 in use: inconsistent.
	crashed := filepath.Join(dir, "crashed.qcow2")
	harness.Run(t, "cp", img, crashed)
	exec.Command("qemu-io", "-f", "qcow2", "-c", "write 0 4k", "-c", "sigraise 9", crashed).Run() // killed: fails by design
	if !slices.Contains(harness.QemuBitmaps(t, crashed)["bm0"].Flags, "in-use") {
		t.Fatalf("bm0 is not in use after the crash: %v", harness.QemuBitmaps(t, crashed))
	}
	for _, w := range [][]string{nil, {"-w"}} {
		code, out = harness.RunBlockexport(t, append(append([]string{"nbd", "--listen", "unix:" + filepath.Join(dir, "s")}, w...), "-B", "bm0", crashed)...)
		if code != 1 || !strings.Contains(out, "Bitmap 'bm0' is inconsistent and cannot be used") {
			t.Errorf("in-use bitmap %v: exit %d, %q", w, code, out)
		}
	}
}

// threeDeepChain is base.qcow2 <- mid.qcow2 <- top.qcow2, each layer
// writing some ranges, with zero clusters and a shorter base.
func threeDeepChain(t *testing.T, dir string) string {
	t.Helper()
	base := filepath.Join(dir, "base.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", base, "48M")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 1 0 8M", "-c", "write -P 1 40M 8M", base)
	mid := filepath.Join(dir, "mid.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", mid, "56M")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 2 4M 8M", "-c", "write -z 44M 1M", mid)
	top := filepath.Join(dir, "top.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", "mid.qcow2", "-F", "qcow2", top, "64M")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 3 6M 1M", "-c", "write -z 45M 64k", "-c", "write -P 3 60M 64k", top)
	return top
}

func TestAllocationDepthMatchesQemuNbd(t *testing.T) {
	for name, img := range map[string]string{
		"three qcow2 layers":  threeDeepChain(t, t.TempDir()),
		"qcow2 over raw base": harness.QcowChain(t, t.TempDir()),
	} {
		t.Run(name, func(t *testing.T) {
			want := qemuMap(t, "qemu:allocation-depth", img, "-r", "-A")
			srv := harness.StartNBD(t, img, false, "--allocation-depth")
			if got := nbdinfoMap(t, "qemu:allocation-depth", srv.URI); got != want {
				t.Errorf("blockexport's allocation depth\n%s\nqemu-nbd's\n%s", got, want)
			}
		})
	}
}

// metaReplies negotiates structured replies (unless opt has
// withoutStructured set), then sends one
// LIST_META_CONTEXT or SET_META_CONTEXT with queries for export "" and
// returns its replies as "TYPE NAME" lines (ids left out: each server
// numbers its own).
func metaReplies(t *testing.T, sock string, opt uint32, queries []string) []string {
	t.Helper()
	structured := opt&withoutStructured == 0
	opt &^= withoutStructured
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	be := binary.BigEndian
	r := bufio.NewReader(c)
	var greet [18]byte
	if _, err := io.ReadFull(r, greet[:]); err != nil {
		t.Fatalf("greeting: %v", err)
	}
	c.Write(be.AppendUint32(nil, wire.ClientFixed|wire.ClientNoZeroes))
	send := func(id uint32, data []byte) {
		b := be.AppendUint64(nil, wire.MagicOption)
		b = be.AppendUint32(b, id)
		b = be.AppendUint32(b, uint32(len(data)))
		if _, err := c.Write(append(b, data...)); err != nil {
			t.Fatal(err)
		}
	}
	replies := func() []string {
		var out []string
		for {
			var h [20]byte
			if _, err := io.ReadFull(r, h[:]); err != nil {
				return append(out, "connection closed")
			}
			data := make([]byte, be.Uint32(h[16:]))
			if _, err := io.ReadFull(r, data); err != nil {
				return append(out, "connection closed")
			}
			typ := be.Uint32(h[12:])
			switch {
			case typ == wire.RepMetaContext && len(data) >= 4:
				out = append(out, "context "+string(data[4:]))
			case typ == wire.RepAck:
				return append(out, "ack")
			case typ&(1<<31) != 0:
				return append(out, fmt.Sprintf("error %#x", typ))
			default:
				out = append(out, fmt.Sprintf("reply %d", typ))
			}
		}
	}
	if structured {
		send(wire.OptStructuredReply, nil)
		replies()
	}
	data := be.AppendUint32(nil, 0) // export ""
	data = be.AppendUint32(data, uint32(len(queries)))
	for _, q := range queries {
		data = be.AppendUint32(data, uint32(len(q)))
		data = append(data, q...)
	}
	send(opt, data)
	out := replies()
	send(wire.OptAbort, nil)
	return out
}

// withoutStructured, or'ed into metaReplies' option, leaves structured
// replies off.
const withoutStructured = 1 << 30

// TestMetaContextQueriesAnsweredAsQemuNbd sends the same queries, hostile
// ones included (a name past 4 KiB, unknown namespaces, prefixes without
// their colon, a thousand at once in an option of 170 KiB, an option
// past 64 KiB, SET before structured replies), to qemu-nbd and to us.
func TestMetaContextQueriesAnsweredAsQemuNbd(t *testing.T) {
	img := imageWithBitmap(t, t.TempDir())
	harness.Run(t, "qemu-img", "bitmap", "--add", img, "other")
	qsock := startQemuNbd(t, img, "-r", "-A", "-B", "bm0", "-B", "other").Sock
	ours := harness.StartNBD(t, img, false, "-A", "-B", "bm0", "-B", "other").Socket()
	many := make([]string, 1000)
	for i := range many {
		many[i] = []string{"qemu:dirty-bitmap:bm0", "x:" + strings.Repeat("y", i), "base:allocation"}[i%3]
	}
	cases := [][]string{
		nil,
		{"base:"}, {"base"}, {"base:allocation"}, {"base:allocationx"},
		{"qemu:"}, {"qemu"}, {"qemu:allocation-depth"}, {"qemu:allocation-depth:"},
		{"qemu:dirty-bitmap:"}, {"qemu:dirty-bitmap"}, {"qemu:dirty-bitmap:bm0"}, {"qemu:dirty-bitmap:nope"},
		{"qemu:dirty-bitmap:other", "qemu:dirty-bitmap:bm0", "base:allocation"},
		{"unknown:thing"}, {""}, {":"},
		{"qemu:dirty-bitmap:" + strings.Repeat("b", 5000)},
		{strings.Repeat("q", 5000), "qemu:allocation-depth"},
		{"qemu:dirty-bitmap:" + strings.Repeat("b", 70000), "qemu:dirty-bitmap:bm0"},
		many,
	}
	for _, opt := range []uint32{wire.OptListMetaContext, wire.OptSetMetaContext, wire.OptListMetaContext | withoutStructured, wire.OptSetMetaContext | withoutStructured} {
		for _, qs := range cases {
			want := metaReplies(t, qsock, opt, qs)
			got := metaReplies(t, ours, opt, qs)
			if !slices.Equal(got, want) {
				t.Errorf("option %d, queries %.80q: blockexport %q, qemu-nbd %q", opt, qs, got, want)
			}
		}
	}
}
