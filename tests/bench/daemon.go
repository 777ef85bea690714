package main

// The daemon target (issue 48): one daemon holding many exports, driven
// over QMP as qemu-storage-daemon is, against QSD doing the same; and the
// fio rows through a daemon export against the one-shot `blockexport
// fuse` of the same image.

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/digitalocean/go-qemu/qmp"
)

const (
	// daemonExports images are added, exported, read and deleted in each
	// of daemonRounds rounds.
	daemonExports = 200
	daemonRounds  = 3
	// daemonImageSize is each image's size; its first MiB is written.
	daemonImageSize = "16M"
)

// benchDaemon runs the daemon target's rows: the scale rows, then the
// fio rows through a daemon export (ours) against the one-shot command
// (compared with).
func benchDaemon(dir, bin string, ours func(extra ...string) system) []row {
	log.Printf("target daemon")
	rows := benchDaemonScale(dir, bin)
	oneShot := ours()
	oneShot.ours, oneShot.config = false, "one-shot blockexport fuse"
	through := system{name: "blockexport", config: "daemon export (aio=io_uring)", ours: true, start: func(target, image, mnt string, writable bool) (*exec.Cmd, error) {
		return startDaemonExport(bin, target, image, mnt, writable)
	}}
	// The 4 KiB random reads at queue depth 16 and 1, and 1 MiB sequential
	// bandwidth both ways.
	keep := func(j fioJob) bool { return j.bs == "1M" || j.rw == "randread" }
	for _, target := range []string{"raw", "qcow2"} {
		rows = append(rows, benchTarget(target, dir, []system{through, oneShot}, " (daemon export vs one-shot fuse)", keep)...)
	}
	return rows
}

// startDaemonExport runs `blockexport daemon` with one FUSE export of
// image given on its command line (the engine QMP's block-export-add
// drives) and waits for the mount.
func startDaemonExport(bin, target, image, mnt string, writable bool) (*exec.Cmd, error) {
	// aio=io_uring, the one-shot command's default (the daemon's is
	// QEMU's, threads): the rows compare the export paths, not engines.
	args := []string{"daemon", "--blockdev", "driver=file,node-name=f,aio=io_uring,filename=" + image}
	node := "f"
	if target == "qcow2" {
		args = append(args, "--blockdev", "driver=qcow2,node-name=q,file=f")
		node = "q"
	}
	w := "off"
	if writable {
		w = "on"
	}
	args = append(args, "--export", fmt.Sprintf("type=fuse,id=e,node-name=%s,mountpoint=%s,writable=%s", node, mnt, w))
	return startAndWait(exec.Command(bin, args...), mnt)
}

// scale is what one daemon did over the rounds.
type scale struct {
	rssMiB       float64 // VmRSS with every export up and read, the highest of the rounds
	addMs, delMs float64 // per image, over every round
	// left is what the daemon holds after the last round beyond what it
	// held before the first: descriptors, threads, our FUSE mounts.
	left counts
}

// counts are a daemon's open descriptors (/proc/PID/fd), threads
// (/proc/PID/task) and FUSE mounts under the scratch directory.
type counts struct{ fds, threads, mounts int }

