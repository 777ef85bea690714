package nbd

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/aio/sock"
	"github.com/blockexport/blockexport/coroutines"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
)

// request is one transmission-phase request, compact (28-byte header,
// 32-bit length) or extended (32 bytes, 64-bit length).
type request struct {
	flags, typ  uint16
	cookie, off uint64
	length      uint64 // the payload's with CmdFlagPayloadLen, else the range's
}

// conn is one client connection.
type conn struct {
	srv *Server
	// img is the export the client chose (the server's, or an extra
	// one's: a partition), set by the handshake before any request.
	img formats.Image
	// writable, chosen and chose say which export the client chose and
	// whether it may write (set with img under the server's mu: choose).
	writable bool
	// meta are the meta contexts of the chosen export (Export.Meta).
	meta   []MetaContext
	chosen string
	chose  bool
	// left: the client has hung up (DISC or end of stream); what is left
	// is to finish its requests, and Remove does not count it as a user.
	left bool
	// ended is closed when serve has returned (Server.Remove waits on it).
	ended chan struct{}
	sock  sock.Stream // the client's stream: through TLS after STARTTLS
	// raw is the socket's own stream, for waking the reader from other
	// goroutines (sock changes under the reader at STARTTLS).
	raw sock.Stream
	log *slog.Logger

	wmu sync.Mutex // one reply at a time on the wire
	// hdr holds the reply header being sent (under wmu): built here, it
	// does not cost an allocation per reply.
	hdr [wire.ExtendedReplySize + 12]byte
	// Replies are buffered in bw. While the reader still has requests in
	// hand (corked), replies collect there and go out together when it is
	// about to wait for more: one write for many replies, as QEMU corks.
	bw     *bufio.Writer
	corked bool

	// hand runs what may wait: in the reader when it is alone, else in a
	// goroutine (see coroutines.Handoff).
	hand     *coroutines.Handoff
	scratch  []byte // the reader's buffer for inline reads and writes
	stopOnce sync.Once
	// hsMu orders the handshake limit's hangUp against the end of the
	// handshake (hsOver): past it, serve may close the stream.
	hsMu     sync.Mutex
	hsOver   bool
	stopping chan struct{}
	neg      negotiated

	// ctx is cancelled when the client is gone (its stream ended or a
	// reply could not be sent): requests not yet run are dropped, and a
	// reader waiting for budget gives up. A clean stop (DISC, shutdown)
	// does not cancel: what was read is answered.
	ctx    context.Context
	cancel context.CancelFunc
	// budget bounds this connection's request buffers (Options.ConnBytes).
	budget *coroutines.Budget
}

func newConn(s *Server, stream sock.Stream, log *slog.Logger) *conn {
	c := &conn{srv: s, img: s.img, writable: s.opts.Writable, meta: s.opts.Meta, ended: make(chan struct{}), sock: stream, raw: stream, log: log, stopping: make(chan struct{}),
		budget: coroutines.NewBudget(s.opts.ConnBytes)}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	c.hand = coroutines.NewHandoff(c.ctx)
	return c
}

// requestCost is what a request counts against the budgets while it is
// in flight: its buffer, and at least minRequestCost, since a request
// without data still holds a goroutine.
func requestCost(req request) int64 {
	n := int64(0)
	switch req.typ {
	case wire.CmdRead, wire.CmdWrite:
		n = int64(min(req.length, maxRequest)) // larger ones are refused
	case wire.CmdCache:
		n = int64(min(req.length, 1<<20))
	}
	return max(n, minRequestCost)
}

// minRequestCost bounds the requests without data one connection keeps in
// flight (a thousand at the default budget).
const minRequestCost = 64 << 10

// acquire takes cost from the connection's budget and the server's,
// waiting (back-pressure: the reader reads no further request) until both
// have room or the client is gone.
func (c *conn) acquire(cost int64) error {
	if c.budget.TryAcquire(cost) {
		if c.srv.budget.TryAcquire(cost) {
			return nil
		}
		c.budget.Release(cost)
	}
	// About to wait: send the replies collected so far first.
	c.uncork()
	if err := c.budget.Acquire(c.ctx, cost); err != nil {
		return err
	}
	if err := c.srv.budget.Acquire(c.ctx, cost); err != nil {
		c.budget.Release(cost)
		return err
	}
	return nil
}

