package nbd

import (
	"net"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestBackingNBDSURIInHeaderNeverPicksClientCertificate: a qcow2 image whose backing file is an
// nbds URI with tls-certificates=DIR must not make blockexport read DIR's
// client certificate and present it to the server the image names. The
// image is untrusted input; certificates come only from the user's flags.
// Three cases: a server that requires a client certificate signed by the
// CA whose files sit in DIR (before the fix, info went through: the
// certificate was presented); a bare TCP listener (no connection at all
// may be made: the open is refused first); and the user's own files
// (--tls-ca/--tls-cert/--tls-key) for a backing URI without the
// parameter, which still work.
func TestBackingNBDSURIInHeaderNeverPicksClientCertificate(t *testing.T) {
	p := makePKI(t)
	dir := t.TempDir()
	img := sourceImage(t, dir, "16M")
	sock := filepath.Join(dir, "tls.sock")
	harness.StartServerProc(t, sock, harness.Bin, "nbd", "-f", "raw", "--export-name", "disk", "--listen", "unix:"+sock,
		"--tls-cert", p.serverCert, "--tls-key", p.serverKey, "--tls-ca", p.ca, img)
	overlay := func(name, backing string) string {
		t.Helper()
		ov := filepath.Join(dir, name)
		harness.Run(t, "qemu-img", "create", "-q", "-u", "-f", "qcow2", "-b", backing, "-F", "raw", ov, "16M")
		return ov
	}

	t.Run("server that wants the certificate", func(t *testing.T) {
		ov := overlay("cert-server.qcow2", "nbds+unix:///disk?socket="+sock+"&tls-certificates="+p.dir)
		// Plain info opens no backing file (qemu-img info does not either).
		for _, cmd := range [][]string{{"info", "--backing-chain", ov}, {"map", ov}} {
			code, out := harness.RunBlockexport(t, cmd...)
			if code != 1 || !strings.Contains(out, "tls-certificates") || !strings.Contains(out, "untrusted") {
				t.Errorf("%v: exit %d (want 1 and the refusal naming tls-certificates):\n%s", cmd, code, out)
			}
			if n := strings.Count(strings.TrimSpace(out), "\n"); n != 0 {
				t.Errorf("%v: the refusal is %d lines, want one:\n%s", cmd, n+1, out)
			}
		}
	})

	t.Run("no connection is made", func(t *testing.T) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		var accepted atomic.Int32
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				accepted.Add(1)
				c.Close()
			}
		}()
		ov := overlay("tcp.qcow2", "nbds://"+l.Addr().String()+"/disk?tls-certificates="+p.dir)
		code, out := harness.RunBlockexport(t, "info", "--backing-chain", ov)
		if code != 1 || !strings.Contains(out, "tls-certificates") {
			t.Errorf("info: exit %d, want 1 and the refusal:\n%s", code, out)
		}
		// An Accept racing the process's exit: give it a moment.
		time.Sleep(100 * time.Millisecond)
		if n := accepted.Load(); n != 0 {
			t.Errorf("blockexport connected %d time(s) to the host the image named", n)
		}
	})

	t.Run("the user's files", func(t *testing.T) {
		ov := overlay("user-files.qcow2", "nbds+unix:///disk?socket="+sock)
		code, out := harness.RunBlockexport(t, "info", "--backing-chain", "--tls-ca", p.ca,
			"--tls-cert", filepath.Join(p.dir, "client-cert.pem"), "--tls-key", filepath.Join(p.dir, "client-key.pem"), ov)
		if code != 0 || !strings.Contains(out, "virtual size: 16 MiB") {
			t.Errorf("info with the user's TLS files: exit %d\n%s", code, out)
		}
		if code, out := harness.RunBlockexport(t, "info", "--backing-chain", "--tls-ca", p.ca, ov); code != 1 {
			t.Errorf("info without a client certificate went through a server that wants one: exit %d\n%s", code, out)
		}
	})
}
