package nbd

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

func TestNBDWithQemuTools(t *testing.T) {
	dir := t.TempDir()
	raw := harness.RandomImage(t, dir, 16<<20, 21)
	qcow := filepath.Join(dir, "img.qcow2")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, qcow)
	for _, tcp := range []bool{false, true} {
		for _, img := range []string{raw, qcow} {
			t.Run(fmt.Sprintf("tcp=%v/%s", tcp, filepath.Base(img)), func(t *testing.T) {
				s := harness.StartNBD(t, img, tcp)
				info := harness.Run(t, "qemu-img", "info", "-f", "raw", s.URI)
				if !strings.Contains(info, "16 MiB") {
					t.Fatalf("qemu-img info over NBD:\n%s", info)
				}
				harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", s.URI, raw)
				out := filepath.Join(t.TempDir(), "out.raw")
				harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "raw", s.URI, out)
				harness.MustEqualBytes(t, "convert out of NBD", harness.ReadAll(t, out), harness.ReadAll(t, raw))
			})
		}
	}
}

func TestNBDWritesWithQemuIO(t *testing.T) {
	dir := t.TempDir()
	img := harness.SparseImage(t, dir, "w.img", 8<<20)
	s := harness.StartNBD(t, img, false, "-f", "raw", "-w")
	harness.Run(t, "qemu-io", "-f", "raw",
		"-c", "write -P 0x5a 0 1M",
		"-c", "write -P 0x6b 2M 64k",
		"-c", "write -z 4096 4096",
		"-c", "discard 2M 64k",
		"-c", "flush",
		"-c", "read -P 0x5a 8192 1040384",
		"-c", "read -P 0 4096 4096",
		"-c", "read -P 0 2M 64k",
		s.URI)
	s.StopClean()
	b := harness.ReadAll(t, img)
	if b[0] != 0x5a || b[4096] != 0 || b[8191] != 0 || b[8192] != 0x5a || b[2<<20] != 0 {
		t.Fatal("image after qemu-io over NBD does not hold the writes")
	}
	// Read-only exports refuse writes with EPERM.
	ro := harness.StartNBD(t, img, false, "-f", "raw")
	out, err := exec.Command("qemu-io", "-f", "raw", "-c", "write 0 512", ro.URI).CombinedOutput()
	if err == nil && !strings.Contains(string(out), "Operation not permitted") && !strings.Contains(string(out), "read-only") && !strings.Contains(string(out), "Read-only") {
		t.Fatalf("write to a read-only NBD export: %v %s", err, out)
	}
	if b2 := harness.ReadAll(t, img); b2[0] != 0x5a {
		t.Fatal("a read-only export changed the image")
	}
}

// TestNBDWritesToQcow2: the same commands on a writable qcow2 export,
// where write-zeroes and discard change L2 entries; QEMU then finds the
// image clean and holding the writes.
func TestNBDWritesToQcow2(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "w.qcow2")
	harness.CreateImage(t, "-f", "qcow2", img, "8M")
	s := harness.StartNBD(t, img, false, "-w")
	harness.Run(t, "qemu-io", "-f", "raw",
		"-c", "write -P 0x5a 0 1M",
		"-c", "write -P 0x6b 2M 128k",
		"-c", "write -z 65536 65536",
		"-c", "write -z 4096 4096",
		"-c", "discard 2M 64k",
		"-c", "flush",
		"-c", "read -P 0x5a 8192 57344",
		"-c", "read -P 0 4096 4096",
		"-c", "read -P 0 65536 65536",
		"-c", "read -P 0 2M 64k",
		"-c", "read -P 0x6b 2112k 64k",
		s.URI)
	s.StopClean()
	harness.QemuImgCheck(t, img)
	harness.Run(t, "qemu-io", "-f", "qcow2",
		"-c", "read -P 0x5a 0 4096",
		"-c", "read -P 0 4096 4096",
		"-c", "read -P 0x5a 8192 57344",
		"-c", "read -P 0 65536 65536",
		"-c", "read -P 0x5a 131072 917504",
		"-c", "read -P 0 2M 64k",
		"-c", "read -P 0x6b 2112k 64k",
		img)
}

