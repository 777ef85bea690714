package qsd

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestTLSCredentialsAsQSDHasThem runs one TLS script against
// qemu-storage-daemon and against our daemon and wants the same replies:
// credentials from --object and from object-add (a duplicate id, a type
// neither serves, a client endpoint), nbd-server-start with tls-creds
// and max-connections (unknown and client credentials refused), and
// object-del of unknown credentials and of credentials the server uses.
// Between the commands, qemu-io writes and qemu-img reads over TLS with
// a client certificate, and a plain-text client is refused.
func TestTLSCredentialsAsQSDHasThem(t *testing.T) {
	certs := makeCertificateDir(t)
	qsdMsgs := runTLSScript(t, "qemu-storage-daemon", certs)
	ourMsgs := runTLSScript(t, harness.Bin, certs)
	if len(qsdMsgs) != len(ourMsgs) {
		t.Fatalf("QSD sent %d messages, we sent %d:\nQSD:\n%s\nours:\n%s", len(qsdMsgs), len(ourMsgs),
			strings.Join(qsdMsgs, "\n"), strings.Join(ourMsgs, "\n"))
	}
	for i := range qsdMsgs {
		if qsdMsgs[i] != ourMsgs[i] {
			t.Errorf("message %d:\n QSD: %s\nours: %s", i, qsdMsgs[i], ourMsgs[i])
		}
	}
}