func (c *conn) release(cost int64) {
	c.srv.budget.Release(cost)
	c.budget.Release(cost)
}

// hangUp ends both directions of a connection still in the handshake (and
// says whether it was): a client that floods options and never reads
// blocks our option reply in write, which only shutdown(2) wakes (close(2)
// would not, and could hit a reused descriptor). Under hsMu, so never on a
// stream that serve has closed.
func (c *conn) hangUp() bool {
	c.hsMu.Lock()
	defer c.hsMu.Unlock()
	if c.hsOver {
		return false
	}
	fs, ok := c.raw.(interface{ Fd() int })
	if !ok {
		c.raw.Close() // a net.Conn without a descriptor: Close wakes its writer
		return true
	}
	if err := unix.Shutdown(fs.Fd(), unix.SHUT_RDWR); err != nil {
		c.log.Debug("shutdown of a client socket", "err", err)
	}
	return true
}

// stop makes the connection finish what it has read and close.
func (c *conn) stop() {
	c.stopOnce.Do(func() {
		close(c.stopping)
		// A client still negotiating has nothing to be answered, and
		// may hold our option reply blocked in write: hang up.
		if c.hangUp() {
			return
		}
		// Wake the reader: it then waits for the requests in flight.
		c.raw.CloseRead()
	})
}

func (c *conn) serve() {
	defer func() { c.sock.Close() }() // the TLS stream, once there is one
	defer c.cancel()
	r := bufio.NewReaderSize(c.sock, 256<<10)
	c.bw = bufio.NewWriterSize(c.sock, 256<<10)
	c.scratch = aio.AlignedBuf(1<<20, 4096)
	var limit *time.Timer
	if d := c.srv.opts.HandshakeLimit; d > 0 {
		// A client that never finishes the handshake would hold its
		// --max-clients slot forever.
		limit = time.AfterFunc(d, func() {
			c.log.Warn("dropping an NBD client that did not finish the handshake in time", "limit", d)
			c.hangUp()
		})
	}
	neg, err := c.negotiate(&r)
	if limit != nil && !limit.Stop() {
		err = cmp.Or(err, errors.New("handshake limit passed"))
	}
	c.hsMu.Lock()
	c.hsOver = true // from here on the stream may be closed: hangUp must not touch it
	c.hsMu.Unlock()
	if err != nil {
		if !errors.Is(err, errAbort) && !errors.Is(err, io.EOF) {
			c.log.Warn("NBD negotiation failed", "err", err)
		}
		return
	}
	c.neg = neg
	c.bw.Reset(c.sock) // after STARTTLS: through TLS
	c.log.Debug("NBD client connected", "structured", neg.structured, "extended headers", neg.extended, "meta contexts", neg.meta.any())
	err = c.transmit(r)
	c.srv.leaving(c)
	if err != nil {
		c.cancel() // the client is gone: drop what it left queued
	}
	c.hand.Wait()
	if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) && !errors.Is(err, context.Canceled) {
		c.log.Warn("NBD connection ended", "err", err)
	}
}

