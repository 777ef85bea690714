package remote

import (
	"encoding/json"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// nginxImages makes a 32 MiB raw disk whose first 16 MiB hold fio's
// crc32c-verified records (twice the largest cache, 8 MiB, that a test
// gives its export, so that reads evict; the rest a hole, read as
// zeroes),
// and the same disk as qcow2, both served.
func nginxImages(t *testing.T, n *harness.Nginx) (raw string, job []string) {
	t.Helper()
	dir := t.TempDir()
	raw = harness.SparseImage(t, dir, "disk.img", 32<<20)
	job = []string{"--name=rh", "--rw=randwrite", "--bs=4k", "--size=16M", "--io_size=16M",
		"--ioengine=libaio", "--iodepth=16", "--direct=1", "--verify=crc32c", "--verify_fatal=1",
		"--verify_state_save=0", "--randseed=2711", "--minimal"}
	harness.Run(t, "fio", append(job, "--filename="+raw)...)
	qc := filepath.Join(dir, "disk.qcow2")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, qc)
	n.Put(t, "disk.img", raw)
	n.Put(t, "disk.qcow2", qc)
	return raw, job
}

// TestHTTPObjectsThroughTheExport: a raw and a qcow2 image on nginx,
// over http and https (verified against the test's CA), exported
// read-only over FUSE: fio's crc32c records verify, qemu-img compare finds
// each export identical to the local disk, and every request nginx saw
// was a conditional range GET (If-Match), besides the HEAD at open.
func TestHTTPObjectsThroughTheExport(t *testing.T) {
	n := harness.StartNginx(t)
	raw, job := nginxImages(t, n)
	// The four exports share nothing but nginx, which only reads: they
	// run side by side, and the group returns once all have.
	t.Run("exports", func(t *testing.T) {
		for _, scheme := range []string{"http", "https"} {
			for _, name := range []string{"disk.img", "disk.qcow2"} {
				t.Run(scheme+"/"+name, func(t *testing.T) {
					t.Parallel()
					mnt := filepath.Join(t.TempDir(), "mnt")
					d := harness.StartExport(t, n.URL(scheme, name), mnt, "--tls-ca", n.CA, "--connections", "4", "--cache-size", "8M")
					// fio checks each block's crc32c header as it reads:
					// randomly at queue depth 16, then sequentially.
					for _, rw := range []string{"--rw=randread", "--rw=read"} {
						verify := append(append([]string(nil), job...), rw, "--readonly", "--filename="+mnt)
						harness.Run(t, "fio", verify...)
					}
					harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", raw, mnt)
					d.StopClean()
					if strings.Contains(d.Log(), "level=ERROR") || strings.Contains(d.Log(), "level=WARN") {
						t.Fatalf("the export logged trouble:\n%s", d.Log())
					}
				})
			}
		}
	})
	// nginx's access log (combined format): the range GETs were answered
	// 206, none with the whole object.
	log, err := os.ReadFile(n.AccessLog)
	if err != nil {
		t.Fatal(err)
	}
	if gets := strings.Count(string(log), `"GET /disk.`); gets < 8 {
		t.Fatalf("nginx saw %d GETs:\n%s", gets, log)
	}
	for _, line := range strings.Split(string(log), "\n") {
		if strings.Contains(line, `"GET /disk.`) && !strings.Contains(line, `" 206 `) {
			t.Fatalf("a GET not answered with a range: %s", line)
		}
	}
}

// qemuImgJSON runs a command and returns its stdout as canonical JSON (keys
// sorted), to compare with another's.
func qemuImgJSON(t *testing.T, name string, args ...string) string {
	t.Helper()
	return canonicalJSON(t, harness.Run(t, name, args...))
}

