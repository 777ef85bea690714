package nbd

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/aio/sock"
	"github.com/blockexport/blockexport/coroutines"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
)

// Options describe the export.
type Options struct {
	// Name is the export name clients ask for ("" is the default export).
	Name        string
	Description string
	Writable    bool
	// MaxClients bounds concurrent connections; 0 means no bound.
	MaxClients int
	// PollMax bounds the adaptive busy-poll of a connection's socket
	// before its reader sleeps (see sock); 0 disables it.
	PollMax time.Duration
	// HandshakeLimit drops a client that has not finished the handshake
	// in this time (qemu-nbd's --handshake-limit); 0 means no limit.
	HandshakeLimit time.Duration
	// ConnBytes and ServerBytes bound the request buffers held at once by one
	// connection and by all (0: DefaultConnBytes, DefaultServerBytes): past
	// that, readers stop reading requests until replies go out.
	ConnBytes, ServerBytes int64
	// TLS is the server's TLS configuration (ServerTLSConfig); TLSMode
	// says whether clients must, may or may not use it.
	TLS     *tls.Config
	TLSMode TLSMode
	// CompactHeaders turns down NBD_OPT_EXTENDED_HEADERS, as servers
	// without the extension do (tests use it to speak the compact form
	// with our own client).
	CompactHeaders bool
	Logger         *slog.Logger
	// Extra are more exports beside Name: the disk's partitions
	// (--partitions), listed by NBD_OPT_LIST and chosen by name.
	Extra []Export
	// Meta are the meta contexts the export Name offers beside
	// base:allocation, in the order LIST_META_CONTEXT names them.
	Meta []MetaContext
}

// Export is one more export a server offers under its own name.
type Export struct {
	Name, Description string
	Image             formats.Image
}

// export finds the export a client names: the image and its
// description.
func (s *Server) export(name string) (formats.Image, string, bool) {
	if name == s.opts.Name {
		return s.img, s.opts.Description, true
	}
	for _, e := range s.opts.Extra {
		if e.Name == name {
			return e.Image, e.Description, true
		}
	}
	return nil, "", false
}

// Default bounds on the request buffers in flight. A connection's 64 MiB
// hold two requests of the largest size, or a thousand small ones; the
// server's 128 MiB keep a flood of 32 MiB reads from several clients near
// what qemu-nbd holds (about 200 MiB).
const (
	DefaultConnBytes   = 64 << 20
	DefaultServerBytes = 128 << 20
	// DefaultHandshakeLimit is qemu-nbd's default.
	DefaultHandshakeLimit = 10 * time.Second
)

// Server serves one image to any number of NBD connections.
type Server struct {
	img  formats.Image
	opts Options
	log  *slog.Logger

	mu     sync.Mutex
	conns  map[*conn]struct{}
	closed bool
	wg     sync.WaitGroup     // connections
	slots  chan struct{}      // MaxClients
	bufs   *aio.BufPool       // slow-path read buffers
	budget *coroutines.Budget // request buffers of all connections
}

// New makes a server for img.
func New(img formats.Image, o Options) *Server {
	o.Logger = cmp.Or(o.Logger, slog.Default())
	o.ConnBytes = cmp.Or(o.ConnBytes, DefaultConnBytes)
	o.ServerBytes = cmp.Or(o.ServerBytes, DefaultServerBytes)
	s := &Server{img: img, opts: o, log: o.Logger, conns: map[*conn]struct{}{},
		bufs: aio.NewBufPool(1<<20, 4096), budget: coroutines.NewBudget(o.ServerBytes)}
	if o.MaxClients > 0 {
		s.slots = make(chan struct{}, o.MaxClients)
	}
	return s
}

// transmissionFlags tells the truth about what the export does.
func (s *Server) transmissionFlags() uint16 {
	f := wire.FlagHasFlags | wire.FlagSendFlush | wire.FlagSendFUA | wire.FlagSendDF | wire.FlagSendCache | wire.FlagCanMultiConn
	if s.opts.Writable {
		f |= wire.FlagSendTrim | wire.FlagSendZeroes | wire.FlagSendFastZero
	} else {
		f |= wire.FlagReadOnly
	}
	return f
}

// Serve accepts connections on l until Shutdown; it returns nil then.
func (s *Server) Serve(l net.Listener) error {
	for {
		c, err := l.Accept()
		if err != nil {
			s.mu.Lock()
			closed := s.closed
			s.mu.Unlock()
			if closed || errors.Is(err, net.ErrClosed) {
				return nil
			}
			return err
		}
		if s.slots != nil {
			select {
			case s.slots <- struct{}{}:
			default:
				s.log.Warn("refusing a client: --max-clients reached", "remote", c.RemoteAddr().String())
				c.Close()
				continue
			}
		}
		log := s.log.With("remote", remoteName(c))
		stream, err := sock.New(c, s.opts.PollMax)
		if err != nil {
			log.Warn("NBD client dropped", "err", err)
			c.Close()
			if s.slots != nil {
				<-s.slots
			}
			continue
		}
		cn := newConn(s, stream, log)
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			stream.Close()
			return nil
		}
		s.conns[cn] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go func() {
			defer s.wg.Done()
			cn.serve()
			s.mu.Lock()
			delete(s.conns, cn)
			s.mu.Unlock()
			if s.slots != nil {
				<-s.slots
			}
		}()
	}
}

func remoteName(c net.Conn) string {
	if a := c.RemoteAddr(); a != nil && a.String() != "" && a.String() != "@" {
		return a.String()
	}
	return "unix"
}

// Shutdown stops taking requests: every connection finishes the requests it
// has read (their replies are sent) and is closed; then it returns. The
// caller closes the listener(s) first.
func (s *Server) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	s.closed = true
	for c := range s.conns {
		c.stop()
	}
	s.mu.Unlock()
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

var errAbort = errors.New("client aborted the negotiation")
