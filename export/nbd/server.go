package nbd

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
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
	// WaitAtMaxClients: at MaxClients the server stops accepting, so that
	// one more client waits in the listen backlog until another leaves,
	// as qemu-storage-daemon's max-connections does; otherwise the extra
	// client is closed at once.
	WaitAtMaxClients bool
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
	// Writable is for exports given to Add; those in Options.Extra are
	// as writable as Options.Writable says.
	Writable bool
	// Meta are the meta contexts an export given to Add offers beside
	// base:allocation (Options.Meta are the server's own export's; those
	// in Options.Extra offer none: a partition's offsets are not the
	// disk's).
	Meta []MetaContext
}

// export finds the export a client names. A server made with a nil
// image (New(nil, ...)) has no export of its own, only those added.
func (s *Server) export(name string) (Export, bool) {
	if name == s.opts.Name && s.img != nil {
		return Export{Name: name, Description: s.opts.Description, Image: s.img, Writable: s.opts.Writable, Meta: s.opts.Meta}, true
	}
	for _, e := range s.opts.Extra {
		if e.Name == name {
			e.Writable, e.Meta = s.opts.Writable, nil
			return e, true
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.added[name]
	return e, ok
}

// exports lists every export, for NBD_OPT_LIST.
func (s *Server) exports() []Export {
	var list []Export
	if s.img != nil {
		list = append(list, Export{Name: s.opts.Name, Description: s.opts.Description})
	}
	list = append(list, s.opts.Extra...)
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, e := range s.added {
		list = append(list, e)
	}
	return list
}

// ErrExportInUse is Remove in safe mode of an export a client is
// connected to (QEMU's block-export-del refuses it the same way).
var ErrExportInUse = errors.New("export still in use")

// Add offers one more export while the server runs (a daemon's
// block-export-add); clients that connect from now on may choose it.
func (s *Server) Add(e Export) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.added[e.Name]; ok || (e.Name == s.opts.Name && s.img != nil) {
		return fmt.Errorf("an NBD export named %q already exists", e.Name)
	}
	s.added[e.Name] = e
	return nil
}

// Remove takes back an export given to Add. In safe mode (hard false) it
// refuses while a client is connected to it; hard, it stops those
// connections (each finishes what it has read). Either way it waits for
// the connections of the export to end (those of clients that hung up
// too), so that the export's image may be closed once it returns.
func (s *Server) Remove(ctx context.Context, name string, hard bool) error {
	s.mu.Lock()
	if _, ok := s.added[name]; !ok {
		s.mu.Unlock()
		return fmt.Errorf("no NBD export named %q", name)
	}
	var users []*conn
	inUse := false
	for c := range s.conns {
		if c.chosen == name && c.chose {
			users = append(users, c)
			inUse = inUse || !c.left && !c.hungUp()
		}
	}
	if inUse && !hard {
		s.mu.Unlock()
		return ErrExportInUse
	}
	delete(s.added, name)
	s.mu.Unlock()
	for _, c := range users {
		c.stop()
	}
	for _, c := range users {
		select {
		case <-c.ended:
		case <-ctx.Done():
			return fmt.Errorf("NBD export %q: connections did not finish: %w", name, ctx.Err())
		}
	}
	return nil
}

// Has says whether the server offers an export of that name.
func (s *Server) Has(name string) bool {
	_, ok := s.export(name)
	return ok
}

// leaving records that c's client has hung up.
func (s *Server) leaving(c *conn) {
	s.mu.Lock()
	c.left = true
	s.mu.Unlock()
}

// choose records that c serves the export e from now on: Remove sees it.
func (s *Server) choose(c *conn, e Export) {
	s.mu.Lock()
	c.img, c.writable, c.meta, c.chosen, c.chose = e.Image, e.Writable, e.Meta, e.Name, true
	s.mu.Unlock()
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
	added  map[string]Export // by Add
	conns  map[*conn]struct{}
	closed bool
	wg     sync.WaitGroup     // connections
	slots  chan struct{}      // MaxClients
	quit   chan struct{}      // closed by Shutdown: Serve stops waiting for a slot
	bufs   *aio.BufPool       // slow-path read buffers
	budget *coroutines.Budget // request buffers of all connections
}

// New makes a server for img.
func New(img formats.Image, o Options) *Server {
	o.Logger = cmp.Or(o.Logger, slog.Default())
	o.ConnBytes = cmp.Or(o.ConnBytes, DefaultConnBytes)
	o.ServerBytes = cmp.Or(o.ServerBytes, DefaultServerBytes)
	s := &Server{img: img, opts: o, log: o.Logger, conns: map[*conn]struct{}{}, added: map[string]Export{},
		bufs: aio.NewBufPool(1<<20, 4096), budget: coroutines.NewBudget(o.ServerBytes), quit: make(chan struct{})}
	if o.MaxClients > 0 {
		s.slots = make(chan struct{}, o.MaxClients)
	}
	return s
}

// transmissionFlags tells the truth about what an export does.
func transmissionFlags(writable bool) uint16 {
	f := wire.FlagHasFlags | wire.FlagSendFlush | wire.FlagSendFUA | wire.FlagSendDF | wire.FlagSendCache | wire.FlagCanMultiConn
	if writable {
		f |= wire.FlagSendTrim | wire.FlagSendZeroes | wire.FlagSendFastZero
	} else {
		f |= wire.FlagReadOnly
	}
	return f
}

// Serve accepts connections on l until Shutdown; it returns nil then.
func (s *Server) Serve(l net.Listener) error {
	for {
		if s.opts.WaitAtMaxClients && s.slots != nil {
			if !s.waitForSlot() {
				return nil
			}
		}
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
		if s.slots != nil && !s.opts.WaitAtMaxClients {
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
			defer close(cn.ended)
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

// waitForSlot takes a MaxClients slot before the next accept, waiting
// while every slot is held; false once the server is shut down.
func (s *Server) waitForSlot() bool {
	select {
	case s.slots <- struct{}{}:
		return true
	default:
	}
	s.log.Info("NBD client limit reached: new clients wait until one leaves", "max-connections", cap(s.slots))
	select {
	case s.slots <- struct{}{}:
		return true
	case <-s.quit:
		return false
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
	if !s.closed {
		close(s.quit)
	}
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