// canonicalJSON is JSON text with its keys sorted.
func canonicalJSON(t *testing.T, s string) string {
	t.Helper()
	var v any
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		t.Fatalf("not JSON: %v\n%s", err, s)
	}
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestHTTPInfoAndMapEqualQemuImg: info and map of the http URLs of a
// raw and a qcow2 image, and check of the qcow2, say what qemu-img (its
// curl driver) says.
func TestHTTPInfoAndMapEqualQemuImg(t *testing.T) {
	if _, err := os.Stat("/usr/lib/x86_64-linux-gnu/qemu/block-curl.so"); err != nil {
		t.Fatal("qemu-img reads http URLs with its curl driver: apt-get install -y qemu-block-extra")
	}
	n := harness.StartNginx(t)
	nginxImages(t, n)
	for _, name := range []string{"disk.img", "disk.qcow2"} {
		u := n.URL("http", name)
		for _, cmd := range []string{"info", "map"} {
			want := qemuImgJSON(t, "qemu-img", cmd, "--output=json", u)
			_, got := harness.RunBlockexport(t, cmd, "--output", "json", u)
			if g := canonicalJSON(t, got); g != want {
				t.Errorf("%s %s:\n got %s\nwant %s", cmd, name, g, want)
			}
		}
	}
	// A remote overlay whose backing string is relative: resolved against
	// its URL, as QEMU does; one that names a local file is refused.
	ov := filepath.Join(n.Root, "ov.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", "disk.img", "-F", "raw", ov, "64M")
	harness.Run(t, "qemu-io", "-c", "write -P 0x5a 1M 192k", ov)
	for _, args := range [][]string{{"info", "--backing-chain"}, {"map"}} {
		u := n.URL("http", "ov.qcow2")
		want := qemuImgJSON(t, "qemu-img", append(args, "--output=json", u)...)
		if _, got := harness.RunBlockexport(t, append(args, "--output", "json", u)...); canonicalJSON(t, got) != want {
			t.Errorf("%v of a remote overlay:\n got %s\nwant %s", args, got, want)
		}
	}
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", "/etc/hostname", "-F", "raw", filepath.Join(n.Root, "evil.qcow2"), "64M")
	if code, out := harness.RunBlockexport(t, "map", n.URL("http", "evil.qcow2")); code == 0 || !strings.Contains(out, "may not name a local file") {
		t.Errorf("a remote image naming a local backing file: exit %d\n%s", code, out)
	}
	// check reads the remote qcow2's metadata as qemu-img check does.
	u := n.URL("http", "disk.qcow2")
	want := qemuImgJSON(t, "qemu-img", "check", "--output=json", u)
	if _, got := harness.RunBlockexport(t, "check", "--output", "json", u); canonicalJSON(t, got) != want {
		t.Errorf("check:\n got %s\nwant %s", got, want)
	}
	// The human info says what qemu-img's says of the size it cannot know.
	if _, out := harness.RunBlockexport(t, "info", n.URL("http", "disk.qcow2")); !strings.Contains(out, "disk size: unavailable") {
		t.Errorf("info:\n%s", out)
	}
}

