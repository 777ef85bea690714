package nbd

import (
	"bufio"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// sourceImage makes a raw image with data at 1 MiB and 9 MiB and holes
// around them.
func sourceImage(t *testing.T, dir string, size string) string {
	t.Helper()
	img := filepath.Join(dir, "source.raw")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "raw", img, size)
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x11 1M 1M", "-c", "write -P 0x22 9M 512k", img)
	return img
}

// nbdinfoData lists an export's data as nbdinfo --map sees it: runs
// without the hole bit, merged.
func nbdinfoData(t *testing.T, uri string) [][2]int64 {
	t.Helper()
	var r [][2]int64
	sc := bufio.NewScanner(strings.NewReader(harness.Run(t, "nbdinfo", "--map", uri)))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 3 {
			continue
		}
		off, _ := strconv.ParseInt(f[0], 10, 64)
		n, _ := strconv.ParseInt(f[1], 10, 64)
		typ, _ := strconv.Atoi(f[2])
		if typ&1 != 0 {
			continue // a hole
		}
		if k := len(r); k > 0 && r[k-1][1] == off {
			r[k-1][1] = off + n
			continue
		}
		r = append(r, [2]int64{off, off + n})
	}
	return r
}

// exerciseNBDSource checks an export on a server as qemu's tools see it
// and through a writable FUSE export of it: info and map against
// qemu-img's, SEEK_DATA/SEEK_HOLE against nbdinfo --map, fio writes
// checked with crc32c, and the server holding what was written after
// the export has gone.
func exerciseNBDSource(t *testing.T, uri string, exportArgs ...string) {
	t.Helper()
	if got, want := harness.JSONOf(t, harness.Bin, "info", "--output=json", uri), harness.JSONOf(t, "qemu-img", "info", "--output=json", uri); !reflect.DeepEqual(got, want) {
		t.Errorf("info: ours %v, qemu-img's %v", got, want)
	}
	if got, want := harness.JSONOf(t, harness.Bin, "map", "--output=json", uri), harness.JSONOf(t, "qemu-img", "map", "--output=json", uri); !reflect.DeepEqual(got, want) {
		t.Errorf("map: ours %v, qemu-img's %v", got, want)
	}
	dir := t.TempDir()
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, uri, mnt, append([]string{"-w"}, exportArgs...)...)
	if !strings.Contains(d.Log(), "the /dev/fuse loop reads the NBD replies too") {
		t.Errorf("one /dev/fuse queue, and its loop does not read the replies:\n%s", d.Log())
	}
	if got, want := harness.DataRanges(t, mnt), nbdinfoData(t, uri); !reflect.DeepEqual(got, want) {
		t.Errorf("SEEK_DATA/SEEK_HOLE through the export: %v; nbdinfo --map: %v", got, want)
	}
	harness.Run(t, "fio", "--name=verify", "--filename="+mnt, "--rw=randwrite", "--bs=4k", "--size=16M", "--io_size=8M",
		"--ioengine=libaio", "--iodepth=16", "--direct=1", "--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0", "--minimal")
	written := filepath.Join(dir, "written.raw")
	if err := os.WriteFile(written, harness.ReadAll(t, mnt), 0o644); err != nil {
		t.Fatal(err)
	}
	d.StopClean()
	if out := harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", written, uri); !strings.Contains(out, "identical") {
		t.Fatalf("the server does not hold what was written: %s", out)
	}
}

