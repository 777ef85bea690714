package qsd

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// startTracedDaemon is startDaemon under strace, which logs every fsync
// and fdatasync of the daemon's threads to the returned file (complete
// once the daemon has exited). strace and the daemon are killed, and
// mounts unmounted, in t.Cleanup.
func startTracedDaemon(t *testing.T, mounts []string) (*daemon, string) {
	t.Helper()
	if _, err := exec.LookPath("strace"); err != nil {
		t.Fatal("strace is needed (apt package strace)")
	}
	dir := t.TempDir()
	trace := filepath.Join(dir, "syncs.log")
	d := &daemon{sock: filepath.Join(dir, "qmp.sock"), log: &strings.Builder{}, exited: make(chan struct{})}
	d.cmd = exec.Command("strace", "-f", "-qq", "-e", "trace=fsync,fdatasync", "-o", trace,
		harness.Bin, "daemon", "--chardev", "socket,id=mon,path="+d.sock+",server=on,wait=off", "--monitor", "chardev=mon")
	d.cmd.Stdout, d.cmd.Stderr = d.log, d.log
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // the daemon is killed with strace
	if err := d.cmd.Start(); err != nil {
		t.Fatalf("start strace: %v", err)
	}
	go func() { d.err = d.cmd.Wait(); close(d.exited) }()
	t.Cleanup(func() {
		syscall.Kill(-d.cmd.Process.Pid, syscall.SIGKILL)
		<-d.exited
		for _, m := range mounts {
			if harness.IsFuseMount(m) {
				syscall.Unmount(m, syscall.MNT_DETACH)
			}
		}
	})
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(d.sock); err == nil {
			return d, trace
		}
		select {
		case <-d.exited:
			t.Fatalf("traced daemon exited before its monitor came up: %v\n%s", d.err, d.log)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("traced daemon: no monitor at %s in time\n%s", d.sock, d.log)
		}
	}
}

// syncsOfASession runs one traced daemon through blockdev-add of a
// freshly made image of format (qcow2 or raw), a FUSE export of it, a read (and a write,
// if write), block-export-del, blockdev-del and quit, and returns the
// fsync and fdatasync calls it made.
func syncsOfASession(t *testing.T, format string, write bool) []string {
	t.Helper()
	dir := t.TempDir()
	img := filepath.Join(dir, "disk."+format)
	harness.Run(t, "qemu-img", "create", "-q", "-f", format, img, "16M")
	harness.Run(t, "qemu-io", "-f", format, "-c", "write -P 0x5a 0 1M", img)
	mnt := mountFile(t, dir, "export")
	d, trace := startTracedDaemon(t, []string{mnt})
	m, events := d.monitor(t)
	run(t, m, "blockdev-add", map[string]any{"driver": format, "node-name": "n0",
		"file": map[string]any{"driver": "file", "filename": img}})
	run(t, m, "block-export-add", map[string]any{"type": "fuse", "id": "e0", "node-name": "n0", "mountpoint": mnt, "writable": write})
	readPattern(t, mnt, 0x5a, 0)
	if write {
		f, err := os.OpenFile(mnt, os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt(bytes.Repeat([]byte{0xab}, 64<<10), 4<<20); err != nil {
			t.Fatal(err)
		}
		f.Close()
	}
	run(t, m, "block-export-del", map[string]any{"id": "e0"})
	waitEvent(t, events, "e0")
	run(t, m, "blockdev-del", map[string]any{"node-name": "n0"})
	runErr(m, "quit", nil)
	select {
	case <-d.exited:
	case <-time.After(20 * time.Second):
		t.Fatalf("the traced daemon did not exit after quit\n%s", d.log)
	}
	out, err := os.ReadFile(trace)
	if err != nil {
		t.Fatal(err)
	}
	var syncs []string
	for _, l := range strings.Split(string(out), "\n") {
		if strings.Contains(l, "fsync(") || strings.Contains(l, "fdatasync(") {
			syncs = append(syncs, l)
		}
	}
	return syncs
}

// TestDeletingAnUnwrittenNodeDoesNotSync: a qcow2 or raw node only read
// closes (blockdev-del, then quit) without an fsync or fdatasync, as QEMU
// skips the flush of a node with nothing written since its last one; one
// that was written is flushed once at its deletion (the trace sees its
// syncs, so the count above is not an artefact of the tracing).
func TestDeletingAnUnwrittenNodeDoesNotSync(t *testing.T) {
	// One flush's fdatasyncs: qcow2's write-back of a newly allocated
	// cluster syncs after the refcounts, the L2 table and the L1 table's
	// header (writeBack's order), raw's once; a second flush (the engine's,
	// then Close's) would have synced again.
	for format, oneFlush := range map[string]int{"qcow2": 3, "raw": 1} {
		if syncs := syncsOfASession(t, format, false); len(syncs) != 0 {
			t.Errorf("%s: a node only read synced %d times on its way out:\n%s", format, len(syncs), strings.Join(syncs, "\n"))
		}
		syncs := syncsOfASession(t, format, true)
		if len(syncs) == 0 || len(syncs) > oneFlush {
			t.Errorf("%s: a node written through its export synced %d times on its way out, want one flush's (1 to %d):\n%s",
				format, len(syncs), oneFlush, strings.Join(syncs, "\n"))
		}
	}
}

// TestWrittenNodeSurvivesAKillRightAfterBlockdevDel: what was written
// through a qcow2 node's export (a newly allocated cluster, its metadata
// only in the daemon's memory until a flush) is in the image once
// blockdev-del has returned, even if the daemon is killed at once.
func TestWrittenNodeSurvivesAKillRightAfterBlockdevDel(t *testing.T) {
	dir := t.TempDir()
	img := qcow2Image(t, dir, "disk.qcow2", "16M")
	mnt := mountFile(t, dir, "disk.raw")
	d := startDaemon(t, harness.Bin, []string{mnt})
	m, events := d.monitor(t)
	run(t, m, "blockdev-add", map[string]any{"driver": "qcow2", "node-name": "n0",
		"file": map[string]any{"driver": "file", "filename": img}})
	run(t, m, "block-export-add", map[string]any{"type": "fuse", "id": "e0", "node-name": "n0", "mountpoint": mnt, "writable": true})
	f, err := os.OpenFile(mnt, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(bytes.Repeat([]byte{0xab}, 1<<20), 2<<20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	run(t, m, "block-export-del", map[string]any{"id": "e0"})
	waitEvent(t, events, "e0")
	run(t, m, "blockdev-del", map[string]any{"node-name": "n0"})
	d.cmd.Process.Kill()
	<-d.exited
	out := harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "read -P 0xab 2M 1M", img)
	if strings.Contains(out, "Pattern verification failed") || !strings.Contains(out, "read 1048576/1048576") {
		t.Fatalf("the data written before blockdev-del is not in the image after a kill:\n%s", out)
	}
	harness.Run(t, "qemu-img", "check", "-q", img)
}