// transmit reads requests until DISC, EOF or a protocol error. Each request
// runs in its own goroutine; a write's payload is read here first, so the
// stream stays in step.
func (c *conn) transmit(r *bufio.Reader) error {
	var hb [wire.ExtendedRequestSize]byte
	hsize := wire.RequestSize
	if c.neg.extended {
		hsize = wire.ExtendedRequestSize
	}
	var yield coroutines.Yielder // see there
	for {
		yield.Tick()
		if r.Buffered() < hsize {
			c.uncork() // about to wait on the socket: send what is ready
		}
		if _, err := io.ReadFull(r, hb[:hsize]); err != nil {
			select {
			case <-c.stopping:
				return nil
			default:
			}
			return err
		}
		c.cork()
		req, err := c.parseRequest(hb[:hsize])
		if err != nil {
			c.uncork()
			return err
		}
		var payload []byte
		cost := int64(0) // taken from the budgets, once the request must wait
		if c.neg.extended && req.flags&wire.CmdFlagPayloadLen != 0 && req.typ != wire.CmdWrite {
			// A payload no command here takes: skipped, then refused.
			if _, err := r.Discard(int(req.length)); err != nil {
				return err
			}
			c.errorReply(req, wire.EInval, "this command takes no payload")
			continue
		}
		if c.neg.extended && req.typ == wire.CmdWrite && req.flags&wire.CmdFlagPayloadLen == 0 {
			// Its length is then no payload's: nothing to read.
			c.errorReply(req, wire.EInval, "a WRITE under extended headers must carry NBD_CMD_FLAG_PAYLOAD_LEN")
			continue
		}
		if req.typ == wire.CmdWrite {
			// A write that fits the reader's buffer is read there and
			// tried in place; one that cannot be done at once moves to
			// a buffer of its own (the reader's is reused).
			fits := req.length <= uint64(cap(c.scratch)) // at most maxRequest: parseRequest
			if fits {
				payload = c.scratch[:req.length]
			} else {
				if cost = requestCost(req); c.acquire(cost) != nil {
					return c.ctx.Err()
				}
				// Page-aligned, so that an O_DIRECT image writes it as
				// it is, without a bounce copy.
				payload = aio.AlignedBuf(int(req.length), 4096)
			}
			if _, err := io.ReadFull(r, payload); err != nil {
				if cost > 0 {
					c.release(cost) // the server's budget outlives this client
				}
				return err
			}
			if fits {
				if c.tryWriteInline(req, payload) {
					continue
				}
				if cost = requestCost(req); c.acquire(cost) != nil {
					return c.ctx.Err()
				}
				p := aio.AlignedBuf(len(payload), 4096)
				copy(p, payload)
				payload = p
			}
		}
		if req.typ == wire.CmdDisc {
			c.srv.leaving(c)
			c.uncork()
			c.hand.Wait()
			if c.writable {
				c.img.Flush(context.Background())
			}
			return nil
		}
		path := coroutines.Fresh
		if req.typ == wire.CmdRead {
			switch c.tryReadInline(req) {
			case answered:
				continue
			case missed:
				path = coroutines.AfterMiss
			}
		}
		if cost == 0 {
			if cost = requestCost(req); c.acquire(cost) != nil {
				return c.ctx.Err()
			}
		}
		if (req.typ == wire.CmdRead || req.typ == wire.CmdWrite) && c.hand.Lone(func() bool { return c.queued(r) }) {
			c.handle(c.hand.Context(coroutines.Lone), req, payload)
			c.release(cost)
			continue
		}
		c.hand.Start()
		go func() {
			defer c.hand.Done()
			defer c.release(cost)
			c.handle(c.hand.Context(path), req, payload)
		}()
	}
}

// parseRequest decodes a request header, compact or extended. A bad magic
// (the stream out of step) or a payload larger than we advertised (it
// cannot be skipped safely) ends the connection.
func (c *conn) parseRequest(h []byte) (request, error) {
	req := request{flags: be.Uint16(h[4:]), typ: be.Uint16(h[6:]), cookie: be.Uint64(h[8:]), off: be.Uint64(h[16:])}
	magic := wire.MagicRequest
	if c.neg.extended {
		magic = wire.MagicExtendedRequest
		req.length = be.Uint64(h[24:])
	} else {
		req.length = uint64(be.Uint32(h[24:]))
	}
	if got := be.Uint32(h); got != magic {
		return req, fmt.Errorf("bad request magic %#x: the stream is out of step", got)
	}
	hasPayload := req.typ == wire.CmdWrite
	if c.neg.extended {
		hasPayload = req.flags&wire.CmdFlagPayloadLen != 0
	}
	if hasPayload && req.length > maxRequest {
		c.errorReply(req, wire.EOverflow, "payload larger than the advertised maximum")
		return req, errors.New("a request payload larger than the advertised maximum")
	}
	return req, nil
}