// TestNBDSourceServers exports images on every NBD server at hand:
// qemu-nbd (a raw file, and a qcow2 file it opens), qemu-storage-daemon's
// NBD export, nbdkit's memory plugin, and our own.
func TestNBDSourceServers(t *testing.T) {
	t.Run("qemu-nbd raw", func(t *testing.T) {
		dir := t.TempDir()
		img := sourceImage(t, dir, "32M")
		sock := filepath.Join(dir, "s.sock")
		harness.StartServerProc(t, sock, "qemu-nbd", "-f", "raw", "--aio=io_uring", "--shared=8", "--persistent", "-x", "disk", "-k", sock, img)
		// QEMU 7.2 has no extended headers: the client falls back.
		wantInfoLine(t, harness.NBDURI("disk", sock), "extended headers: no")
		exerciseNBDSource(t, harness.NBDURI("disk", sock))
	})
	t.Run("qemu-nbd qcow2", func(t *testing.T) {
		dir := t.TempDir()
		img := filepath.Join(dir, "source.qcow2")
		harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", img, "32M")
		harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 0x33 2M 1M", img)
		sock := filepath.Join(dir, "s.sock")
		harness.StartServerProc(t, sock, "qemu-nbd", "-f", "qcow2", "--shared=8", "--persistent", "-x", "disk", "-k", sock, img)
		exerciseNBDSource(t, harness.NBDURI("disk", sock))
	})
	t.Run("qemu-storage-daemon", func(t *testing.T) {
		dir := t.TempDir()
		img := sourceImage(t, dir, "32M")
		sock := filepath.Join(dir, "s.sock")
		harness.StartServerProc(t, sock, "qemu-storage-daemon", "--blockdev", "driver=file,filename="+img+",node-name=f0",
			"--nbd-server", "addr.type=unix,addr.path="+sock, "--export", "type=nbd,id=e0,node-name=f0,name=disk,writable=on")
		exerciseNBDSource(t, harness.NBDURI("disk", sock))
	})
	t.Run("nbdkit memory", func(t *testing.T) {
		sock := filepath.Join(t.TempDir(), "s.sock")
		harness.StartServerProc(t, sock, "nbdkit", "-f", "-U", sock, "memory", "32M")
		exerciseNBDSource(t, harness.NBDURI("", sock))
	})
	t.Run("nbdkit with strict block sizes", func(t *testing.T) {
		// 4 KiB minimum, 64 KiB maximum, anything else an error: the
		// client must align and split what its clients send.
		sock := filepath.Join(t.TempDir(), "s.sock")
		harness.StartServerProc(t, sock, "nbdkit", "-f", "-U", sock, "--filter=blocksize-policy", "memory", "32M",
			"blocksize-minimum=4096", "blocksize-preferred=4096", "blocksize-maximum=65536", "blocksize-error-policy=error")
		uri := harness.NBDURI("", sock)
		exerciseNBDSource(t, uri)
		mnt := filepath.Join(t.TempDir(), "mnt")
		d := harness.StartExport(t, uri, mnt, "-w")
		out := harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x41 100 5000", "-c", "write -P 0x42 70000 200000",
			"-c", "read -P 0x41 100 5000", "-c", "read -P 0x42 70000 200000", "-c", "write -z 4000 300", "-c", "read -P 0 4000 300", mnt)
		if strings.Contains(out, "fail") || strings.Contains(out, "error") {
			t.Fatalf("unaligned I/O through a strict server: %s", out)
		}
		d.StopClean()
	})
	t.Run("blockexport nbd", func(t *testing.T) {
		dir := t.TempDir()
		img := sourceImage(t, dir, "32M")
		sock := filepath.Join(dir, "s.sock")
		harness.StartServerProc(t, sock, harness.Bin, "nbd", "-f", "raw", "-w", "--export-name", "disk", "--listen", "unix:"+sock, img)
		// Both ends have extended headers: the export runs on them,
		// while qemu-img and nbdinfo above spoke the compact form.
		wantInfoLine(t, harness.NBDURI("disk", sock), "extended headers: yes")
		exerciseNBDSource(t, harness.NBDURI("disk", sock), "--connections", "4")
	})
}

// wantInfoLine checks that `blockexport info URI` prints line.
func wantInfoLine(t *testing.T, uri, line string) {
	t.Helper()
	if code, out := harness.RunBlockexport(t, "info", uri); code != 0 || !strings.Contains(out, "\n    "+line+"\n") {
		t.Fatalf("info %s (exit %d) lacks %q:\n%s", uri, code, line, out)
	}
}