// TestHTTPSBackingFileUnderLocalOverlay: a local qcow2 overlay whose backing
// file is an https:// URL, exported writable: fio writes and verifies
// through it, what it did not write reads as the remote image, and
// qemu-img check finds the overlay clean. `create -b URL` sizes an overlay
// from the remote image.
func TestHTTPSBackingFileUnderLocalOverlay(t *testing.T) {
	n := harness.StartNginx(t)
	dir := t.TempDir()
	base := harness.RandomImage(t, dir, 32<<20, 2712)
	n.Put(t, "base.img", base)
	ov := filepath.Join(dir, "ov.qcow2")
	harness.Run(t, "qemu-img", "create", "-f", "qcow2", "-u", "-b", n.URL("https", "base.img"), "-F", "raw", ov, "32M")
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, ov, mnt, "-w", "--tls-ca", n.CA)
	job := []string{"--name=rhov", "--rw=randwrite", "--bs=4k", "--size=8M", "--io_size=8M",
		"--ioengine=libaio", "--iodepth=16", "--direct=1", "--verify=crc32c", "--verify_fatal=1",
		"--verify_state_save=0", "--randseed=2713", "--minimal"}
	harness.Run(t, "fio", append(job, "--filename="+mnt)...)
	got := harness.ReadAll(t, mnt)
	harness.MustEqualBytes(t, "the backing file's bytes past the writes", got[8<<20:], harness.ReadAll(t, base)[8<<20:])
	d.StopClean()
	// qemu-img cannot be given our CA: it checks the overlay alone.
	out := harness.Run(t, "qemu-img", "check", "--output=json", fmt.Sprintf(`json:{"driver":"qcow2","backing":null,"file":{"driver":"file","filename":%q}}`, ov))
	if !strings.Contains(out, `"check-errors": 0`) || strings.Contains(out, "corruptions\"") && !strings.Contains(out, `"corruptions": 0`) {
		t.Fatalf("qemu-img check:\n%s", out)
	}
	// create -b over http: the overlay takes the remote image's size.
	ov2 := filepath.Join(dir, "ov2.qcow2")
	harness.CreateImage(t, "-f", "qcow2", "-b", n.URL("http", "base.img"), "-F", "raw", ov2)
	if out := harness.Run(t, "qemu-img", "info", "--output=json", ov2); !strings.Contains(out, `"virtual-size": 33554432`) {
		t.Fatalf("create -b http://…: %s", out)
	}
	// Without our CA, the https backing file is refused at open: its
	// certificate does not verify against the system's roots.
	if code, out := harness.TryExport(t, filepath.Join(dir, "mnt2"), ov); code == 0 || !strings.Contains(out, "certificate") {
		t.Fatalf("an https backing file with an unknown CA: exit %d\n%s", code, out)
	}
}

// TestHTTPObjectReplacedWhileExportedIsEIO: an image replaced on the server while
// it is exported: reads of blocks not yet fetched fail with EIO (nginx
// answers 412 to If-Match), never the new version's bytes, and the log
// says so once.
func TestHTTPObjectReplacedWhileExportedIsEIO(t *testing.T) {
	n := harness.StartNginx(t)
	dir := t.TempDir()
	v1 := harness.RandomImage(t, dir, 16<<20, 2714)
	n.Put(t, "disk.img", v1)
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, n.URL("http", "disk.img"), mnt, "--cache-size", "1M")
	f, err := os.Open(mnt)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	head := make([]byte, 4096)
	if _, err := f.ReadAt(head, 0); err != nil {
		t.Fatal(err)
	}
	harness.MustEqualBytes(t, "the first block", head, harness.ReadAll(t, v1)[:4096])
	// Same size, new bytes: only the ETag tells (Put gives the new file a
	// later Last-Modified second).
	v2 := harness.RandomImage(t, t.TempDir(), 16<<20, 2715)
	n.Put(t, "disk.img", v2)
	for _, off := range []int64{8 << 20, 12 << 20} {
		buf := make([]byte, 4096)
		g, err := os.Open(mnt)
		if err != nil {
			t.Fatal(err)
		}
		_, err = g.ReadAt(buf, off)
		g.Close()
		if harness.ErrnoOf(err) != 5 {
			t.Fatalf("read at %d after the object was replaced: %v (bytes from v2: %v)", off, err, string(buf[:8]) == string(harness.ReadAll(t, v2)[off:off+8]))
		}
	}
	d.StopClean()
	if c := strings.Count(d.Log(), "changed while exported"); c != 1 {
		t.Fatalf("%d log lines about the change, want 1:\n%s", c, d.Log())
	}
}