// queued says whether a request waits: in the reader's buffer or on the
// socket.
func (c *conn) queued(r *bufio.Reader) bool { return r.Buffered() != 0 || c.sock.Pending() }

// inlineResult is what a try in the reader came to.
type inlineResult uint8

const (
	answered  inlineResult = iota // replied
	wouldWait                     // nothing done
	missed                        // nothing done, after a read tried the host file
)

// tryReadInline answers a read the image serves without waiting right
// here in the reader, from its buffer, while the miss tracker says tries pay.
func (c *conn) tryReadInline(req request) inlineResult {
	if req.length == 0 || req.length > uint64(cap(c.scratch)) || !c.hand.Reads.ShouldTry() {
		return wouldWait
	}
	off, n := int64(req.off), int64(req.length)
	if req.off >= 1<<63 || off+n > c.img.Size() {
		return wouldWait // the slow path reports the error
	}
	buf := c.scratch[:n]
	ok := c.img.TryReadAt(buf, off)
	c.hand.Reads.Note(ok)
	if !ok {
		return missed
	}
	c.dataReply(req, buf)
	return answered
}

// tryWriteInline runs a plain write (no FUA) the image can do without
// waiting right here in the reader; false means nothing was written.
func (c *conn) tryWriteInline(req request, payload []byte) bool {
	off := int64(req.off)
	if !c.writable || req.flags&^wire.CmdFlagPayloadLen != 0 || len(payload) == 0 || req.off >= 1<<63 || off+int64(len(payload)) > c.img.Size() {
		return false
	}
	done, err := c.img.TryWriteAt(payload, off)
	if !done {
		return false
	}
	if err != nil {
		c.errorReply(req, errnoOf(err), err.Error())
		return true
	}
	c.done(req)
	return true
}

func (c *conn) cork() {
	c.wmu.Lock()
	c.corked = true
	c.wmu.Unlock()
}

// uncork sends every reply collected while corked.
func (c *conn) uncork() {
	c.wmu.Lock()
	c.corked = false
	if err := c.bw.Flush(); err != nil {
		c.replyFailed(err)
	}
	c.wmu.Unlock()
}

// replyFailed handles a reply that could not be sent: the client is gone,
// so the connection stops reading and drops its queued requests.
func (c *conn) replyFailed(err error) {
	c.log.Debug("NBD reply not sent; dropping the connection", "err", err)
	c.cancel()
	c.raw.CloseRead()
}