// TestNBDSourceReconnect: the server is killed while fio writes through
// the export and is back half a second later: fio sees no error and
// every block verifies. Then it is killed for good: a read fails with
// EIO once --reconnect-timeout (4 s: the restart takes well under a
// second) has passed.
func TestNBDSourceReconnect(t *testing.T) {
	dir := t.TempDir()
	img := sourceImage(t, dir, "64M")
	sock := filepath.Join(dir, "s.sock")
	server := func() *harness.ServerProc {
		return harness.StartServerProc(t, sock, "qemu-nbd", "-f", "raw", "--shared=8", "--persistent", "-x", "disk", "-k", sock, img)
	}
	s := server()
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, harness.NBDURI("disk", sock), mnt, "-w", "--reconnect-timeout", "4s")
	fio := exec.Command("fio", "--name=verify", "--filename="+mnt, "--rw=randwrite", "--bs=4k", "--size=64M", "--io_size=24M",
		"--ioengine=libaio", "--iodepth=16", "--direct=1", "--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0", "--minimal",
		"--rate_iops=4000") // 6144 writes: 1.5 s at least, so the server's kill at 0.7 s lands in them on a fast machine too
	fioOut, err := fio.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	fio.Stderr = fio.Stdout
	if err := fio.Start(); err != nil {
		t.Fatal(err)
	}
	fioDone := make(chan error, 1)
	var out []byte
	go func() { out, _ = io.ReadAll(fioOut); fioDone <- fio.Wait() }()
	t.Cleanup(func() { fio.Process.Kill() }) // a test that fails early leaves no fio behind
	time.Sleep(700 * time.Millisecond)
	s.Kill()
	time.Sleep(500 * time.Millisecond)
	s = server()
	select {
	case err := <-fioDone:
		if err != nil {
			t.Fatalf("fio through a reconnect: %v\n%s\n%s", err, out, d.Log())
		}
	case <-time.After(2 * time.Minute):
		fio.Process.Kill()
		t.Fatalf("fio did not finish\n%s", d.Log())
	}
	if !strings.Contains(d.Log(), "reconnecting") || !strings.Contains(d.Log(), "made again") {
		t.Errorf("the export's log does not show the reconnect:\n%s", d.Log())
	}

	s.Kill()
	began := time.Now()
	f, err := os.Open(mnt)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	_, err = f.ReadAt(make([]byte, 4096), 12<<20)
	if harness.ErrnoOf(err) != syscall.EIO || time.Since(began) < 3*time.Second {
		t.Fatalf("a read with the server gone for good: %v after %v; want EIO after the 4s reconnect timeout", err, time.Since(began))
	}
}

// TestNBDSourceRefused: what cannot work says so in one line.
func TestNBDSourceRefused(t *testing.T) {
	dir := t.TempDir()
	gone := harness.NBDURI("disk", filepath.Join(dir, "nobody.sock"))
	if code, out := harness.RunBlockexport(t, "info", gone); code != 1 || strings.Count(strings.TrimSpace(out), "\n") != 0 || !strings.Contains(out, "connect") {
		t.Errorf("info of a server nobody runs: exit %d, %q", code, out)
	}
	mnt := filepath.Join(dir, "mnt")
	if code, out := harness.TryExport(t, mnt, "-f", "qcow2", gone); code != 2 || !strings.Contains(out, "raw bytes") {
		t.Errorf("-f qcow2 on an NBD URI: exit %d, %q", code, out)
	}
	if code, out := harness.RunBlockexport(t, "info", "nbd+unix:///disk"); code != 2 || !strings.Contains(out, "socket") {
		t.Errorf("a unix URI without socket=: exit %d, %q", code, out)
	}
	img := sourceImage(t, dir, "16M")
	sock := filepath.Join(dir, "s.sock")
	harness.StartServerProc(t, sock, "qemu-nbd", "-f", "raw", "-r", "--shared=4", "--persistent", "-x", "disk", "-k", sock, img)
	if code, out := harness.TryExport(t, mnt, "-w", harness.NBDURI("disk", sock)); code != 1 || !strings.Contains(out, "read-only") {
		t.Errorf("a writable export of a read-only NBD export: exit %d, %q", code, out)
	}
	if code, out := harness.RunBlockexport(t, "info", harness.NBDURI("other", sock)); code != 1 || !strings.Contains(out, `"other"`) {
		t.Errorf("an export the server does not have: exit %d, %q", code, out)
	}
}