// benchDaemonScale adds daemonExports small qcow2 images and FUSE
// exports of them to one daemon over QMP, reads each, and deletes them,
// daemonRounds times, for ours and for qemu-storage-daemon.
func benchDaemonScale(dir, bin string) []row {
	sdir := filepath.Join(dir, "daemon-scale")
	if err := os.MkdirAll(sdir, 0o755); err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(sdir)
	base := filepath.Join(sdir, "base.qcow2")
	if err := run("qemu-img", "create", "-q", "-f", "qcow2", base, daemonImageSize); err != nil {
		log.Fatal(err)
	}
	if err := run("qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 0 1M", base); err != nil {
		log.Fatal(err)
	}
	imgs := make([]string, daemonExports)
	mnts := make([]string, daemonExports)
	for i := range imgs {
		imgs[i] = filepath.Join(sdir, fmt.Sprintf("disk%d.qcow2", i))
		mnts[i] = filepath.Join(sdir, fmt.Sprintf("disk%d.raw", i))
		if err := run("cp", base, imgs[i]); err != nil {
			log.Fatal(err)
		}
		if err := os.WriteFile(mnts[i], nil, 0o600); err != nil {
			log.Fatal(err)
		}
	}
	rowsOf := []row{
		{target: "daemon", name: fmt.Sprintf("RSS at %d exports (MiB)", daemonExports), unit: "MiB"},
		{target: "daemon", name: "add: blockdev-add + block-export-add (ms)", unit: "ms"},
		{target: "daemon", name: "delete: block-export-del + blockdev-del (ms)", unit: "ms"},
		{target: "daemon", name: fmt.Sprintf("fds left after %d rounds", daemonRounds), unit: "fds"},
		{target: "daemon", name: fmt.Sprintf("mounts left after %d rounds", daemonRounds), unit: "mounts"},
		{target: "daemon", name: fmt.Sprintf("threads left after %d rounds", daemonRounds), unit: "threads"},
	}
	systems := []system{{name: "blockexport", ours: true}, {name: "qemu-storage-daemon", config: "aio=threads (its default)"}}
	for i, s := range rotate(systems, 0) {
		prog := "qemu-storage-daemon"
		if s.ours {
			prog = bin
		}
		sock := filepath.Join(sdir, fmt.Sprintf("qmp%d.sock", i))
		res, err := daemonScaleRun(prog, s.ours, sock, sdir, imgs, mnts)
		if err != nil {
			log.Printf("%s: %v", s.key(), err)
			continue
		}
		for j, v := range []float64{res.rssMiB, res.addMs, res.delMs, float64(res.left.fds), float64(res.left.mounts), float64(res.left.threads)} {
			rowsOf[j].add(s, v)
		}
	}
	for _, r := range rowsOf {
		logRow(r)
	}
	return rowsOf
}

// daemonScaleRun runs one daemon through the rounds.
func daemonScaleRun(prog string, ours bool, sock, sdir string, imgs, mnts []string) (scale, error) {
	var res scale
	args := []string{"--chardev", "socket,id=m,path=" + sock + ",server=on,wait=off", "--monitor", "chardev=m"}
	if ours {
		args = append([]string{"daemon"}, args...)
	}
	cmd := exec.Command(prog, args...)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return res, err
	}
	defer func() {
		cmd.Process.Kill()
		cmd.Wait()
		for _, m := range mnts {
			if mounted(m) {
				syscall.Unmount(m, syscall.MNT_DETACH)
			}
		}
	}()
	mon, events, err := connectQMP(sock)
	if err != nil {
		return res, err
	}
	defer mon.Disconnect()
	pid := cmd.Process.Pid
	start := daemonCounts(pid, sdir)
	var addTime, delTime time.Duration
	for r := 0; r < daemonRounds; r++ {
		t := time.Now()
		for i, img := range imgs {
			if err := qmpRun(mon, "blockdev-add", map[string]any{"driver": "qcow2", "node-name": fmt.Sprintf("n%d", i),
				"file": map[string]any{"driver": "file", "filename": img}}); err != nil {
				return res, err
			}
			if err := qmpRun(mon, "block-export-add", map[string]any{"type": "fuse", "id": fmt.Sprintf("e%d", i),
				"node-name": fmt.Sprintf("n%d", i), "mountpoint": mnts[i]}); err != nil {
				return res, err
			}
		}
		addTime += time.Since(t)
		for _, m := range mnts {
			if err := readFew(m); err != nil {
				return res, err
			}
		}
		res.rssMiB = max(res.rssMiB, vmRSS(pid))
		t = time.Now()
		for i := range imgs {
			id := fmt.Sprintf("e%d", i)
			if err := qmpRun(mon, "block-export-del", map[string]any{"id": id}); err != nil {
				return res, err
			}
			// QSD ends a FUSE export after the command returns: its
			// node is in use until the event.
			if err := exportDeleted(events, id); err != nil {
				return res, err
			}
			if err := qmpRun(mon, "blockdev-del", map[string]any{"node-name": fmt.Sprintf("n%d", i)}); err != nil {
				return res, err
			}
		}
		delTime += time.Since(t)
	}
	end := daemonCounts(pid, sdir)
	res.left = counts{end.fds - start.fds, end.threads - start.threads, end.mounts - start.mounts}
	n := float64(daemonRounds * len(imgs))
	res.addMs = float64(addTime.Microseconds()) / 1000 / n
	res.delMs = float64(delTime.Microseconds()) / 1000 / n
	log.Printf("  %s: start %+v, after %d rounds %+v", filepath.Base(prog), start, daemonRounds, end)
	qmpRun(mon, "quit", nil)
	return res, nil
}