func TestNBDInfoFlagsAndMap(t *testing.T) {
	dir := t.TempDir()
	img := harness.QcowChain(t, dir)
	for _, writable := range []bool{false, true} {
		if writable {
			img = harness.SparseImage(t, dir, "rw.img", 8<<20)
			f, _ := os.OpenFile(img, os.O_RDWR, 0)
			f.WriteAt([]byte(strings.Repeat("d", 1<<20)), 2<<20)
			f.Close()
		}
		args := []string{"--export-name", "disk"}
		if writable {
			args = append(args, "-w")
		}
		s := harness.StartNBD(t, img, false, args...)
		uri := strings.Replace(s.URI, "nbd+unix:///", "nbd+unix:///disk", 1)
		var info struct {
			Exports []map[string]any `json:"exports"`
		}
		if err := json.Unmarshal([]byte(harness.Run(t, "nbdinfo", "--json", uri)), &info); err != nil || len(info.Exports) != 1 {
			t.Fatalf("nbdinfo --json: %v", err)
		}
		e := info.Exports[0]
		want := map[string]any{
			"export-name": "disk", "is_read_only": !writable, "can_flush": true, "can_fua": true,
			"can_trim": writable, "can_zero": writable, "can_multi_conn": true, "can_cache": true,
			"block_size_minimum": 1.0, "block_size_preferred": 4096.0, "block_size_maximum": float64(32 << 20),
		}
		for k, v := range want {
			if e[k] != v {
				t.Errorf("writable=%v: nbdinfo %s = %v, want %v", writable, k, e[k], v)
			}
		}
		if ctx, _ := json.Marshal(e["contexts"]); !strings.Contains(string(ctx), "base:allocation") {
			t.Errorf("contexts %s lack base:allocation", ctx)
		}
		// nbdinfo --map (base:allocation) equals blockexport map.
		code, ours := harness.RunBlockexport(t, "map", "--json", img)
		if code != 0 {
			t.Fatal(ours)
		}
		var mine []struct {
			Start, Length int64
			Zero, Data    bool
		}
		json.Unmarshal([]byte(ours), &mine)
		var wantLines []string
		for _, m := range mine {
			typ := 0
			if !m.Data {
				typ |= 1
			}
			if m.Zero {
				typ |= 2
			}
			if n := len(wantLines); n > 0 && strings.HasSuffix(wantLines[n-1], fmt.Sprintf(" %d", typ)) {
				var s0, l0 int64
				var t0 int
				fmt.Sscanf(wantLines[n-1], "%d %d %d", &s0, &l0, &t0)
				wantLines[n-1] = fmt.Sprintf("%d %d %d", s0, l0+m.Length, typ)
				continue
			}
			wantLines = append(wantLines, fmt.Sprintf("%d %d %d", m.Start, m.Length, typ))
		}
		var gotLines []string
		for _, l := range strings.Split(strings.TrimSpace(harness.Run(t, "nbdinfo", "--map", uri)), "\n") {
			f := strings.Fields(l)
			if len(f) < 3 {
				continue
			}
			gotLines = append(gotLines, strings.Join(f[:3], " "))
		}
		if strings.Join(gotLines, "\n") != strings.Join(wantLines, "\n") {
			t.Errorf("writable=%v: nbdinfo --map\n%s\nblockexport map\n%s", writable, strings.Join(gotLines, "\n"), strings.Join(wantLines, "\n"))
		}
	}
}

func TestNBDCopyAndConcurrentClients(t *testing.T) {
	dir := t.TempDir()
	src := harness.RandomImage(t, dir, 32<<20, 22)
	dst := harness.SparseImage(t, dir, "dst.img", 32<<20)
	s := harness.StartNBD(t, dst, false, "-f", "raw", "-w")
	harness.Run(t, "nbdcopy", src, s.URI)
	out := filepath.Join(t.TempDir(), "back.raw")
	harness.Run(t, "nbdcopy", s.URI, out)
	harness.MustEqualBytes(t, "nbdcopy round trip", harness.ReadAll(t, out), harness.ReadAll(t, src))

	// Three fio clients at once, each writing and verifying its own 8 MiB.
	if !strings.Contains(harness.Run(t, "fio", "--enghelp"), "nbd") {
		t.Fatal("this fio has no nbd engine (Debian's fio links libnbd)")
	}
	var wg sync.WaitGroup
	errs := make(chan error, 3)
	for i := 0; i < 3; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			o, err := exec.Command("fio", "--name=c", "--ioengine=nbd", "--uri="+s.URI, "--rw=randwrite",
				"--bs=4k", "--iodepth=16", fmt.Sprintf("--offset=%d", i*8<<20), "--size=8M",
				"--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0", fmt.Sprintf("--randseed=%d", i+1)).CombinedOutput()
			if err != nil {
				err = fmt.Errorf("client %d: %v\n%s", i, err, o)
			}
			errs <- err
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	s.StopClean()
}

