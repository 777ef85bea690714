package nbd

import (
	"cmp"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// TLSFiles are the client's PEM files for an nbds URI. Empty names come
// from the URI's tls-certificates directory (ca-cert.pem, client-cert.pem,
// client-key.pem, as libnbd and QEMU name them), and without one the CA is
// the system's and no client certificate is sent.
type TLSFiles struct {
	CA, Cert, Key string
}

// TLSConfig makes the client's TLS configuration for addr: the server's
// certificate must be signed by the CA and name addr.ServerName.
func TLSConfig(addr Address, f TLSFiles) (*tls.Config, error) {
	if dir := addr.CertDir; dir != "" {
		f.CA = cmp.Or(f.CA, filepath.Join(dir, "ca-cert.pem"))
		if f.Cert == "" && f.Key == "" {
			cert, key := filepath.Join(dir, "client-cert.pem"), filepath.Join(dir, "client-key.pem")
			if _, err := os.Stat(cert); err == nil {
				f.Cert, f.Key = cert, key
			} else if !errors.Is(err, fs.ErrNotExist) {
				return nil, fmt.Errorf("nbd: TLS: %w", err)
			}
		}
	}
	conf := &tls.Config{ServerName: addr.ServerName, MinVersion: tls.VersionTLS12}
	if f.CA != "" {
		pem, err := os.ReadFile(f.CA)
		if err != nil {
			return nil, fmt.Errorf("nbd: TLS CA: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("nbd: TLS CA %s: no PEM certificate in it", f.CA)
		}
		conf.RootCAs = pool
	}
	if (f.Cert == "") != (f.Key == "") {
		return nil, errors.New("nbd: TLS: a client certificate needs its key, and a key its certificate")
	}
	if f.Cert != "" {
		cert, err := tls.LoadX509KeyPair(f.Cert, f.Key)
		if err != nil {
			return nil, fmt.Errorf("nbd: TLS client certificate: %w", err)
		}
		conf.Certificates = []tls.Certificate{cert}
	}
	return conf, nil
}