func runTLSScript(t *testing.T, prog, certs string) []string {
	t.Helper()
	dir := t.TempDir()
	img := filepath.Join(dir, "disk.raw")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "raw", img, "4M")
	nbdSock := filepath.Join(dir, "nbd.sock")
	d := startDaemon(t, prog, nil, "--object", "tls-creds-x509,id=cmdline,dir="+certs+",endpoint=server,verify-peer=on")
	c := dialRaw(t, d.sock, true)
	var msgs []string
	send := func(cmd string) { t.Helper(); msgs = append(msgs, c.exchange(cmd)...) }
	creds := func(id, endpoint string) string {
		return `{"execute": "object-add", "arguments": {"qom-type": "tls-creds-x509", "id": "` + id + `", "dir": "` + certs + `", "endpoint": "` + endpoint + `"}}`
	}
	start := func(creds, extra string) string {
		return `{"execute": "nbd-server-start", "arguments": {"addr": {"type": "unix", "data": {"path": "` + nbdSock + `"}}, "tls-creds": "` + creds + `"` + extra + `}}`
	}
	send(creds("tls0", "server"))
	send(creds("tls0", "server"))
	send(creds("cmdline", "server"))
	send(creds("client0", "client"))
	send(`{"execute": "object-add", "arguments": {"qom-type": "no-such-type", "id": "x"}}`)
	send(`{"execute": "object-add", "arguments": {"qom-type": "tls-creds-x509", "id": "x", "dir": "` + dir + `", "endpoint": "server"}}`)
	send(`{"execute": "object-add", "arguments": {"qom-type": "tls-creds-x509", "id": "x", "dir": "` + certs + `", "endpoint": "server", "colour": "red"}}`)
	send(`{"execute": "object-add", "arguments": {"qom-type": "tls-creds-x509", "id": "x", "dir": "` + certs + `", "endpoint": "middle"}}`)
	send(`{"execute": "object-add", "arguments": {"qom-type": "tls-creds-x509", "id": "x", "dir": "` + certs + `", "endpoint": "server", "verify-peer": "no"}}`)
	send(`{"execute": "object-add", "arguments": {"qom-type": "tls-creds-x509", "id": "x"}}`)
	send(`{"execute": "object-add", "arguments": {"qom-type": "tls-creds-x509", "id": "x", "dir": "` + certs + `", "endpoint": "server", "verify-peer": false}}`)
	send(`{"execute": "object-del", "arguments": {"id": "x"}}`)
	send(`{"execute": "object-del", "arguments": {"id": "no-such-object"}}`)
	send(start("no-such-creds", ""))
	send(start("client0", ""))
	send(start("tls0", `, "max-connections": 4`))
	send(start("tls0", ""))
	send(`{"execute": "blockdev-add", "arguments": {"driver": "file", "node-name": "disk", "filename": "` + img + `"}}`)
	send(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "e", "node-name": "disk", "name": "disk", "writable": true}}`)

	tlsClient := []string{"--object", "tls-creds-x509,id=tls0,dir=" + certs + ",endpoint=client",
		"--image-opts", "driver=nbd,path=" + nbdSock + ",export=disk,tls-creds=tls0,tls-hostname=localhost"}
	harness.Run(t, "qemu-io", append([]string{"-c", "write -P 0x5a 1M 64k"}, tlsClient...)...)
	harness.Run(t, "qemu-io", append([]string{"-c", "read -P 0x5a 1M 64k", "-c", "read -P 0 0 64k"}, tlsClient...)...)
	if out := harness.Run(t, "qemu-img", append([]string{"info", "--output=json"}, tlsClient...)...); !strings.Contains(out, `"virtual-size": 4194304`) {
		t.Errorf("%s: qemu-img info over TLS: %s", prog, out)
	}
	plain := exec.Command("qemu-img", "info", "nbd+unix:///disk?socket="+nbdSock)
	if out, err := plain.CombinedOutput(); err == nil || !strings.Contains(string(out), "TLS") {
		t.Errorf("%s: a client without TLS: %v, want refused over TLS:\n%s", prog, err, out)
	}

	// Credentials in use are deleted (QSD 7.2 does it): the server
	// keeps serving TLS with them, and their id is free again.
	send(`{"execute": "object-del", "arguments": {"id": "tls0"}}`)
	harness.Run(t, "qemu-io", append([]string{"-c", "read -P 0x5a 1M 64k"}, tlsClient...)...)
	send(creds("tls0", "server"))
	send(`{"execute": "object-del", "arguments": {"id": "client0"}}`)
	send(`{"execute": "object-del", "arguments": {"id": "cmdline"}}`)
	send(`{"execute": "nbd-server-stop"}`)
	send(`{"execute": "object-del", "arguments": {"id": "tls0"}}`)
	send(`{"execute": "quit"}`)
	d.wait(t)
	for i := range msgs {
		msgs[i] = strings.ReplaceAll(msgs[i], certs, "$CERTS")
		msgs[i] = strings.ReplaceAll(msgs[i], dir, "$DIR")
	}
	return msgs
}

// makeCertificateDir makes a directory as tls-creds-x509 reads it: a CA
// (ca-cert.pem), a server certificate for localhost and a client
// certificate, both signed by the CA, with their keys.
func makeCertificateDir(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "pki")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	write := func(name, typ string, der []byte) {
		if err := os.WriteFile(filepath.Join(dir, name), pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	write("ca-cert.pem", "CERTIFICATE", caDER)
	for i, who := range []string{"server", "client"} {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(int64(i + 2)), Subject: pkix.Name{CommonName: who},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
		if who == "server" {
			tmpl.ExtKeyUsage, tmpl.DNSNames = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, []string{"localhost"}
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &k.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		keyDER, err := x509.MarshalPKCS8PrivateKey(k)
		if err != nil {
			t.Fatal(err)
		}
		write(who+"-cert.pem", "CERTIFICATE", der)
		write(who+"-key.pem", "PRIVATE KEY", keyDER)
	}
	return dir
}

// TestTLSFromTheCommandLineWithMaxConnections: credentials and the NBD
// server from the command line, on both daemons. verify-peer=off serves a
// client that has the CA but no certificate of its own (with QEMU's
// default, verify-peer=on, that client is refused), and max-connections=1
// serves no second client while one is connected, and serves again once
// it left.
func TestTLSFromTheCommandLineWithMaxConnections(t *testing.T) {
	certs := makeCertificateDir(t)
	caOnly := filepath.Join(t.TempDir(), "ca-only")
	os.Mkdir(caOnly, 0o700)
	ca, err := os.ReadFile(filepath.Join(certs, "ca-cert.pem"))
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(caOnly, "ca-cert.pem"), ca, 0o600)
	for _, prog := range []string{"qemu-storage-daemon", harness.Bin} {
		t.Run(filepath.Base(prog), func(t *testing.T) {
			dir := t.TempDir()
			img := filepath.Join(dir, "disk.raw")
			harness.Run(t, "qemu-img", "create", "-q", "-f", "raw", img, "4M")
			open := filepath.Join(dir, "open.sock")
			strict := filepath.Join(dir, "strict.sock")
			d := startDaemon(t, prog, nil,
				"--object", "tls-creds-x509,id=open,dir="+certs+",endpoint=server,verify-peer=off",
				"--blockdev", "driver=file,node-name=disk,filename="+img,
				"--nbd-server", "addr.type=unix,addr.path="+open+",tls-creds=open,max-connections=1",
				"--export", "nbd,id=e,node-name=disk,name=disk")
			// The monitor answers once every option is acted on.
			c := dialRaw(t, d.sock, true)
			info := func(sock, certDir string) error {
				ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
				defer cancel()
				out, err := exec.CommandContext(ctx, "qemu-img", "info", "--object", "tls-creds-x509,id=c,dir="+certDir+",endpoint=client",
					"--image-opts", "driver=nbd,path="+sock+",export=disk,tls-creds=c,tls-hostname=localhost").CombinedOutput()
				if err != nil {
					return fmt.Errorf("%w: %s", err, out)
				}
				return nil
			}
			if err := info(open, caOnly); err != nil {
				t.Fatalf("a client without a certificate, verify-peer=off: %v\n%s", err, d.log)
			}
			held, err := net.Dial("unix", open)
			if err != nil {
				t.Fatal(err)
			}
			greeting := make([]byte, 18) // NBDMAGIC, IHAVEOPT, flags: the server took the connection
			if _, err := io.ReadFull(held, greeting); err != nil {
				t.Fatalf("the held connection: %v", err)
			}
			if err := info(open, certs); err == nil {
				t.Error("a second client was served with max-connections=1")
			}
			held.Close()
			if err := info(open, certs); err != nil {
				t.Errorf("after the first client left: %v\n%s", err, d.log)
			}

			// A second server, QEMU's default verify-peer=on, over QMP.
			reply := c.call(`{"execute": "object-add", "arguments": {"qom-type": "tls-creds-x509", "id": "strict", "dir": "` + certs + `", "endpoint": "server"}}`)
			if reply["return"] == nil {
				t.Fatalf("object-add: %v", reply)
			}
			c.call(`{"execute": "nbd-server-stop"}`)
			reply = c.call(`{"execute": "nbd-server-start", "arguments": {"addr": {"type": "unix", "data": {"path": "` + strict + `"}}, "tls-creds": "strict"}}`)
			if reply["return"] == nil {
				t.Fatalf("nbd-server-start: %v", reply)
			}
			c.call(`{"execute": "block-export-add", "arguments": {"type": "nbd", "id": "e", "node-name": "disk", "name": "disk"}}`)
			if err := info(strict, caOnly); err == nil {
				t.Error("a client without a certificate was served with verify-peer=on")
			}
			if err := info(strict, certs); err != nil {
				t.Errorf("a client with its certificate, verify-peer=on: %v\n%s", err, d.log)
			}
		})
	}
}