// TestRemoteBackingFile: a qcow2 overlay whose backing file is an NBD
// URI (made by qemu-img, and by us) reads through it; writes stay in the
// overlay and the served base does not change.
func TestRemoteBackingFile(t *testing.T) {
	dir := t.TempDir()
	base := sourceImage(t, dir, "16M")
	before := harness.FileHash(t, base)
	sock := filepath.Join(dir, "s.sock")
	harness.StartServerProc(t, sock, "qemu-nbd", "-f", "raw", "-r", "--shared=8", "--persistent", "-x", "base", "-k", sock, base)
	uri := harness.NBDURI("base", sock)
	byQemu := filepath.Join(dir, "qemu.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", uri, "-F", "raw", byQemu)
	byUs := filepath.Join(dir, "ours.qcow2")
	harness.CreateImage(t, "-f", "qcow2", "-b", uri, "-F", "raw", byUs)
	if got := harness.JSONOf(t, harness.Bin, "info", "--output=json", byUs).(map[string]any); got["backing-filename"] != uri || got["virtual-size"] != float64(16<<20) {
		t.Errorf("info of our overlay: %v", got)
	}
	for _, overlay := range []string{byQemu, byUs} {
		mnt := filepath.Join(dir, "mnt")
		d := harness.StartExport(t, overlay, mnt, "-w")
		harness.MustEqualBytes(t, "the overlay before writes", harness.ReadAll(t, mnt), harness.ReadAll(t, base))
		harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -P 0x77 1536k 64k", mnt)
		content := harness.ReadAll(t, mnt)
		d.StopClean()
		if harness.FileHash(t, base) != before {
			t.Fatal("a write through the overlay reached the base")
		}
		copyFile := filepath.Join(dir, "content.raw")
		os.WriteFile(copyFile, content, 0o644)
		// qemu-img reads the overlay, its backing file over NBD included.
		if out := harness.Run(t, "qemu-img", "compare", "-f", "qcow2", "-F", "raw", overlay, copyFile); !strings.Contains(out, "identical") {
			t.Fatalf("qemu-img compare: %s", out)
		}
		harness.Run(t, "qemu-img", "check", overlay)
	}
}

// pki is a CA with a server and a client certificate, in the file names
// QEMU and libnbd look for in a certificate directory.
type pki struct {
	dir        string // ca-cert.pem, server-*.pem, client-*.pem
	caOnly     string // ca-cert.pem alone: a client without a certificate
	otherCA    string // a CA that signed nothing here
	serverCert string
	serverKey  string
	ca         string
}

