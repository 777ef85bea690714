package nbd

import (
	"cmp"
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
)

// ErrBadURI marks an NBD URI that cannot be right.
var ErrBadURI = errors.New("bad NBD URI")

// Address is where an export is: what an NBD URI says (the NBD project's
// doc/uri.md, as qemu-img and nbdinfo take it).
type Address struct {
	URI     string // as given, for messages and `info`
	Network string // "tcp" or "unix"
	Addr    string // host:port, or the socket's path
	Export  string
	TLS     bool
	// ServerName is what the server's certificate must name: the host,
	// or for a unix socket the tls-hostname query (default "localhost").
	ServerName string
	// CertDir is the tls-certificates query: a directory with
	// ca-cert.pem, and client-cert.pem and client-key.pem if the server
	// wants a client certificate (libnbd's and QEMU's names).
	CertDir string
}

// IsURI says whether spec is an NBD URI (and not a file path).
func IsURI(spec string) bool {
	scheme, _, ok := strings.Cut(spec, "://")
	return ok && slices.Contains([]string{"nbd", "nbds", "nbd+unix", "nbds+unix", "nbd+tcp", "nbds+tcp"}, scheme)
}

// ParseURI parses nbd://HOST[:PORT]/EXPORT, nbd+unix:///EXPORT?socket=PATH
// and their TLS forms nbds:// and nbds+unix://.
func ParseURI(spec string) (Address, error) {
	u, err := url.Parse(spec)
	if err != nil {
		return Address{}, fmt.Errorf("%w %q: %v", ErrBadURI, spec, err)
	}
	a := Address{URI: spec}
	transport := "tcp"
	switch u.Scheme {
	case "nbd", "nbd+tcp":
	case "nbds", "nbds+tcp":
		a.TLS = true
	case "nbd+unix":
		transport = "unix"
	case "nbds+unix":
		transport, a.TLS = "unix", true
	default:
		return Address{}, fmt.Errorf("%w %q: scheme %q (want nbd, nbds, nbd+unix or nbds+unix)", ErrBadURI, spec, u.Scheme)
	}
	if u.User != nil {
		return Address{}, fmt.Errorf("%w %q: user names are for TLS-PSK, which is not supported", ErrBadURI, spec)
	}
	// The export name is the path without its leading slash, unescaped.
	a.Export = strings.TrimPrefix(u.Path, "/")
	if len(a.Export) > wire.MaxStringLen {
		return Address{}, fmt.Errorf("%w %q: export name longer than %d bytes", ErrBadURI, spec, wire.MaxStringLen)
	}
	q := u.Query()
	for k := range q {
		switch k {
		case "socket", "tls-certificates", "tls-hostname":
		default:
			return Address{}, fmt.Errorf("%w %q: unknown query parameter %q", ErrBadURI, spec, k)
		}
	}
	a.CertDir = q.Get("tls-certificates")
	if transport == "unix" {
		if u.Host != "" {
			return Address{}, fmt.Errorf("%w %q: a unix socket URI has no host (nbd+unix:///EXPORT?socket=PATH)", ErrBadURI, spec)
		}
		a.Network, a.Addr = "unix", q.Get("socket")
		if a.Addr == "" {
			return Address{}, fmt.Errorf("%w %q: the socket=PATH query is missing", ErrBadURI, spec)
		}
		a.ServerName = cmp.Or(q.Get("tls-hostname"), "localhost")
		return a, nil
	}
	if q.Has("socket") {
		return Address{}, fmt.Errorf("%w %q: socket= is for nbd+unix URIs", ErrBadURI, spec)
	}
	host, port := cmp.Or(u.Hostname(), "localhost"), u.Port()
	if port == "" {
		port = strconv.Itoa(wire.DefaultPort)
	} else if n, err := strconv.Atoi(port); err != nil || n <= 0 || n > 65535 {
		return Address{}, fmt.Errorf("%w %q: port %q", ErrBadURI, spec, port)
	}
	a.Network, a.Addr, a.ServerName = "tcp", net.JoinHostPort(host, port), cmp.Or(q.Get("tls-hostname"), host)
	return a, nil
}

// ErrUntrustedTLSFiles marks a URI taken from an image (a qcow2 backing
// file) that names a tls-certificates directory.
var ErrUntrustedTLSFiles = errors.New("an image's backing file may not name TLS certificate files")

// ParseImageURI parses a URI that an image names (a qcow2 backing file).
// Whoever wrote the image wrote it: it may name a server, but never which
// certificate and key of this machine to present there, nor which CA to
// trust. A tls-certificates parameter is refused, so that TLSConfig only
// ever reads the files the user passed.
func ParseImageURI(spec string) (Address, error) {
	a, err := ParseURI(spec)
	if err != nil {
		return Address{}, err
	}
	if a.CertDir != "" {
		return Address{}, fmt.Errorf("%w (tls-certificates=%s): an image is untrusted input; the client's certificate, key and CA come only from the command line (--tls-ca/--tls-cert/--tls-key; for nbd, --image-tls-*)",
			ErrUntrustedTLSFiles, a.CertDir)
	}
	return a, nil
}

// Canonical is the URI as QEMU writes it back (its filename in qemu-img
// info and map): the export's slash only when it has a name, the socket
// or host and port spelt out, the TLS query parameters left out.
func (a Address) Canonical() string {
	scheme := "nbd"
	if a.TLS {
		scheme = "nbds"
	}
	export := ""
	if a.Export != "" {
		export = "/" + (&url.URL{Path: a.Export}).EscapedPath()
	}
	if a.Network == "unix" {
		return scheme + "+unix://" + export + "?socket=" + a.Addr
	}
	return scheme + "://" + a.Addr + export
}
