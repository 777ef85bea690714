package http

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	nethttp "net/http"
	"net/url"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/coroutines"
	"github.com/blockexport/blockexport/formats/protocols/remote"
)

// fastClient sends the range GETs itself over kept-alive HTTP/1.1
// connections: one write a request, the head parsed by net/http's
// ReadResponse in the calling goroutine, the body read straight into the
// caller's buffers, at a fraction of net/http's Transport's CPU
// (docs/design.md, Remote objects: the HTTP range client). net/http still
// does Stat, proxies, redirects and 1xx replies.
type fastClient struct {
	dialer  *net.Dialer
	addr    string      // host:port dialed
	tlsConf *tls.Config // nil: plain http
	// head is the request's fixed part: the request line, Host,
	// User-Agent, Accept-Encoding and any basic authentication, with
	// the Range and condition headers to follow.
	head []byte

	mu      sync.Mutex
	idle    []*pconn // most recently used last
	maxIdle int
	closed  bool
}

// pconn is one connection of the pool.
type pconn struct {
	nc  net.Conn
	br  *bufio.Reader
	req []byte // the request being written
	// sock is the TCP socket under the connection; plain: no TLS over
	// it, so fill reads a body straight from it with readv.
	sock  syscall.RawConn
	plain bool
	iovs  []unix.Iovec
	rest  [][]byte
	// spin is how long a read of the reply tries again, on finding
	// nothing yet, before it sleeps in the poller: replySpin for a lone
	// reader's GET, else 0.
	spin time.Duration
}

// replySpin is how long a lone reader's GET spins for its reply before it
// sleeps: alone it has nothing else to do, a sleep costs a wake-up, and a
// server on loopback answers a 4 KiB range in about as long
// (docs/design.md, Remote objects: spinning for a lone reply).
const replySpin = 30 * time.Microsecond

// spinConn is the TCP connection under pc: its reads (the reply's head,
// TLS records) spin for pc.spin before they sleep.
type spinConn struct {
	*net.TCPConn
	pc *pconn
}

func (c spinConn) Read(p []byte) (int, error) {
	if c.pc.spin <= 0 || len(p) == 0 {
		return c.TCPConn.Read(p)
	}
	var n int
	err := c.pc.read(func(fd int) (err error) {
		n, err = unix.Read(fd, p)
		return err
	})
	if err != nil {
		return 0, err
	}
	if n == 0 {
		return 0, io.EOF
	}
	return n, nil
}

// read runs read on the socket once it has something to read: at once,
// after trying again for up to pc.spin, or after sleeping in the poller
// (which keeps the connection's deadlines).
func (pc *pconn) read(read func(fd int) error) error {
	var until time.Time
	var rerr error
	err := pc.sock.Read(func(fd uintptr) bool {
		for {
			rerr = read(int(fd))
			if rerr == unix.EINTR {
				continue
			}
			if rerr != unix.EAGAIN {
				return true
			}
			if pc.spin <= 0 {
				return false
			}
			now := time.Now()
			if until.IsZero() {
				until = now.Add(pc.spin)
			} else if now.After(until) {
				return false
			}
		}
	})
	if err == nil {
		err = rerr
	}
	return err
}