// TestHTTPServerWithoutRangesRefused: not nginx, a server that answers every GET with the
// whole object (no ranges): the export refuses it at open with one line.
func TestHTTPServerWithoutRangesRefused(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write(make([]byte, 1<<20))
	})}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	code, out := harness.RunBlockexport(t, "info", "http://"+l.Addr().String()+"/disk.img")
	if code == 0 || !strings.Contains(out, "does not serve byte ranges") {
		t.Fatalf("exit %d\n%s", code, out)
	}
}

// TestHTTPMemoryBoundedByCacheSize: a 128 MiB image read whole through the
// export, sequentially (readahead at its widest) and then at random with
// fio at queue depth 16, by a daemon with --cache-size 8M: its peak RSS
// stays within the cache plus a constant (80 MiB: the Go runtime, the
// 16 connections' buffers, the readahead window), where a cache
// that kept what it fetched would hold the whole object.
func TestHTTPMemoryBoundedByCacheSize(t *testing.T) {
	n := harness.StartNginx(t)
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, 128<<20, 2716)
	n.Put(t, "big.img", img)
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, n.URL("http", "big.img"), mnt, "--cache-size", "8M")
	harness.MustEqualBytes(t, "the image through the export", harness.ReadAll(t, mnt), harness.ReadAll(t, img))
	harness.Run(t, "fio", "--name=rhmem", "--filename="+mnt, "--rw=randread", "--bs=4k", "--ioengine=libaio", "--iodepth=16",
		"--direct=1", "--io_size=32M", "--size=128M", "--minimal", "--readonly")
	hwm := harness.ProcField(t, d.Cmd.Process.Pid, "status", "VmHWM:") // kB
	d.StopClean()
	if limit := int64(8+80) << 10; hwm > limit {
		t.Fatalf("peak RSS %d KiB with --cache-size 8M over a 128 MiB object (limit %d KiB)", hwm, limit)
	}
	t.Logf("peak RSS %d KiB", hwm)
}

// TestHTTPForeignFormatsEqualQemuImg: vmdk (sparse and stream-optimized), vhdx,
// vpc (dynamic and fixed) and vdi (dynamic and static) images on nginx:
// info equals qemu-img's for the URL, map too (vhdx's map is left out: it
// differs from qemu-img's for a local file as well, by design), and the
// FUSE export reads as the local disk (qemu-img compare). A remote vmdk
// descriptor naming an extent file is refused: the files a remote image
// names are not opened.
func TestHTTPForeignFormatsEqualQemuImg(t *testing.T) {
	n := harness.StartNginx(t)
	raw, _ := nginxImages(t, n)
	for _, c := range []struct{ format, opts string }{
		{"vmdk", "subformat=monolithicSparse"}, {"vmdk", "subformat=streamOptimized"}, {"vhdx", ""},
		{"vpc", "subformat=dynamic"}, {"vpc", "subformat=fixed"}, {"vdi", ""}, {"vdi", "static=on"},
	} {
		name := c.format + strings.NewReplacer("subformat=", "-", "static=on", "-static").Replace(c.opts) + "." + c.format
		t.Run(name, func(t *testing.T) {
			// Each format has its own files and export; nginx only
			// serves them.
			t.Parallel()
			local := filepath.Join(t.TempDir(), name)
			args := []string{"convert", "-f", "raw", "-O", c.format}
			if c.opts != "" {
				args = append(args, "-o", c.opts)
			}
			harness.Run(t, "qemu-img", append(args, raw, local)...)
			n.Put(t, name, local)
			u := n.URL("http", name)
			cmds := []string{"info"}
			if c.format != "vhdx" {
				cmds = append(cmds, "map")
			}
			// A fixed VHD has its footer at the end only: QEMU probes it
			// as raw, so it is named.
			var force []string
			if c.opts == "subformat=fixed" {
				force = []string{"-f", c.format}
			}
			for _, cmd := range cmds {
				want := qemuImgJSON(t, "qemu-img", append(append([]string{cmd}, force...), "--output=json", u)...)
				if _, got := harness.RunBlockexport(t, append(append([]string{cmd}, force...), "--output", "json", u)...); canonicalJSON(t, got) != want {
					t.Errorf("%s:\n got %s\nwant %s", cmd, got, want)
				}
			}
			mnt := filepath.Join(t.TempDir(), "mnt")
			d := harness.StartExport(t, u, mnt, force...)
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", raw, mnt)
			d.StopClean()
		})
	}
	desc := "# Disk DescriptorFile\nversion=1\nCID=fffffffe\nparentCID=ffffffff\ncreateType=\"monolithicFlat\"\n\nRW 65536 FLAT \"disk.img\" 0\n\nddb.virtualHWVersion = \"4\"\n"
	if err := os.WriteFile(filepath.Join(n.Root, "flat.vmdk"), []byte(desc), 0o644); err != nil {
		t.Fatal(err)
	}
	if code, out := harness.RunBlockexport(t, "map", n.URL("http", "flat.vmdk")); code == 0 || !strings.Contains(out, "not opened") {
		t.Fatalf("a remote vmdk descriptor naming an extent: exit %d\n%s", code, out)
	}
}

