package engine

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"os"
	"syscall"
	"time"

	"github.com/blockexport/blockexport/export/nbd"
	"github.com/blockexport/blockexport/formats"
)

// NBDAddress is where nbd-server-start listens: a unix socket (Path) or
// TCP (Host, Port).
type NBDAddress struct {
	Type       string // "unix" or "inet"
	Path       string
	Host, Port string
}

// NBDServerOptions are nbd-server-start's arguments.
type NBDServerOptions struct {
	Addr NBDAddress
	// MaxConnections bounds the clients (0: no bound, QEMU's default).
	MaxConnections int
	// TLSCreds names the tls-creds-x509 object (a server endpoint) whose
	// TLS every client must start before anything else; "" for none.
	TLSCreds string
	// TLSAuthz names an authz object; there are none here (object-add
	// takes TLS credentials only), so any name is refused.
	TLSAuthz string
}

// nbdServer is the one NBD server of the engine and its listener.
type nbdServer struct {
	srv    *nbd.Server
	l      net.Listener
	path   string // the unix socket we made, removed at stop
	served chan error
	// busy are the bitmaps an export offers: QEMU marks them busy, and
	// another export may not offer them until that one ends.
	busy map[bitmapKey]bool
}

// bitmapKey names one persistent bitmap of one image.
type bitmapKey struct {
	img  formats.Image
	name string
}

// StartNBD starts the NBD server (nbd-server-start).
func (e *Engine) StartNBD(o NBDServerOptions) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.nbd != nil {
		return genericf("NBD server already running")
	}
	var conf *tls.Config
	tlsMode := nbd.TLSOff
	if o.TLSCreds != "" {
		var err error
		if conf, err = e.serverTLS(o.TLSCreds); err != nil {
			return err
		}
		tlsMode = nbd.TLSRequire
	}
	if o.TLSAuthz != "" {
		// QEMU's words when a client's certificate is checked against
		// an authz id no object has.
		return genericf("Cannot find QAuthZ object ID %s", o.TLSAuthz)
	}
	l, path, err := listen(o.Addr)
	if err != nil {
		return err
	}
	// At max-connections QSD 7.2 stops accepting: one more client
	// waits, connected but unanswered, until another leaves.
	srv := nbd.New(nil, nbd.Options{MaxClients: o.MaxConnections, WaitAtMaxClients: true, HandshakeLimit: nbd.DefaultHandshakeLimit,
		PollMax: 32 * time.Microsecond, Logger: e.log.With("nbd-server", l.Addr().String()),
		TLS: conf, TLSMode: tlsMode})
	s := &nbdServer{srv: srv, l: l, path: path, served: make(chan error, 1), busy: map[bitmapKey]bool{}}
	go func() { s.served <- srv.Serve(l) }()
	e.nbd = s
	e.log.Info("NBD server started", "addr", l.Addr().String())
	return nil
}

// listen listens where a takes it; a unix socket's path is replaced, as
// QEMU unlinks it before binding.
func listen(a NBDAddress) (net.Listener, string, error) {
	switch a.Type {
	case "unix":
		if st, err := os.Lstat(a.Path); err == nil && st.Mode()&os.ModeSocket != 0 {
			os.Remove(a.Path)
		}
		l, err := net.Listen("unix", a.Path)
		if err != nil {
			return nil, "", genericf("Failed to bind socket to %s: %s", a.Path, errnoText(unwrapSyscall(err)))
		}
		return l, a.Path, nil
	case "inet":
		l, err := net.Listen("tcp", net.JoinHostPort(a.Host, a.Port))
		if err != nil {
			return nil, "", genericf("Failed to bind socket: %s", errnoText(unwrapSyscall(err)))
		}
		return l, "", nil
	}
	return nil, "", genericf("Parameter 'type' does not accept value '%s'", a.Type)
}

// unwrapSyscall digs the errno out of a net error.
func unwrapSyscall(err error) error {
	var en syscall.Errno
	if errors.As(err, &en) {
		return en
	}
	return err
}

func (s *nbdServer) has(name string) bool {
	return s.srv.Has(name)
}

// stop closes the listener and ends every connection. The error is
// Shutdown's: connections that did not end in time.
func (s *nbdServer) stop() error {
	s.l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), exportTimeout)
	defer cancel()
	err := s.srv.Shutdown(ctx)
	<-s.served
	if s.path != "" {
		os.Remove(s.path)
	}
	return err
}

// StopNBD stops the NBD server (nbd-server-stop) and with it every NBD
// export, each with its deletion event, as QEMU does.
func (e *Engine) StopNBD() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.nbd == nil {
		return genericf("NBD server not running")
	}
	for i := len(e.exports) - 1; i >= 0; i-- {
		if x := e.exports[i]; x.nbdName != "" {
			e.removeExport(context.Background(), x, true)
		}
	}
	e.nbd.stop()
	e.nbd = nil
	e.log.Info("NBD server stopped")
	return nil
}