// stale says whether an idle connection has something to read before a
// request goes on it (the server closed it, or sent what no request asked
// for, which would be taken for the next reply): then it is not reused.
func (pc *pconn) stale() bool {
	if pc.br.Buffered() > 0 {
		return true
	}
	if pc.sock == nil {
		return false
	}
	var b [1]byte
	var rerr error
	if err := pc.sock.Read(func(fd uintptr) bool {
		_, _, rerr = unix.Recvfrom(int(fd), b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		return true
	}); err != nil {
		return true
	}
	// Nothing to read (EAGAIN) is the one good answer: bytes, an end of
	// stream (no error) or an error are not.
	return rerr != unix.EAGAIN
}

// fill reads a body of exactly the bytes of bufs after the reply's head:
// what the reader holds, then on plain TCP readv straight into bufs (a GET
// of several blocks in a few system calls). It returns the bytes read.
func (pc *pconn) fill(bufs [][]byte) (int, error) {
	// Cut down as they fill: a copy, the caller's are the blocks'.
	bufs = append(pc.rest[:0], bufs...)
	defer func() { clear(pc.rest); clear(pc.iovs) }()
	pc.rest = bufs
	got := 0
	for len(bufs) > 0 && pc.br.Buffered() > 0 {
		k, _ := pc.br.Read(bufs[0][:min(len(bufs[0]), pc.br.Buffered())])
		got += k
		if bufs[0] = bufs[0][k:]; len(bufs[0]) == 0 {
			bufs = bufs[1:]
		}
	}
	if !pc.plain {
		for _, d := range bufs {
			k, err := io.ReadFull(pc.br, d)
			got += k
			if err != nil {
				return got, err
			}
		}
		return got, nil
	}
	for len(bufs) > 0 {
		iovs := pc.iovs[:0]
		for _, d := range bufs[:min(len(bufs), 64)] {
			if len(d) > 0 {
				iovs = append(iovs, unix.Iovec{Base: unsafe.SliceData(d)})
				iovs[len(iovs)-1].SetLen(len(d))
			}
		}
		pc.iovs = iovs
		var k int
		err := pc.read(func(fd int) (err error) {
			k, err = readv(fd, iovs)
			return err
		})
		runtime.KeepAlive(bufs)
		if err == nil && k == 0 {
			err = io.ErrUnexpectedEOF
		}
		if err != nil {
			return got, err
		}
		got += k
		for k > 0 {
			c := min(k, len(bufs[0]))
			k -= c
			if bufs[0] = bufs[0][c:]; len(bufs[0]) == 0 {
				bufs = bufs[1:]
			}
		}
		for len(bufs) > 0 && len(bufs[0]) == 0 {
			bufs = bufs[1:]
		}
	}
	return got, nil
}

// readv is readv(2) on fd.
func readv(fd int, iovs []unix.Iovec) (int, error) {
	n, _, e := unix.Syscall(unix.SYS_READV, uintptr(fd), uintptr(unsafe.Pointer(unsafe.SliceData(iovs))), uintptr(len(iovs)))
	if e != 0 {
		return 0, e
	}
	return int(n), nil
}

// errUseStd: this request is net/http's to send (a redirect, a 1xx).
var errUseStd = errors.New("use net/http")

// aLongTimeAgo is a deadline that has passed: it ends a connection's I/O.
var aLongTimeAgo = time.Unix(1, 0)

// newFastClient is the client of u, or nil when u's requests must go
// through net/http (a proxy from the environment, a host name that is
// not plain ASCII).
func newFastClient(u *url.URL, tlsConf *tls.Config, conns int) *fastClient {
	if p, err := nethttp.ProxyFromEnvironment(&nethttp.Request{URL: u}); err != nil || p != nil {
		return nil
	}
	target := u.RequestURI()
	if !validValue(u.Host) || !validValue(target) || strings.ContainsRune(target, ' ') || u.Hostname() == "" {
		return nil
	}
	c := &fastClient{
		dialer:  &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second},
		addr:    canonicalHost(u),
		maxIdle: conns + 1,
	}
	if u.Scheme == "https" {
		c.tlsConf = tlsConf.Clone()
		c.tlsConf.ServerName = u.Hostname()
		c.tlsConf.NextProtos = nil // HTTP/1.1
	}
	h := []byte("GET " + target + " HTTP/1.1\r\nHost: " + u.Host + "\r\nUser-Agent: blockexport\r\nAccept-Encoding: identity\r\n")
	if u.User != nil {
		// What net/http's client makes of a URL's user and password.
		pw, _ := u.User.Password()
		auth := "Basic " + base64.StdEncoding.EncodeToString([]byte(u.User.Username()+":"+pw))
		if !validValue(auth) {
			return nil
		}
		h = append(h, "Authorization: "+auth+"\r\n"...)
	}
	c.head = h
	return c
}

// validValue says whether s may be written into a request line or header
// as it is: visible ASCII and spaces, no line breaks.
func validValue(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < ' ' || c >= 0x7f {
			return false
		}
	}
	return true
}

// get is an idle connection (reused) or a new one.
func (c *fastClient) get(ctx context.Context) (pc *pconn, reused bool, err error) {
	for {
		c.mu.Lock()
		n := len(c.idle)
		if n == 0 {
			c.mu.Unlock()
			break
		}
		pc = c.idle[n-1]
		c.idle = c.idle[:n-1]
		c.mu.Unlock()
		if !pc.stale() {
			return pc, true, nil
		}
		pc.nc.Close()
	}
	nc, err := c.dialer.DialContext(ctx, "tcp", c.addr)
	if err != nil {
		return nil, false, err
	}
	pc = &pconn{}
	if tc, ok := nc.(*net.TCPConn); ok {
		if raw, err := tc.SyscallConn(); err == nil {
			pc.sock = raw
			nc = spinConn{tc, pc}
		}
	}
	if c.tlsConf != nil {
		tc := tls.Client(nc, c.tlsConf)
		if err := tc.HandshakeContext(ctx); err != nil {
			nc.Close()
			return nil, false, err
		}
		nc = tc
	} else {
		pc.plain = pc.sock != nil
	}
	pc.nc, pc.br = nc, bufio.NewReaderSize(nc, 16<<10)
	return pc, false, nil
}