// TestHTTPServerKilledAndRestarted: nginx SIGKILLed while fio reads through
// the export and started again within --reconnect-timeout: the reads
// complete with the right bytes (fio's crc32c headers); killed for good,
// a read of what was not fetched fails with EIO within the timeout, not
// a hang.
func TestHTTPServerKilledAndRestarted(t *testing.T) {
	n := harness.StartNginx(t)
	raw, job := nginxImages(t, n)
	mnt := filepath.Join(t.TempDir(), "mnt")
	d := harness.StartExport(t, n.URL("http", "disk.img"), mnt, "--reconnect-timeout", "5s", "--cache-size", "4M")
	// Paced (4096 reads: about 4 s) so that the kill lands mid-run.
	verify := append(append([]string(nil), job...), "--rw=randread", "--readonly", "--rate_iops=1000", "--filename="+mnt)
	fio := exec.Command("fio", verify...)
	out := &strings.Builder{}
	fio.Stdout, fio.Stderr = out, out
	if err := fio.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- fio.Wait() }()
	t.Cleanup(func() { fio.Process.Kill() })
	time.Sleep(time.Second)
	select {
	case err := <-done:
		t.Fatalf("fio ended before the server was killed: %v\n%s", err, out)
	default:
	}
	n.Kill()
	time.Sleep(1500 * time.Millisecond)
	n.Start(t)
	if err := <-done; err != nil {
		t.Fatalf("fio across a server restart: %v\n%s\n%s", err, out, d.Log())
	}
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", raw, mnt)

	n.Kill()
	f, err := os.Open(mnt)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// The cache (4M) no longer holds the start: it must be fetched.
	start := time.Now()
	_, err = f.ReadAt(make([]byte, 4096), 0)
	if harness.ErrnoOf(err) != 5 {
		t.Fatalf("read with the server gone: %v, want EIO", err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("EIO after %v, reconnect timeout 5s", took)
	}
	d.StopClean()
}

// cuttingProxy forwards TCP connections to addr and cuts each one (a
// reset, both ways) after it has passed a random number of reply bytes,
// up to max: bodies truncated mid-range, kept-alive connections lost
// between requests. It counts the connections it cut.
func cuttingProxy(t *testing.T, addr string, max int64) (string, *atomic.Int64) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cuts := &atomic.Int64{}
	var wg sync.WaitGroup
	t.Cleanup(func() { l.Close(); wg.Wait() })
	rng := mrand.New(mrand.NewPCG(27, 17))
	var mu sync.Mutex
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", addr)
			if err != nil {
				c.Close()
				continue
			}
			mu.Lock()
			budget := 1 + rng.Int64N(max)
			mu.Unlock()
			wg.Add(2)
			go func() { defer wg.Done(); io.Copy(s, c); s.Close() }()
			go func() {
				defer wg.Done()
				n, _ := io.CopyN(c, s, budget)
				if n == budget {
					cuts.Add(1)
				}
				c.(*net.TCPConn).SetLinger(0)
				c.Close()
				s.Close()
			}()
		}
	}()
	return l.Addr().String(), cuts
}