// handle runs one request and sends its reply.
func (c *conn) handle(ctx context.Context, req request, payload []byte) {
	if ctx.Err() != nil {
		return // the client is gone: nobody to answer
	}
	img := c.img
	off, n := int64(req.off), int64(req.length)
	size := img.Size()
	inRange := req.off < 1<<63 && req.length < 1<<63 && off <= size && n <= size-off
	switch req.typ {
	case wire.CmdWrite, wire.CmdTrim, wire.CmdWriteZeroes:
		if !c.writable {
			c.errorReply(req, wire.EPerm, "the export is read-only")
			return
		}
	}
	switch {
	case req.typ == wire.CmdFlush || req.typ == wire.CmdDisc || req.typ > wire.CmdBlockStatus: // no range; an unknown command fails below
	case req.length > maxRequest && (req.typ == wire.CmdRead || req.typ == wire.CmdWrite || req.typ == wire.CmdCache):
		c.errorReply(req, wire.EOverflow, "request larger than the advertised maximum")
		return
	case !inRange && (req.typ == wire.CmdWrite || req.typ == wire.CmdWriteZeroes):
		c.errorReply(req, wire.ENoSpc, "request beyond the end of the export")
		return
	case !inRange:
		c.errorReply(req, wire.EInval, "request beyond the end of the export")
		return
	}
	var err error
	switch req.typ {
	case wire.CmdRead:
		buf, bp := c.srv.bufs.Buffer(int(n))
		defer c.srv.bufs.Release(bp) // the reply is written before handle returns
		if _, err = img.ReadAt(ctx, buf, off); err == nil {
			c.dataReply(req, buf)
			return
		}
	case wire.CmdWrite:
		if _, err = img.WriteAt(ctx, payload, off); err == nil && req.flags&wire.CmdFlagFUA != 0 {
			err = img.Flush(ctx)
		}
	case wire.CmdFlush:
		err = img.Flush(ctx)
	case wire.CmdTrim:
		if err = img.Discard(ctx, off, n); err == nil && req.flags&wire.CmdFlagFUA != 0 {
			err = img.Flush(ctx)
		}
	case wire.CmdWriteZeroes:
		if req.flags&wire.CmdFlagFastZero != 0 && !img.Features().FastZero { // FAST_ZERO: fail rather than be slow
			c.errorReply(req, wire.ENotSup, "zeroing would be slow")
			return
		}
		if err = img.WriteZeroes(ctx, off, n, req.flags&wire.CmdFlagNoHole == 0); err == nil && req.flags&wire.CmdFlagFUA != 0 {
			err = img.Flush(ctx)
		}
	case wire.CmdCache:
		// A hint: read through once so the data is in the host cache.
		err = c.cache(ctx, off, n)
	case wire.CmdBlockStatus:
		if !c.neg.structured || !c.neg.meta.any() {
			c.errorReply(req, wire.EInval, "block status needs structured replies and a meta context")
			return
		}
		c.blockStatus(req, off, n)
		return
	default:
		c.errorReply(req, wire.EInval, "unknown command")
		return
	}
	if err != nil {
		c.log.Debug("NBD request failed", "type", req.typ, "off", off, "len", n, "err", err)
		c.errorReply(req, errnoOf(err), err.Error())
		return
	}
	c.done(req)
}

func (c *conn) cache(ctx context.Context, off, n int64) error {
	buf, bp := c.srv.bufs.Buffer(int(min(n, 1<<20)))
	defer c.srv.bufs.Release(bp)
	for n > 0 {
		k := min(n, int64(len(buf)))
		if _, err := c.img.ReadAt(ctx, buf[:k], off); err != nil {
			return err
		}
		off += k
		n -= k
	}
	return nil
}

// blockStatus answers BLOCK_STATUS with one chunk per selected meta
// context, as qemu-nbd does (DONE on the last): 32-bit descriptors, or
// under extended headers 64-bit ones (BLOCK_STATUS_EXT), which also let
// one extent run past 4 GiB.
func (c *conn) blockStatus(req request, off, n int64) {
	sel := c.neg.meta
	type source struct {
		id     uint32
		extent func(ctx context.Context, off, n int64) (int64, uint32, error)
	}
	var sources []source
	if sel.base {
		sources = append(sources, source{baseAllocID, c.allocation})
	}
	for i, on := range sel.extra {
		if on && i < len(c.meta) {
			sources = append(sources, source{firstMetaID + uint32(i), c.meta[i].Extent})
		}
	}
	if len(sources) == 0 {
		c.errorReply(req, wire.EInval, "no meta context of this export was negotiated")
		return
	}
	payloads := make([][]byte, len(sources))
	for i, s := range sources {
		p, err := c.extents(req, off, n, s.id, s.extent)
		if err != nil {
			c.errorReply(req, errnoOf(err), err.Error())
			return
		}
		payloads[i] = p
	}
	typ := wire.ChunkBlockStatus
	if c.neg.extended {
		typ = wire.ChunkBlockStatusExt
	}
	for i, p := range payloads {
		var flags uint16
		if i == len(payloads)-1 {
			flags = wire.ChunkFlagDone
		}
		c.chunk(req, flags, typ, nil, p)
	}
}

// allocation is base:allocation's status of the run at off.
func (c *conn) allocation(ctx context.Context, off, n int64) (int64, uint32, error) {
	e, err := c.img.Extent(ctx, off, n)
	if err != nil {
		return 0, 0, err
	}
	var flags uint32
	if !e.Data {
		flags |= wire.StateHole
	}
	if e.Zero {
		flags |= wire.StateZero
	}
	return e.Length, flags, nil
}

