package qsd

import (
	"errors"
	"io"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestNBDExportBitmapsAsQSD: an NBD export's bitmaps, given to
// block-export-add (a JSON array) and to --export (bitmaps.N), are the
// meta contexts qemu:dirty-bitmap:NAME that nbdinfo --map reads, with the
// same runs as from QSD on the same image, a write through the export
// showing in the live bitmap; an unknown bitmap, an enabled one under a
// read-only export, one another export offers and a bitmaps that is no
// list get QSD's errors.
func TestNBDExportBitmapsAsQSD(t *testing.T) {
	src := filepath.Join(t.TempDir(), "src.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", src, "8M")
	harness.Run(t, "qemu-img", "bitmap", "--add", src, "bm0")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write 1M 64k", src)
	harness.Run(t, "qemu-img", "bitmap", "--add", src, "bm1")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write 3M 128k", src)
	qsdMsgs, qsdMaps, qsdImg := runBitmapScript(t, "qemu-storage-daemon", src)
	ourMsgs, ourMaps, ourImg := runBitmapScript(t, harness.Bin, src)
	sameMessages(t, qsdMsgs, ourMsgs)
	sameMessages(t, qsdMaps, ourMaps)
	// bm0 saw both writes before the export and the one through it; bm1
	// only the later ones.
	var dirty []string
	for _, m := range ourMaps {
		if strings.HasSuffix(m, " dirty") {
			dirty = append(dirty, m)
		}
	}
	want := []string{
		"cli bm1: 3145728 131072 1 dirty",
		"both bm0: 1048576 65536 1 dirty", "both bm0: 3145728 131072 1 dirty", "both bm0: 6291456 65536 1 dirty",
		"both bm1: 3145728 131072 1 dirty", "both bm1: 6291456 65536 1 dirty",
	}
	if strings.Join(dirty, "\n") != strings.Join(want, "\n") {
		t.Fatalf("dirty runs:\n%s\nwant:\n%s", strings.Join(dirty, "\n"), strings.Join(want, "\n"))
	}
	qsdBitmaps, ourBitmaps := harness.QemuBitmaps(t, qsdImg), harness.QemuBitmaps(t, ourImg)
	for _, name := range []string{"bm0", "bm1"} {
		q, o := qsdBitmaps[name], ourBitmaps[name]
		if strings.Join(q.Flags, ",") != strings.Join(o.Flags, ",") || q.Granularity != o.Granularity {
			t.Errorf("bitmap %s after quit: QSD %+v, ours %+v", name, q, o)
		}
	}
	harness.Run(t, "qemu-img", "compare", "-f", "qcow2", "-F", "qcow2", qsdImg, ourImg)
	harness.Run(t, "qemu-img", "check", ourImg)
}

// runBitmapScript returns the QMP messages, the dirty runs nbdinfo read
// (one line per run, "EXPORT BITMAP: START LENGTH TYPE DESCRIPTION":
// "cli" bm1 before the write, then "both" bm0 and bm1 after it) and the
// image.
func runBitmapScript(t *testing.T, prog, src string) (msgs, maps []string, img string) {
	t.Helper()
	dir := t.TempDir()
	img = filepath.Join(dir, "disk.qcow2")
	harness.Run(t, "cp", src, img)
	nbdSock := filepath.Join(dir, "nbd.sock")
	d := startDaemon(t, prog, nil,
		"--blockdev", "driver=file,node-name=f,filename="+img,
		"--blockdev", "driver=qcow2,node-name=q,file=f",
		"--nbd-server", "addr.type=unix,addr.path="+nbdSock,
		"--export", "type=nbd,id=cli,node-name=q,name=cli,writable=on,bitmaps.0=bm1")
	s := newSession(t, d, map[string]string{dir: "$DIR"})
	readMap := func(export, bitmap string) {
		out := harness.Run(t, "nbdinfo", "--map=qemu:dirty-bitmap:"+bitmap, harness.NBDURI(export, nbdSock))
		for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
			maps = append(maps, export+" "+bitmap+": "+strings.Join(strings.Fields(line), " "))
		}
	}
	readMap("cli", "bm1")
	s.send(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "nope", "node-name": "q", "writable": true, "bitmaps": ["bm0", "nope"]}}`)
	s.send(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "ro", "node-name": "q", "name": "ro", "bitmaps": ["bm0"]}}`)
	s.send(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "str", "node-name": "q", "name": "str", "bitmaps": "bm0"}}`)
	// A bitmap one export offers is busy for any other.
	s.send(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "both", "node-name": "q", "name": "both", "writable": true, "bitmaps": ["bm0", "bm1"]}}`)
	s.send(`{"execute": "block-export-del", "arguments": {"id": "cli"}}`)
	s.send(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "both", "node-name": "q", "name": "both", "writable": true, "bitmaps": ["bm0", "bm1"]}}`)
	s.send(`{"execute": "query-block-exports"}`)
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x9 6M 64k", harness.NBDURI("both", nbdSock))
	readMap("both", "bm0")
	readMap("both", "bm1")
	list := harness.Run(t, "nbdinfo", "--list", "--json", "nbd+unix:///?socket="+nbdSock)
	if !strings.Contains(list, `"qemu:dirty-bitmap:bm0"`) || !strings.Contains(list, `"qemu:dirty-bitmap:bm1"`) {
		t.Fatalf("%s: nbdinfo --list names no bitmap contexts:\n%s", prog, list)
	}
	s.send(`{"execute": "block-export-del", "arguments": {"id": "both"}}`)
	return s.quit(d), maps, img
}

// TestNBDServerAtMaxConnectionsMakesTheNextClientWait: with
// max-connections=1 one more client is connected but not answered (no
// greeting, not closed) until the first leaves, and then it is served,
// as QSD 7.2 does; our log does not name the one-shot --max-clients.
func TestNBDServerAtMaxConnectionsMakesTheNextClientWait(t *testing.T) {
	for _, prog := range []string{"qemu-storage-daemon", harness.Bin} {
		t.Run(filepath.Base(prog), func(t *testing.T) {
			dir := t.TempDir()
			nbdSock := filepath.Join(dir, "nbd.sock")
			d := startDaemon(t, prog, nil,
				"--blockdev", "driver=null-co,node-name=n,size=1048576",
				"--nbd-server", "addr.type=unix,addr.path="+nbdSock+",max-connections=1",
				"--export", "type=nbd,id=e,node-name=n")
			dialRaw(t, d.sock, true) // the options are acted on once it greets
			first := dialNBD(t, nbdSock)
			greeting(t, first, 5*time.Second)
			second := dialNBD(t, nbdSock)
			second.SetReadDeadline(time.Now().Add(time.Second))
			var b [1]byte
			n, err := second.Read(b[:])
			var ne net.Error
			if !errors.As(err, &ne) || !ne.Timeout() {
				t.Fatalf("a client past max-connections read %d bytes, %v; want it waiting (no answer, not closed)", n, err)
			}
			first.Close()
			greeting(t, second, 10*time.Second)
			if strings.Contains(d.log.String(), "max-clients") {
				t.Fatalf("the daemon's log names the one-shot --max-clients:\n%s", d.log)
			}
		})
	}
}

func dialNBD(t *testing.T, sock string) net.Conn {
	t.Helper()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatalf("connect to the NBD server: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// greeting wants the server's first bytes, NBDMAGIC, within wait.
func greeting(t *testing.T, c net.Conn, wait time.Duration) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(wait))
	var magic [8]byte
	if _, err := io.ReadFull(c, magic[:]); err != nil || string(magic[:]) != "NBDMAGIC" {
		t.Fatalf("NBD greeting: %q, %v", magic, err)
	}
}