// TestHTTPThroughConnectionCuttingProxy: the export reads through a proxy that resets every
// connection after up to 2 MiB of replies (so range bodies end short and
// kept-alive connections die): fio's crc32c headers all verify and
// qemu-img compare finds the disk, after many cut connections.
func TestHTTPThroughConnectionCuttingProxy(t *testing.T) {
	n := harness.StartNginx(t)
	raw, job := nginxImages(t, n)
	addr, cuts := cuttingProxy(t, n.Addr, 2<<20)
	mnt := filepath.Join(t.TempDir(), "mnt")
	d := harness.StartExport(t, "http://"+addr+"/disk.qcow2", mnt, "--reconnect-timeout", "10s", "--cache-size", "4M")
	verify := append(append([]string(nil), job...), "--rw=randread", "--readonly", "--filename="+mnt)
	harness.Run(t, "fio", verify...)
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", raw, mnt)
	d.StopClean()
	if c := cuts.Load(); c < 20 {
		t.Fatalf("only %d connections cut: the proxy did not get in the way", c)
	}
	t.Logf("%d connections cut", cuts.Load())
}

// TestHTTPCredentialsNeverShown: a URL with a user, a password and a
// signed query (nginx ignores them) is exported, inspected and checked:
// neither the password nor the signature shows in the daemon's log, the
// mount table, info, map or check's output, or an error.
func TestHTTPCredentialsNeverShown(t *testing.T) {
	n := harness.StartNginx(t)
	nginxImages(t, n)
	const pw, sig = "pw-rh-0b7e", "sig-rh-5d21"
	u := strings.Replace(n.URL("http", "disk.qcow2"), "http://", "http://alice:"+pw+"@", 1) + "?X-Amz-Signature=" + sig
	shown := func(what, text string) {
		t.Helper()
		if strings.Contains(text, pw) || strings.Contains(text, sig) {
			t.Fatalf("%s shows a credential:\n%s", what, text)
		}
	}
	mnt := filepath.Join(t.TempDir(), "mnt")
	d := harness.StartExport(t, u, mnt)
	mounts, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	shown("the mount table", string(mounts))
	d.StopClean()
	shown("the export's log", d.Log())
	for _, cmd := range []string{"info", "map", "check"} {
		_, out := harness.RunBlockexport(t, cmd, u)
		shown(cmd, out)
	}
	missing := strings.Replace(u, "disk.qcow2", "missing.qcow2", 1)
	code, out := harness.RunBlockexport(t, "info", missing)
	if code == 0 || !strings.Contains(out, "404") {
		t.Fatalf("info of a missing object: exit %d\n%s", code, out)
	}
	shown("a 404's error", out)
	code, out = harness.RunBlockexport(t, "check", missing)
	if code == 0 {
		t.Fatalf("check of a missing object: exit 0\n%s", out)
	}
	shown("check's error", out)
}

// TestNBDServesAnHTTPSImage: `blockexport nbd` serves a qcow2 image on
// nginx over https (--image-tls-ca: the nbd command's own --tls-* flags
// are its server's): QEMU reads the disk through it, and its log names
// the URL.
func TestNBDServesAnHTTPSImage(t *testing.T) {
	n := harness.StartNginx(t)
	raw, _ := nginxImages(t, n)
	s := harness.StartNBD(t, n.URL("https", "disk.qcow2"), false, "--image-tls-ca", n.CA)
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", s.URI, raw)
	if !strings.Contains(s.Log(), n.URL("https", "disk.qcow2")) {
		t.Fatalf("the log does not name the image:\n%s", s.Log())
	}
}
