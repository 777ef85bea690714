package nbd

import (
	"errors"
	"testing"
)

// TestParseImageURI: a URI an image names may say where the server is,
// never which certificate files to read.
func TestParseImageURI(t *testing.T) {
	for _, uri := range []string{
		"nbds://evil.example:10809/disk?tls-certificates=/root/.pki",
		"nbds+unix:///disk?socket=/run/s.sock&tls-certificates=/etc/pki/qemu",
		"nbd://host/disk?tls-certificates=/etc/pki/qemu", // plain text today, TLS tomorrow: still refused
	} {
		if _, err := ParseImageURI(uri); !errors.Is(err, ErrUntrustedTLSFiles) {
			t.Errorf("%s: err %v, want ErrUntrustedTLSFiles", uri, err)
		}
	}
	a, err := ParseImageURI("nbds://host:1234/disk?tls-hostname=other")
	if err != nil || !a.TLS || a.CertDir != "" || a.ServerName != "other" {
		t.Errorf("a URI without tls-certificates: %+v, %v", a, err)
	}
	if _, err := ParseImageURI("nbd://host/disk?bogus=1"); !errors.Is(err, ErrBadURI) {
		t.Errorf("a bad URI from an image: %v, want ErrBadURI", err)
	}
}