func TestNBDBadInput(t *testing.T) {
	dir := t.TempDir()
	img := harness.SparseImage(t, dir, "b.img", 1<<20)
	for _, c := range []struct {
		args []string
		code int
		say  string
	}{
		{[]string{"nbd", "--listen", "udp:1", img}, 2, "want unix:PATH or tcp:HOST:PORT"},
		{[]string{"nbd", "--listen", "tcp:nohostport", img}, 2, "--listen"},
		{[]string{"nbd", "--max-clients", "-1", img}, 2, "--max-clients"},
		{[]string{"nbd", "--poll-us", "-1", img}, 2, "--poll-us"},
		{[]string{"nbd", filepath.Join(dir, "missing")}, 1, "no such file"},
	} {
		code, out := harness.RunBlockexport(t, c.args...)
		if code != c.code || !strings.Contains(out, c.say) {
			t.Errorf("%v: exit %d %q", c.args, code, out)
		}
	}
	// A client that sends garbage is dropped; the server keeps serving.
	s := harness.StartNBD(t, img, false, "-f", "raw")
	sock := s.Socket()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	c.Write([]byte("this is not NBD at all, not even close...."))
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 1024)
	for {
		if _, err := c.Read(buf); err != nil {
			break
		}
	}
	c.Close()
	harness.Run(t, "qemu-img", "info", "-f", "raw", s.URI)
	s.Cmd.Process.Signal(syscall.SIGTERM)
	if code := s.Wait(20 * time.Second); code != 0 {
		t.Fatalf("exit %d after SIGTERM\n%s", code, s.Log())
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatal("socket file left behind")
	}
}

func TestNBDMaxClientsDaemonizeAndExportName(t *testing.T) {
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, 1<<20, 23)
	sock := filepath.Join(dir, "d.sock")
	pidfile := filepath.Join(dir, "pid")
	code, out := harness.RunBlockexport(t, "nbd", "--daemonize", "--pidfile", pidfile, "--listen", "unix:"+sock,
		"--export-name", "disk", "--max-clients", "1", "-f", "raw", img)
	pid := 0
	if b, err := os.ReadFile(pidfile); err == nil {
		fmt.Sscanf(string(b), "%d", &pid)
	}
	t.Cleanup(func() {
		if pid > 0 {
			syscall.Kill(pid, syscall.SIGTERM)
			for i := 0; i < 500 && syscall.Kill(pid, 0) == nil; i++ {
				time.Sleep(10 * time.Millisecond)
			}
		}
	})
	if code != 0 || pid <= 0 {
		t.Fatalf("--daemonize: exit %d, pid %d: %s", code, pid, out)
	}
	uri := "nbd+unix:///disk?socket=" + sock
	// Usable at once after --daemonize returned.
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", uri, img)
	// A wrong export name is refused.
	if o, err := exec.Command("qemu-img", "info", "nbd+unix:///other?socket="+sock).CombinedOutput(); err == nil {
		t.Fatalf("qemu-img info of a missing export succeeded: %s", o)
	}
	// With --max-clients 1, a second client is refused while one is
	// connected, and served again once it has gone.
	// The clients before may still hold the slot for a moment after they
	// exit (the server frees it when it sees them go), so retry a refusal.
	var first net.Conn
	for deadline := time.Now().Add(5 * time.Second); ; {
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err = io.ReadFull(c, make([]byte, 18))
		if err == nil {
			first = c
			break
		}
		c.Close()
		if time.Now().After(deadline) {
			t.Fatalf("first client got no greeting: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if o, err := exec.Command("qemu-img", "info", uri).CombinedOutput(); err == nil {
		t.Fatalf("a second client was served beyond --max-clients 1: %s", o)
	}
	first.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, err := exec.Command("qemu-img", "info", uri).CombinedOutput(); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the slot was not freed after the first client left")
		}
		time.Sleep(50 * time.Millisecond)
	}
	syscall.Kill(pid, syscall.SIGTERM)
	for i := 0; i < 500 && syscall.Kill(pid, 0) == nil; i++ {
		time.Sleep(10 * time.Millisecond)
	}
	if syscall.Kill(pid, 0) == nil {
		t.Fatal("daemon did not exit on SIGTERM")
	}
	for _, p := range []string{sock, pidfile} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Fatalf("%s left behind", p)
		}
	}
}

// TestNBDQueueDepthOne: one client at queue depth one, so the reader runs
// each read and write that waits itself (the lone path), with O_DIRECT and
// the page cache; fio verifies what it wrote, and the image holds it.
func TestNBDQueueDepthOne(t *testing.T) {
	for _, cache := range []string{"writeback", "none"} {
		t.Run(cache, func(t *testing.T) {
			dir := t.TempDir()
			img := harness.SparseImage(t, dir, "qd1.img", 16<<20)
			s := harness.StartNBD(t, img, false, "-f", "raw", "-w", "--cache", cache)
			job := []string{"--name=qd1", "--rw=randwrite", "--bs=4k", "--iodepth=1", "--size=16M",
				"--io_size=4M", "--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0", "--randseed=9"}
			harness.Run(t, "fio", append(job, "--ioengine=nbd", "--uri="+s.URI)...)
			s.StopClean()
			harness.Run(t, "fio", append(job, "--ioengine=psync", "--filename="+img, "--verify_only")...)
		})
	}
}
