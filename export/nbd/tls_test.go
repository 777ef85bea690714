package nbd

import (
	"bufio"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"io"
	"math/big"
	"net"
	"testing"
	"time"

	"github.com/blockexport/blockexport/formats/drivers/null"
	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
)

// selfSigned is a server certificate for "localhost" and a pool that
// trusts it.
func selfSigned(t *testing.T) (tls.Certificate, *x509.CertPool) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "localhost"},
		DNSNames: []string{"localhost"}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
	if err != nil {
		t.Fatal(err)
	}
	c, _ := x509.ParseCertificate(der)
	pool := x509.NewCertPool()
	pool.AddCert(c)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: k}, pool
}

// tlsPair is newPairWith for a server with TLS in mode.
func tlsPair(t *testing.T, mode TLSMode) (*client, *x509.CertPool) {
	t.Helper()
	cert, pool := selfSigned(t)
	img, _ := null.New("null", 1<<20, true)
	s := New(img, Options{Name: "disk", TLS: &tls.Config{Certificates: []tls.Certificate{cert}}, TLSMode: mode})
	a, b := net.Pipe()
	cn := newConn(s, pipeStream(t, a), s.log)
	s.wg.Add(1)
	go func() { defer s.wg.Done(); cn.serve() }()
	t.Cleanup(func() { b.Close(); s.wg.Wait() })
	b.SetDeadline(time.Now().Add(10 * time.Second))
	c := &client{t: t, c: b, r: bufio.NewReader(b)}
	c.greet()
	return c, pool
}

// TestTLSRequired: before STARTTLS, every option but STARTTLS and ABORT is
// refused with TLS_REQD and carries nothing about the export; EXPORT_NAME,
// which has no error reply, ends the connection.
func TestTLSRequired(t *testing.T) {
	c, _ := tlsPair(t, TLSRequire)
	for _, opt := range []uint32{wire.OptList, wire.OptInfo, wire.OptGo, wire.OptStructuredReply, wire.OptListMetaContext, 77} {
		data := []byte(nil)
		if opt == wire.OptInfo || opt == wire.OptGo {
			data = goData("disk")
		}
		types, payloads := c.option(opt, data)
		if len(types) != 1 || types[0] != wire.RepErrTLSReqd {
			t.Errorf("option %d in plain text: replies %#x %q; want one TLS_REQD", opt, types, payloads)
		}
	}
	h := be.AppendUint64(nil, wire.MagicOption)
	h = be.AppendUint32(h, wire.OptExportName)
	h = be.AppendUint32(h, 4)
	c.write(append(h, "disk"...))
	if n, err := c.r.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("EXPORT_NAME in plain text: read %d bytes, %v; want the connection closed", n, err)
	}
}

// TestStartTLS: STARTTLS is acknowledged, the TLS handshake runs, and
// the negotiation goes on encrypted to a served export.
func TestStartTLS(t *testing.T) {
	for _, mode := range []TLSMode{TLSRequire, TLSOptional} {
		c, pool := tlsPair(t, mode)
		if types, _ := c.option(wire.OptStartTLS, []byte("x")); len(types) != 1 || types[0] != wire.RepErrInvalid {
			t.Fatalf("%s: STARTTLS with data: %#x", mode, types)
		}
		if types, _ := c.option(wire.OptStartTLS, nil); len(types) != 1 || types[0] != wire.RepAck {
			t.Fatalf("%s: STARTTLS: %#x", mode, types)
		}
		tc := tls.Client(c.c, &tls.Config{RootCAs: pool, ServerName: "localhost"})
		if err := tc.Handshake(); err != nil {
			t.Fatalf("%s: TLS handshake: %v", mode, err)
		}
		c.c, c.r = tc, bufio.NewReader(tc)
		if types, _ := c.option(wire.OptStartTLS, nil); len(types) != 1 || types[0] != wire.RepErrInvalid {
			t.Fatalf("%s: a second STARTTLS: %#x", mode, types)
		}
		types, _ := c.option(wire.OptGo, goData("disk"))
		if types[len(types)-1] != wire.RepAck {
			t.Fatalf("%s: GO over TLS: %#x", mode, types)
		}
		c.request(wire.CmdRead, 0, 1, 0, 4096, nil)
		if _, errCode, data := c.simpleReply(4096); errCode != 0 || len(data) != 4096 {
			t.Fatalf("%s: a read over TLS: error %d, %d bytes", mode, errCode, len(data))
		}
	}
}

// TestTLSOptionalAndOff: optional serves plain-text clients; off refuses
// STARTTLS by policy.
func TestTLSOptionalAndOff(t *testing.T) {
	c, _ := tlsPair(t, TLSOptional)
	if types, _ := c.option(wire.OptGo, goData("disk")); types[len(types)-1] != wire.RepAck {
		t.Fatalf("optional: plain GO: %#x", types)
	}
	c, _ = tlsPair(t, TLSOff)
	if types, _ := c.option(wire.OptStartTLS, nil); len(types) != 1 || types[0] != wire.RepErrPolicy {
		t.Fatalf("off: STARTTLS: %#x", types)
	}
}