// put keeps pc for the next request, or closes it: also when the server
// sent more than the reply (what follows is no answer to the next
// request).
func (c *fastClient) put(pc *pconn) {
	pc.nc.SetDeadline(time.Time{})
	pc.spin = 0
	c.mu.Lock()
	if !c.closed && len(c.idle) < c.maxIdle && pc.br.Buffered() == 0 {
		c.idle = append(c.idle, pc)
		pc = nil
	}
	c.mu.Unlock()
	if pc != nil {
		pc.nc.Close()
	}
}

// close closes the idle connections; those in use are closed as they
// come back.
func (c *fastClient) close() {
	c.mu.Lock()
	idle := c.idle
	c.idle, c.closed = nil, true
	c.mu.Unlock()
	for _, pc := range idle {
		pc.nc.Close()
	}
}

// readRange is Backend.ReadRangev's GET of n bytes at off by this client;
// errUseStd when net/http must send it instead.
func (c *fastClient) readRange(ctx context.Context, b *Backend, obj remote.Object, bufs [][]byte, off, n int64) error {
	for attempt := 0; ; attempt++ {
		if err := ctx.Err(); err != nil {
			return remote.Temporary(fmt.Errorf("%s: %s: %w", b.name, rangeWhat(off, n), err))
		}
		pc, reused, err := c.get(ctx)
		if err != nil {
			return b.netError(fmt.Errorf("%s: %s: %w", b.name, rangeWhat(off, n), err))
		}
		if coroutines.PathOf(ctx) == coroutines.Lone {
			pc.spin = replySpin
		}
		// The context bounds the connection's I/O: its deadline, and
		// its end (Close, a reader giving up) cuts the I/O short.
		d, _ := ctx.Deadline()
		pc.nc.SetDeadline(d)
		stop := context.AfterFunc(ctx, func() { pc.nc.SetDeadline(aLongTimeAgo) })
		resp, err := c.roundTrip(pc, obj, off, n)
		if err != nil {
			stop()
			pc.nc.Close()
			if reused && attempt == 0 && ctx.Err() == nil {
				// A kept-alive connection the server had closed (or one
				// left in a bad state): once more on a new one, as
				// net/http does for an idempotent request.
				continue
			}
			if ctx.Err() != nil {
				err = ctx.Err()
			}
			return b.netError(fmt.Errorf("%s: %s: %w", b.name, rangeWhat(off, n), err))
		}
		if resp.StatusCode < 200 || resp.StatusCode/100 == 3 {
			stop()
			pc.nc.Close()
			if resp.StatusCode/100 == 3 {
				b.slow.Store(true) // the URL redirects: net/http checks where to
			}
			return errUseStd
		}
		what := rangeWhat(off, n)
		clean, err := b.readReply(resp, obj, bufs, off, n, what, func() {
			pc.nc.SetReadDeadline(time.Now().Add(chunkEndWait))
		}, pc.fill)
		if !stop() || err != nil || !clean || resp.Close {
			pc.nc.Close()
		} else {
			c.put(pc)
		}
		if err != nil && ctx.Err() != nil && errors.Is(err, remote.ErrTemporary) {
			// The connection's I/O was cut by the context, not the server:
			// say so, as net/http's client does.
			return remote.Temporary(fmt.Errorf("%s: %s: %w", b.name, what, ctx.Err()))
		}
		return err
	}
}

// roundTrip writes the GET of n bytes at off on pc and reads the reply's
// head.
func (c *fastClient) roundTrip(pc *pconn, obj remote.Object, off, n int64) (*nethttp.Response, error) {
	q := append(pc.req[:0], c.head...)
	q = append(q, "Range: bytes="...)
	q = strconv.AppendInt(q, off, 10)
	q = append(q, '-')
	q = strconv.AppendInt(q, off+n-1, 10)
	q = append(q, "\r\n"...)
	if k, v := condition(obj); k != "" {
		q = append(q, k...)
		q = append(q, ": "...)
		q = append(q, v...)
		q = append(q, "\r\n"...)
	}
	q = append(q, "\r\n"...)
	pc.req = q
	if _, err := pc.nc.Write(q); err != nil {
		return nil, err
	}
	return nethttp.ReadResponse(pc.br, &nethttp.Request{Method: nethttp.MethodGet})
}
