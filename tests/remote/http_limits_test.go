package remote

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestHTTPCredentialsNeverShownInErrors: a URL with a user, a
// password and a signed query, as an overlay's backing string that fails
// to open and as convert's and compare's source that fails: no error shows
// the password or the signature.
func TestHTTPCredentialsNeverShownInErrors(t *testing.T) {
	n := harness.StartNginx(t)
	dir := t.TempDir()
	const pw, sig = "pw-rv-71c3", "sig-rv-0a9e"
	missing := strings.Replace(n.URL("http", "missing.raw"), "http://", "http://alice:"+pw+"@", 1) + "?X-Amz-Signature=" + sig
	shown := func(what string, code int, text string) {
		t.Helper()
		if code == 0 {
			t.Fatalf("%s: exit 0\n%s", what, text)
		}
		if strings.Contains(text, pw) || strings.Contains(text, sig) {
			t.Fatalf("%s shows a credential:\n%s", what, text)
		}
	}
	ov := filepath.Join(dir, "ov.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-u", "-F", "raw", "-b", missing, ov, "1M")
	for _, args := range [][]string{{"map", ov}, {"info", "--backing-chain", ov}, {"convert", "-O", "raw", ov, filepath.Join(dir, "ov.raw")}} {
		code, out := harness.RunBlockexport(t, args...)
		shown(args[0]+" of an overlay whose backing URL fails", code, out)
	}
	local := harness.SparseImage(t, dir, "local.raw", 1<<20)
	code, out := harness.RunBlockexport(t, "convert", "-O", "raw", missing, filepath.Join(dir, "out.raw"))
	shown("convert's error", code, out)
	code, out = harness.RunBlockexport(t, "compare", missing, local)
	shown("compare's error", code, out)
	code, out = harness.RunBlockexport(t, "compare", local, missing)
	shown("compare's error (second image)", code, out)
}

// TestRemoteImageBackingMayNotNameLocalNBD: a qcow2 image on an http server
// whose backing string names a local NBD export (a unix socket, a
// loopback TCP port) is refused: an export would show what that local
// server serves. Another origin's URL is refused too; the same origin's
// is followed.
func TestRemoteImageBackingMayNotNameLocalNBD(t *testing.T) {
	n := harness.StartNginx(t)
	dir := t.TempDir()
	secret := filepath.Join(dir, "secret.raw")
	if err := os.WriteFile(secret, append([]byte("RV-TOPSECRET-LOCAL"), make([]byte, 1<<20-18)...), 0o644); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "nbd.sock")
	port := harness.FreePort(t)
	for _, args := range [][]string{{"-k", sock}, {"-b", "127.0.0.1", "-p", strconv.Itoa(port)}} {
		cmd := exec.Command("qemu-nbd", append(append([]string{"-r", "-f", "raw", "-t"}, args...), secret)...)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	}
	for i := 0; i < 100; i++ {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	other := strings.Replace(n.URL("http", "base.raw"), "127.0.0.1", "localhost", 1)
	base := filepath.Join(dir, "base.raw")
	if err := os.WriteFile(base, append([]byte("RV-BASE-ON-SERVER"), make([]byte, 1<<20-17)...), 0o644); err != nil {
		t.Fatal(err)
	}
	n.Put(t, "base.raw", base)
	for name, backing := range map[string]string{
		"unix.qcow2":   "nbd+unix:///?socket=" + sock,
		"tcp.qcow2":    "nbd://127.0.0.1:" + strconv.Itoa(port),
		"origin.qcow2": other,
		"same.qcow2":   n.URL("http", "base.raw"),
		"rel.qcow2":    "base.raw",
	} {
		f := filepath.Join(dir, name)
		harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-u", "-F", "raw", "-b", backing, f, "1M")
		n.Put(t, name, f)
		out := filepath.Join(dir, name+".out")
		code, msg := harness.RunBlockexport(t, "convert", "-O", "raw", n.URL("http", name), out)
		got, _ := os.ReadFile(out)
		switch name {
		case "same.qcow2", "rel.qcow2":
			if code != 0 || !strings.HasPrefix(string(got), "RV-BASE-ON-SERVER") {
				t.Fatalf("%s (backing %s): exit %d, %q\n%s", name, backing, code, got[:min(len(got), 20)], msg)
			}
		default:
			if code == 0 || strings.Contains(string(got), "RV-TOPSECRET") {
				t.Fatalf("%s (backing %s) followed: exit %d\n%s", name, backing, code, msg)
			}
		}
	}
	// The opt-in that lets redirects leave the origin lets a backing string do so too.
	code, msg := harness.RunBlockexport(t, "convert", "--allow-redirects", "-O", "raw", n.URL("http", "origin.qcow2"), filepath.Join(dir, "o2.out"))
	if code != 0 {
		t.Fatalf("another origin with --allow-redirects: exit %d\n%s", code, msg)
	}
}

// TestHTTPMemoryBoundedWithParallelSequentialReaders: eight sequential
// readers of one http object, each earning readahead: the export's peak
// RSS stays within --cache-size plus a constant (readahead counts against
// the cache; eight streams' windows each beside it peaked at 335-422 MiB
// with --cache-size 128M).
func TestHTTPMemoryBoundedWithParallelSequentialReaders(t *testing.T) {
	n := harness.StartNginx(t)
	dir := t.TempDir()
	img := harness.SparseImage(t, dir, "big.raw", 384<<20)
	n.Put(t, "big.raw", img)
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, n.URL("http", "big.raw"), mnt, "--cache-size", "128M")
	var cmds []*exec.Cmd
	for s := 0; s < 8; s++ {
		c := exec.Command("dd", "if="+mnt, "of=/dev/null", "bs=128k", "skip="+strconv.Itoa(s*384), "count=320", "iflag=direct")
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		cmds = append(cmds, c)
	}
	for _, c := range cmds {
		if err := c.Wait(); err != nil {
			t.Fatalf("dd: %v", err)
		}
	}
	hwm := harness.ProcField(t, d.Cmd.Process.Pid, "status", "VmHWM:") // kB
	d.StopClean()
	if limit := int64(128+80) << 10; hwm > limit {
		t.Fatalf("peak RSS %d KiB with --cache-size 128M, 8 sequential readers (limit %d KiB)", hwm, limit)
	}
	t.Logf("peak RSS %d KiB", hwm)
}
