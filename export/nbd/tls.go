package nbd

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/blockexport/blockexport/aio/sock"
)

// TLSMode is when the server speaks TLS (NBD_OPT_STARTTLS).
type TLSMode string

const (
	TLSOff      TLSMode = "off"      // STARTTLS is refused
	TLSOptional TLSMode = "optional" // clients may upgrade, or not
	// TLSRequire: nothing but STARTTLS (and ABORT) is answered before the
	// upgrade, so no export data and no export name leave unencrypted.
	TLSRequire TLSMode = "require"
)

// ParseTLSMode checks a --tls value.
func ParseTLSMode(s string) (TLSMode, error) {
	switch m := TLSMode(s); m {
	case TLSOff, TLSOptional, TLSRequire:
		return m, nil
	}
	return "", fmt.Errorf("unknown --tls mode %q (want require, optional or off)", s)
}

// ServerTLSConfig makes the server's TLS configuration from PEM files.
// With a CA, clients must present a certificate it signed.
func ServerTLSConfig(certFile, keyFile, caFile string) (*tls.Config, error) {
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("TLS certificate: %w", err)
	}
	conf := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("TLS CA: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("TLS CA %s: no PEM certificate in it", caFile)
		}
		conf.ClientCAs = pool
		conf.ClientAuth = tls.RequireAndVerifyClientCert
		// GnuTLS clients (nbdinfo, qemu-img, qemu-nbd's client side)
		// sent no certificate to a Go server's TLS 1.3 request for one
		// (measured: "client didn't provide a certificate"; TLS 1.2
		// works, and so does TLS 1.3 without client certificates).
		conf.MaxVersion = tls.VersionTLS12
	}
	return conf, nil
}

// startTLS upgrades the connection after STARTTLS was acknowledged: the
// TLS handshake, then a stream and a reader over it. Bytes the client sent
// before the handshake would be plain text taken for TLS: an error.
func (c *conn) startTLS(r *bufio.Reader) (*bufio.Reader, error) {
	if r.Buffered() > 0 {
		return nil, errors.New("client sent data before the TLS handshake")
	}
	under := c.sock
	tc := tls.Server(streamConn{under}, c.srv.opts.TLS)
	if err := tc.Handshake(); err != nil {
		return nil, fmt.Errorf("TLS handshake: %w", err)
	}
	tlsSide, err := sock.New(tc, 0) // no descriptor of its own: plain reads and writes through TLS
	if err != nil {
		return nil, err
	}
	c.sock = tlsStream{tlsSide, under}
	c.log.Debug("NBD client upgraded to TLS", "version", tls.VersionName(tc.ConnectionState().Version))
	return bufio.NewReaderSize(c.sock, 256<<10), nil
}

// tlsStream is a connection after STARTTLS: reads and writes through TLS
// (whose Pending says yes: it cannot see into TLS's buffers, so the reader
// never blocks in a request it thinks is alone while another waits
// decrypted), shutting down reading (to wake the reader) on the socket
// beneath.
type tlsStream struct {
	sock.Stream
	under sock.Stream
}

func (t tlsStream) CloseRead() error { return t.under.CloseRead() }

// streamConn is a sock.Stream as the net.Conn crypto/tls wants. Deadlines
// are not kept: the handshake limit wakes a stuck handshake instead.
type streamConn struct{ sock.Stream }

type noAddr struct{}

func (noAddr) Network() string { return "nbd" }
func (noAddr) String() string  { return "nbd" }

func (streamConn) LocalAddr() net.Addr              { return noAddr{} }
func (streamConn) RemoteAddr() net.Addr             { return noAddr{} }
func (streamConn) SetDeadline(time.Time) error      { return nil }
func (streamConn) SetReadDeadline(time.Time) error  { return nil }
func (streamConn) SetWriteDeadline(time.Time) error { return nil }