func makePKI(t *testing.T) pki {
	t.Helper()
	base := t.TempDir()
	p := pki{dir: filepath.Join(base, "pki"), caOnly: filepath.Join(base, "ca-only"), otherCA: filepath.Join(base, "other")}
	for _, d := range []string{p.dir, p.caOnly, p.otherCA} {
		os.Mkdir(d, 0o700)
	}
	newKey := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	write := func(path, typ string, der []byte) {
		if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	writeKey := func(path string, k *ecdsa.PrivateKey) {
		der, err := x509.MarshalPKCS8PrivateKey(k)
		if err != nil {
			t.Fatal(err)
		}
		write(path, "PRIVATE KEY", der)
	}
	serial := int64(1)
	makeCA := func(name string) (*x509.Certificate, *ecdsa.PrivateKey) {
		k := newKey()
		serial++
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: name},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
			IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
		if err != nil {
			t.Fatal(err)
		}
		c, _ := x509.ParseCertificate(der)
		return c, k
	}
	issue := func(ca *x509.Certificate, caKey *ecdsa.PrivateKey, name string, usage x509.ExtKeyUsage) ([]byte, *ecdsa.PrivateKey) {
		k := newKey()
		serial++
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: name},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment, ExtKeyUsage: []x509.ExtKeyUsage{usage}}
		if usage == x509.ExtKeyUsageServerAuth {
			tmpl.DNSNames, tmpl.IPAddresses = []string{"localhost"}, []net.IP{net.ParseIP("127.0.0.1")}
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &k.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		return der, k
	}
	ca, caKey := makeCA("blockexport test CA")
	p.ca = filepath.Join(p.dir, "ca-cert.pem")
	write(p.ca, "CERTIFICATE", ca.Raw)
	write(filepath.Join(p.caOnly, "ca-cert.pem"), "CERTIFICATE", ca.Raw)
	der, k := issue(ca, caKey, "localhost", x509.ExtKeyUsageServerAuth)
	p.serverCert, p.serverKey = filepath.Join(p.dir, "server-cert.pem"), filepath.Join(p.dir, "server-key.pem")
	write(p.serverCert, "CERTIFICATE", der)
	writeKey(p.serverKey, k)
	der, k = issue(ca, caKey, "client", x509.ExtKeyUsageClientAuth)
	write(filepath.Join(p.dir, "client-cert.pem"), "CERTIFICATE", der)
	writeKey(filepath.Join(p.dir, "client-key.pem"), k)
	other, otherKey := makeCA("another CA")
	write(filepath.Join(p.otherCA, "ca-cert.pem"), "CERTIFICATE", other.Raw)
	der, k = issue(other, otherKey, "client", x509.ExtKeyUsageClientAuth)
	write(filepath.Join(p.otherCA, "client-cert.pem"), "CERTIFICATE", der)
	writeKey(filepath.Join(p.otherCA, "client-key.pem"), k)
	return p
}