// connectQMP connects go-qemu's client (the one tests/qsd drives the
// daemons with) once the socket answers, and forwards its events to a
// buffered channel at once: its reader stops on an event nobody takes,
// and with it every reply.
func connectQMP(sock string) (*qmp.SocketMonitor, <-chan qmp.Event, error) {
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			return nil, nil, fmt.Errorf("no QMP monitor at %s", sock)
		}
	}
	mon, err := qmp.NewSocketMonitor("unix", sock, 10*time.Second)
	if err != nil {
		return nil, nil, err
	}
	if err := mon.Connect(); err != nil {
		return nil, nil, fmt.Errorf("QMP handshake: %w", err)
	}
	in, err := mon.Events(context.Background())
	if err != nil {
		mon.Disconnect()
		return nil, nil, err
	}
	out := make(chan qmp.Event, 4*daemonExports)
	go func() {
		for e := range in {
			out <- e
		}
		close(out)
	}()
	return mon, out, nil
}

// qmpRun runs one command; an error reply is an error.
func qmpRun(mon *qmp.SocketMonitor, execute string, args any) error {
	cmd, err := json.Marshal(qmp.Command{Execute: execute, Args: args})
	if err != nil {
		return err
	}
	if _, err := mon.Run(cmd); err != nil {
		return fmt.Errorf("%s %v: %w", execute, args, err)
	}
	return nil
}

// exportDeleted waits for BLOCK_EXPORT_DELETED of id.
func exportDeleted(events <-chan qmp.Event, id string) error {
	timeout := time.After(10 * time.Second)
	for {
		select {
		case e, ok := <-events:
			if !ok {
				return fmt.Errorf("QMP connection closed before BLOCK_EXPORT_DELETED of %s", id)
			}
			if e.Event == "BLOCK_EXPORT_DELETED" && e.Data["id"] == id {
				return nil
			}
		case <-timeout:
			return fmt.Errorf("no BLOCK_EXPORT_DELETED of %s", id)
		}
	}
}

// readFew reads an export once: four 4 KiB reads in its written first
// MiB, each wanted non-zero.
func readFew(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	b := make([]byte, 4096)
	for off := int64(0); off < 1<<20; off += 256 << 10 {
		if _, err := f.ReadAt(b, off); err != nil {
			return fmt.Errorf("read %s at %d: %w", path, off, err)
		}
		if b[0] != 0x5a {
			return fmt.Errorf("%s at %d: %#x, not the image's 0x5a", path, off, b[0])
		}
	}
	return nil
}

// vmRSS is the process's resident set now, in MiB.
func vmRSS(pid int) float64 {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "VmRSS:") {
			var kb float64
			fmt.Sscan(strings.Fields(l)[1], &kb)
			return kb / 1024
		}
	}
	return 0
}

// daemonCounts counts what pid holds; mounts are FUSE mounts under dir.
func daemonCounts(pid int, dir string) counts {
	var c counts
	if e, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid)); err == nil {
		c.fds = len(e)
	}
	if e, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid)); err == nil {
		c.threads = len(e)
	}
	b, _ := os.ReadFile("/proc/self/mountinfo")
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) > 4 && strings.HasPrefix(f[4], dir+"/") && strings.Contains(l, " - fuse") {
			c.mounts++
		}
	}
	return c
}