// extents is one context's block status payload for [off, off+n): at
// most 1024 descriptors, one with REQ_ONE.
func (c *conn) extents(req request, off, n int64, id uint32, extent func(context.Context, int64, int64) (int64, uint32, error)) ([]byte, error) {
	ctx := c.ctx
	ext := c.neg.extended
	payload := be.AppendUint32(nil, id)
	maxLen := int64(1 << 31) // a compact descriptor's length is 32 bits
	if ext {
		payload = be.AppendUint32(payload, 0) // the count, filled in below
		maxLen = 1<<63 - 1
	}
	end := off + n
	count := 0
	var lastLen int64
	var lastFlags uint32
	// calls bounds the work of one request: merged runs add no
	// descriptor, and a crafted image may answer in small pieces.
	for calls := 0; off < end && count < 1024 && calls < 1<<16; calls++ {
		length, flags, err := extent(ctx, off, end-off)
		if err != nil {
			return nil, err
		}
		if length <= 0 {
			return nil, fmt.Errorf("nbd: meta context %d: empty extent at %d", id, off)
		}
		length = min(length, end-off, maxLen&^(minBlock-1))
		off += length
		// Merge a run like the last, as qemu-nbd does (nbd_extent_array_add).
		if count > 0 && req.flags&wire.CmdFlagReqOne == 0 && flags == lastFlags && lastLen+length <= maxLen {
			lastLen += length
			if ext {
				be.PutUint64(payload[len(payload)-16:], uint64(lastLen))
			} else {
				be.PutUint32(payload[len(payload)-8:], uint32(lastLen))
			}
			continue
		}
		lastLen, lastFlags = length, flags
		if ext {
			payload = be.AppendUint64(payload, uint64(length))
			payload = be.AppendUint64(payload, uint64(flags))
		} else {
			payload = be.AppendUint32(payload, uint32(length))
			payload = be.AppendUint32(payload, flags)
		}
		count++
		if req.flags&wire.CmdFlagReqOne != 0 {
			break
		}
	}
	if ext {
		be.PutUint32(payload[4:], uint32(count))
	}
	return payload, nil
}

// errnoOf maps an image error to an NBD error code.
func errnoOf(err error) uint32 {
	var en syscall.Errno
	switch {
	case errors.Is(err, formats.ErrReadOnly):
		return wire.EPerm
	case errors.Is(err, formats.ErrOutOfRange):
		return wire.EInval
	case errors.Is(err, formats.ErrNotSupported):
		return wire.ENotSup
	case errors.As(err, &en):
		switch en {
		case syscall.EPERM, syscall.EACCES, syscall.EROFS:
			return wire.EPerm
		case syscall.ENOSPC, syscall.EDQUOT, syscall.EFBIG:
			return wire.ENoSpc
		case syscall.ENOMEM:
			return wire.ENoMem
		case syscall.EINVAL:
			return wire.EInval
		case syscall.EOPNOTSUPP:
			return wire.ENotSup
		case syscall.ESHUTDOWN:
			return wire.EShutdown
		}
	}
	return wire.EIO
}

// done answers a command that succeeded and returns no data, with a simple
// reply even under structured replies, as QEMU does: the spec allows it,
// and it costs a client one receive where a chunk costs two.
func (c *conn) done(req request) {
	if c.neg.extended {
		// Extended headers have no simple reply: a final NONE chunk.
		c.chunk(req, wire.ChunkFlagDone, wire.ChunkNone, nil, nil)
		return
	}
	c.simpleReply(req.cookie, 0, nil)
}