// TestNBDTLS: our server with nbdinfo and qemu-img as clients, our client
// with qemu-nbd as the server, and the refusals: plain text under
// --tls require, a client without a certificate (or with one the CA did
// not sign) where the CA is required, a server certificate the client
// does not trust.
func TestNBDTLS(t *testing.T) {
	p := makePKI(t)
	dir := t.TempDir()
	img := sourceImage(t, dir, "16M")
	certs := func(d string) string { return "&tls-certificates=" + d }

	t.Run("our server", func(t *testing.T) {
		sock := filepath.Join(dir, "ours.sock")
		harness.StartServerProc(t, sock, harness.Bin, "nbd", "-f", "raw", "--export-name", "disk", "--listen", "unix:"+sock,
			"--tls-cert", p.serverCert, "--tls-key", p.serverKey, "--tls-ca", p.ca, img)
		tlsURI := "nbds+unix:///disk?socket=" + sock
		if out := harness.Run(t, "nbdinfo", tlsURI+certs(p.dir)); !strings.Contains(out, "with TLS") || !strings.Contains(out, "16777216") {
			t.Errorf("nbdinfo over TLS: %s", out)
		}
		out := harness.Run(t, "qemu-img", "info", "--output=json", "--object", "tls-creds-x509,id=tls0,dir="+p.dir+",endpoint=client",
			"--image-opts", "driver=nbd,path="+sock+",export=disk,tls-creds=tls0,tls-hostname=localhost")
		if !strings.Contains(out, `"virtual-size": 16777216`) {
			t.Errorf("qemu-img info over TLS: %s", out)
		}
		if got := readAllURI(t, tlsURI+certs(p.dir)); !reflect.DeepEqual(got, harness.ReadAll(t, img)) {
			t.Error("our client over TLS to our server read other data")
		}
		for name, uri := range map[string]string{
			"plain text":               harness.NBDURI("disk", sock),
			"no client certificate":    tlsURI + certs(p.caOnly),
			"a certificate not signed": tlsURI + certs(p.otherCA),
		} {
			if err := exec.Command("nbdinfo", uri).Run(); err == nil {
				t.Errorf("nbdinfo with %s: served", name)
			}
			if code, out := harness.RunBlockexport(t, "info", uri); code != 1 {
				t.Errorf("our client with %s: exit %d, %s", name, code, out)
			}
		}
		if _, out := harness.RunBlockexport(t, "info", harness.NBDURI("disk", sock)); !strings.Contains(out, "requires TLS") {
			t.Errorf("a plain-text client is not told TLS is required: %s", out)
		}
	})

	t.Run("qemu-nbd server", func(t *testing.T) {
		sock := filepath.Join(dir, "qemu.sock")
		harness.StartServerProc(t, sock, "qemu-nbd", "--object", "tls-creds-x509,id=tls0,dir="+p.dir+",endpoint=server",
			"--tls-creds", "tls0", "-f", "raw", "--shared=8", "--persistent", "-x", "disk", "-k", sock, img)
		tlsURI := "nbds+unix:///disk?socket=" + sock
		mnt := filepath.Join(dir, "mnt")
		harness.StartExport(t, tlsURI+certs(p.dir), mnt)
		harness.MustEqualBytes(t, "a FUSE export of qemu-nbd over TLS", harness.ReadAll(t, mnt), harness.ReadAll(t, img))
		// The same with the files named by flags, not the URI.
		code, out := harness.RunBlockexport(t, "info", "--tls-ca", p.ca, "--tls-cert", filepath.Join(p.dir, "client-cert.pem"),
			"--tls-key", filepath.Join(p.dir, "client-key.pem"), tlsURI)
		if code != 0 || !strings.Contains(out, "tls: yes") {
			t.Errorf("info with --tls-ca/--tls-cert/--tls-key: exit %d, %s", code, out)
		}
		// A server certificate from a CA the client does not trust.
		if code, out := harness.RunBlockexport(t, "info", "--tls-ca", filepath.Join(p.otherCA, "ca-cert.pem"), tlsURI+certs(p.dir)); code != 1 || !strings.Contains(out, "certificate") {
			t.Errorf("an untrusted server certificate: exit %d, %s", code, out)
		}
		// `nbd` re-serving it: its client files come from --image-tls-*
		// (its --tls-* are its own server's), the URI naming no
		// directory. qemu-nbd asks for a client certificate, so without
		// them it cannot start.
		relay := filepath.Join(dir, "relay.sock")
		if code, out := harness.RunBlockexport(t, "nbd", "--listen", "unix:"+relay, "--image-tls-ca", p.ca, tlsURI); code != 1 || !strings.Contains(out, "TLS") {
			t.Errorf("nbd re-serving without a client certificate: exit %d, %s", code, out)
		}
		harness.StartServerProc(t, relay, harness.Bin, "nbd", "--listen", "unix:"+relay, "--export-name", "disk", "--image-tls-ca", p.ca,
			"--image-tls-cert", filepath.Join(p.dir, "client-cert.pem"), "--image-tls-key", filepath.Join(p.dir, "client-key.pem"), tlsURI)
		if got := readAllURI(t, harness.NBDURI("disk", relay)); !reflect.DeepEqual(got, harness.ReadAll(t, img)) {
			t.Error("nbd re-serving qemu-nbd over TLS served other data")
		}
	})
}

// readAllURI reads a whole export through a read-only FUSE export of it.
func readAllURI(t *testing.T, uri string) []byte {
	t.Helper()
	mnt := filepath.Join(t.TempDir(), "read")
	d := harness.StartExport(t, uri, mnt)
	b := harness.ReadAll(t, mnt)
	d.StopClean()
	return b
}
