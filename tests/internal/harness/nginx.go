package harness

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Nginx is Debian's nginx serving a directory on two loopback ports,
// plain http and https (a certificate for 127.0.0.1 signed by a CA the
// test made), with its own config, logs and temp files in a temporary
// directory.
type Nginx struct {
	Root      string // the served directory
	HTTP      string // http://127.0.0.1:PORT
	HTTPS     string // https://127.0.0.1:PORT
	CA        string // the CA's PEM, for --tls-ca
	ErrorLog  string
	AccessLog string
	argv      []string // how to start it again
	Addr      string   // the http port's address
	Cmd       *exec.Cmd
	Exited    chan struct{}
}

// FreePort is a loopback port nobody listens on (closed again: nginx
// binds it a moment later).
func FreePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// MakeCA writes a CA and a server certificate for 127.0.0.1 signed by it
// into dir: ca.pem, server.pem, server.key.
func MakeCA(t *testing.T, dir string) (ca, cert, key string) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "blockexport test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	srvKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	srvTmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	srvDER, err := x509.CreateCertificate(rand.Reader, srvTmpl, caTmpl, &srvKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(srvKey)
	if err != nil {
		t.Fatal(err)
	}
	write := func(name, typ string, der []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	return write("ca.pem", "CERTIFICATE", caDER), write("server.pem", "CERTIFICATE", srvDER), write("server.key", "EC PRIVATE KEY", keyDER)
}

// StartNginx starts nginx over a new directory (stopped in t.Cleanup).
func StartNginx(t *testing.T) *Nginx {
	t.Helper()
	bin, err := exec.LookPath("nginx")
	if err != nil {
		if _, err2 := os.Stat("/usr/sbin/nginx"); err2 != nil {
			t.Fatal("the http(s) source tests serve images with nginx: apt-get install -y nginx-light")
		}
		bin = "/usr/sbin/nginx"
	}
	dir := t.TempDir()
	n := &Nginx{Root: filepath.Join(dir, "www"), ErrorLog: filepath.Join(dir, "error.log"), AccessLog: filepath.Join(dir, "access.log")}
	if err := os.MkdirAll(filepath.Join(dir, "tmp"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(n.Root, 0o755); err != nil {
		t.Fatal(err)
	}
	var cert, key string
	n.CA, cert, key = MakeCA(t, dir)
	hp, sp := FreePort(t), FreePort(t)
	n.HTTP, n.HTTPS = fmt.Sprintf("http://127.0.0.1:%d", hp), fmt.Sprintf("https://127.0.0.1:%d", sp)
	tmp := filepath.Join(dir, "tmp")
	conf := fmt.Sprintf(`daemon off;
master_process off;
pid %[1]s/nginx.pid;
error_log %[2]s warn;
worker_processes 1;
events { worker_connections 512; }
http {
  access_log %[3]s;
  client_body_temp_path %[4]s; proxy_temp_path %[4]s; fastcgi_temp_path %[4]s; uwsgi_temp_path %[4]s; scgi_temp_path %[4]s;
  default_type application/octet-stream;
  keepalive_requests 100000;
  server {
    listen 127.0.0.1:%[5]d;
    listen 127.0.0.1:%[6]d ssl;
    ssl_certificate %[7]s;
    ssl_certificate_key %[8]s;
    root %[9]s;
  }
}
`, dir, n.ErrorLog, n.AccessLog, tmp, hp, sp, cert, key, n.Root)
	confFile := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(confFile, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	n.argv = []string{bin, "-c", confFile, "-p", dir, "-e", n.ErrorLog}
	n.Addr = fmt.Sprintf("127.0.0.1:%d", hp)
	t.Cleanup(n.Kill)
	n.Start(t)
	return n
}

// URL names the served file name over scheme ("http" or "https").
func (n *Nginx) URL(scheme, name string) string {
	if scheme == "https" {
		return n.HTTPS + "/" + name
	}
	return n.HTTP + "/" + name
}

// Start runs nginx (again: the same ports, config and directory) and
// waits until it listens.
func (n *Nginx) Start(t *testing.T) {
	t.Helper()
	cmd := exec.Command(n.argv[0], n.argv[1:]...)
	out := &strings.Builder{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatalf("start nginx: %v", err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	n.Cmd, n.Exited = cmd, exited
	for deadline := time.Now().Add(10 * time.Second); ; {
		if c, err := net.Dial("tcp", n.Addr); err == nil {
			c.Close()
			break
		}
		select {
		case <-exited:
			log, _ := os.ReadFile(n.ErrorLog)
			t.Fatalf("nginx exited: %s\n%s", out, log)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("nginx did not listen in time")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Kill stops nginx at once (SIGKILL: connections reset mid-reply).
func (n *Nginx) Kill() {
	if n.Cmd != nil {
		n.Cmd.Process.Kill()
		<-n.Exited
		n.Cmd = nil
	}
}

// Put places a copy of the file src as name in the served directory,
// atomically (a new file renamed over any old one). A replaced object
// gets a new Last-Modified second, and so a new ETag (nginx's is the
// mtime's seconds and the size): its mtime is set past the old one's, so
// that a test need not wait for the clock's next second.
func (n *Nginx) Put(t *testing.T, name, src string) {
	t.Helper()
	tmp := filepath.Join(n.Root, "."+name+".tmp")
	dst := filepath.Join(n.Root, name)
	Run(t, "cp", "--sparse=always", src, tmp)
	if old, err := os.Stat(dst); err == nil {
		if mtime := old.ModTime().Truncate(time.Second).Add(time.Second); time.Now().Before(mtime) {
			if err := os.Chtimes(tmp, mtime, mtime); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := os.Rename(tmp, dst); err != nil {
		t.Fatal(err)
	}
}