// dataReply answers a read. With structured replies a run of zeroes goes
// as an OFFSET_HOLE chunk, without payload; QEMU finds such runs with block
// status, we in the data (a memory compare, no metadata lookup, and any
// format's zeroes). DF asks for one chunk: then the data goes whole.
func (c *conn) dataReply(req request, data []byte) {
	if !c.neg.structured {
		c.simpleReply(req.cookie, 0, data)
		return
	}
	if len(data) == 0 {
		// A read of nothing: one final chunk without content.
		c.chunk(req, wire.ChunkFlagDone, wire.ChunkNone, nil, nil)
		return
	}
	off := req.off
	sparse := req.flags&wire.CmdFlagDF == 0
	for {
		n, zero := len(data), false
		if sparse {
			n, zero = zeroRun(data)
		}
		var flags uint16
		if n == len(data) {
			flags = wire.ChunkFlagDone
		}
		var h [12]byte
		be.PutUint64(h[:], off)
		if zero {
			be.PutUint32(h[8:], uint32(n))
			c.chunk(req, flags, wire.ChunkOffsetHole, h[:], nil)
		} else {
			c.chunk(req, flags, wire.ChunkOffsetData, h[:8], data[:n])
		}
		if flags != 0 {
			return
		}
		data, off = data[n:], off+uint64(n)
	}
}

// holeGrain is the unit zeroRun looks at: a smaller run of zeroes inside
// data is not worth a chunk of its own.
const holeGrain = 4096

var zeroGrain [holeGrain]byte

// zeroRun measures the run at the start of p: n bytes, all zero or not.
// Runs end on holeGrain boundaries of p, except at p's end.
func zeroRun(p []byte) (n int, zero bool) {
	for n < len(p) {
		k := min(len(p)-n, holeGrain)
		z := bytes.Equal(p[n:n+k], zeroGrain[:k])
		if n > 0 && z != zero {
			break
		}
		n, zero = n+k, z
	}
	return n, zero
}

func (c *conn) errorReply(req request, code uint32, msg string) {
	if c.neg.structured {
		msg = msg[:min(len(msg), 4096)]
		p := be.AppendUint32(nil, code)
		p = be.AppendUint16(p, uint16(len(msg)))
		c.chunk(req, wire.ChunkFlagDone, wire.ChunkError, nil, append(p, msg...))
		return
	}
	c.simpleReply(req.cookie, code, nil)
}

func (c *conn) simpleReply(handle uint64, code uint32, data []byte) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	b := c.hdr[:wire.SimpleReplySize]
	be.PutUint32(b[0:], wire.MagicSimple)
	be.PutUint32(b[4:], code)
	be.PutUint64(b[8:], handle)
	c.send(b, data)
}

// chunk sends a structured reply chunk whose payload is a (fields, at most
// 12 bytes) then b, under a compact or an extended header.
func (c *conn) chunk(req request, flags, typ uint16, a, b []byte) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	var h []byte
	if c.neg.extended {
		h = c.hdr[:wire.ExtendedReplySize+len(a)]
		be.PutUint32(h[0:], wire.MagicExtendedReply)
		be.PutUint64(h[16:], req.off)
		be.PutUint64(h[24:], uint64(len(a)+len(b)))
	} else {
		h = c.hdr[:wire.StructuredReplySize+len(a)]
		be.PutUint32(h[0:], wire.MagicStructured)
		be.PutUint32(h[16:], uint32(len(a)+len(b)))
	}
	be.PutUint16(h[4:], flags)
	be.PutUint16(h[6:], typ)
	be.PutUint64(h[8:], req.cookie)
	copy(h[len(h)-len(a):], a)
	c.send(h, b)
}

// send queues a reply (its header, then data) as one unit, and writes it
// out at once unless the reader is corked. c.wmu is held.
func (c *conn) send(hdr, data []byte) {
	c.bw.Write(hdr)
	c.bw.Write(data)
	if !c.corked {
		if err := c.bw.Flush(); err != nil {
			c.replyFailed(err)
		}
	}
}

// hungUp says whether the client has closed its end of the socket though
// the reader has not come to it yet (its last request, DISC, unread): a
// safe Remove right after a client left then does not find it in use,
// as QEMU's main loop, which reads the hang-up first, does not.
func (c *conn) hungUp() bool {
	h, ok := c.raw.(interface{ HungUp() bool })
	return ok && h.HungUp()
}
