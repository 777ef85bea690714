package nbd

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/pojntfx/go-nbd/pkg/protocol"

	"github.com/blockexport/blockexport/aio/sock"
	"github.com/blockexport/blockexport/coroutines"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/nbd/wire"
)

// conn is one client connection.
type conn struct {
	srv  *Server
	sock sock.Stream // the client's stream: through TLS after STARTTLS
	// raw is the socket's own stream, for waking the reader from other
	// goroutines (sock changes under the reader at STARTTLS).
	raw sock.Stream
	log *slog.Logger

	wmu sync.Mutex // one reply at a time on the wire
	// hdr holds the reply header being sent (under wmu): built here, it
	// does not cost an allocation per reply.
	hdr [32]byte
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
	c := &conn{srv: s, sock: stream, raw: stream, log: log, stopping: make(chan struct{}),
		budget: coroutines.NewBudget(s.opts.ConnBytes)}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	c.hand = coroutines.NewHandoff(c.ctx)
	return c
}

// requestCost is what a request counts against the budgets while it is
// in flight: its buffer, and at least minRequestCost, since a request
// without data still holds a goroutine.
func requestCost(req protocol.TransmissionRequestHeader) int64 {
	n := int64(0)
	switch req.Type {
	case wire.CmdRead, wire.CmdWrite:
		n = int64(req.Length)
	case wire.CmdCache:
		n = int64(min(req.Length, 1<<20))
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

// stop makes the connection finish what it has read and close.
func (c *conn) stop() {
	c.stopOnce.Do(func() {
		close(c.stopping)
		// Wake the reader: it then waits for the requests in flight.
		c.raw.CloseRead()
	})
}

func (c *conn) serve() {
	defer func() { c.sock.Close() }() // the TLS stream, once there is one
	defer c.cancel()
	r := bufio.NewReaderSize(c.sock, 256<<10)
	c.bw = bufio.NewWriterSize(c.sock, 256<<10)
	c.scratch = coroutines.AlignedBuf(1<<20, 4096)
	var limit *time.Timer
	if d := c.srv.opts.HandshakeLimit; d > 0 {
		// A client that never finishes the handshake would hold its
		// --max-clients slot forever.
		limit = time.AfterFunc(d, func() {
			c.log.Warn("dropping an NBD client that did not finish the handshake in time", "limit", d)
			c.raw.CloseRead()
		})
	}
	neg, r, err := c.handshake(r)
	if limit != nil && !limit.Stop() {
		err = cmp.Or(err, errors.New("handshake limit passed"))
	}
	if err != nil {
		if !errors.Is(err, errAbort) && !errors.Is(err, io.EOF) {
			c.log.Warn("NBD negotiation failed", "err", err)
		}
		return
	}
	c.neg = neg
	c.bw.Reset(c.sock) // after STARTTLS: through TLS
	c.log.Debug("NBD client connected", "structured", neg.structured, "base:allocation", neg.metaAlloc)
	err = c.transmit(r)
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
	var hb [28]byte
	var yield coroutines.Yielder // see there
	for {
		yield.Tick()
		if r.Buffered() < len(hb) {
			c.uncork() // about to wait on the socket: send what is ready
		}
		if err := readFull(r, hb[:]); err != nil {
			select {
			case <-c.stopping:
				return nil
			default:
			}
			return err
		}
		c.cork()
		req := protocol.TransmissionRequestHeader{
			RequestMagic: be.Uint32(hb[0:]), CommandFlags: be.Uint16(hb[4:]), Type: be.Uint16(hb[6:]),
			Handle: be.Uint64(hb[8:]), Offset: be.Uint64(hb[16:]), Length: be.Uint32(hb[24:]),
		}
		if req.RequestMagic != wire.MagicRequest {
			c.uncork()
			return errors.New("bad request magic: the stream is out of step")
		}
		var payload []byte
		cost := int64(0) // taken from the budgets, once the request must wait
		if req.Type == wire.CmdWrite {
			if req.Length > maxRequest {
				// Too big to take: the payload cannot be skipped safely.
				c.simpleReply(req.Handle, wire.EOverflow, nil)
				c.uncork()
				return errors.New("write larger than the advertised maximum")
			}
			// A write that fits the reader's buffer is read there and
			// tried in place; one that cannot be done at once moves to
			// a buffer of its own (the reader's is reused).
			fits := int(req.Length) <= cap(c.scratch)
			if fits {
				payload = c.scratch[:req.Length]
			} else {
				if cost = requestCost(req); c.acquire(cost) != nil {
					return c.ctx.Err()
				}
				// Page-aligned, so that an O_DIRECT image writes it as
				// it is, without a bounce copy.
				payload = coroutines.AlignedBuf(int(req.Length), 4096)
			}
			if err := readFull(r, payload); err != nil {
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
				p := coroutines.AlignedBuf(len(payload), 4096)
				copy(p, payload)
				payload = p
			}
		}
		if req.Type == wire.CmdDisc {
			c.uncork()
			c.hand.Wait()
			if c.srv.opts.Writable {
				c.srv.img.Flush(context.Background())
			}
			return nil
		}
		path := coroutines.Fresh
		if req.Type == wire.CmdRead {
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
		if (req.Type == wire.CmdRead || req.Type == wire.CmdWrite) && c.hand.Lone(func() bool { return c.queued(r) }) {
			c.handle(c.hand.Context(coroutines.InLoop), req, payload)
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

// queued says whether a request waits: in the reader's buffer or on the
// socket.
func (c *conn) queued(r *bufio.Reader) bool {
	if r.Buffered() != 0 {
		return true
	}
	return c.sock.Pending()
}

// inlineResult is what a try in the reader came to.
type inlineResult uint8

const (
	answered  inlineResult = iota // replied
	wouldWait                     // nothing done
	missed                        // nothing done, after a read tried the host file
)

// tryReadInline answers a read the image can serve without waiting (page
// cache, null device) right here in the reader, from its own buffer, while
// the miss tracker says tries pay.
func (c *conn) tryReadInline(req protocol.TransmissionRequestHeader) inlineResult {
	if req.Length == 0 || int(req.Length) > cap(c.scratch) || !c.hand.Reads.ShouldTry() {
		return wouldWait
	}
	off, n := int64(req.Offset), int64(req.Length)
	if req.Offset >= 1<<63 || off+n > c.srv.img.Size() {
		return wouldWait // the slow path reports the error
	}
	buf := c.scratch[:n]
	ok := c.srv.img.TryReadAt(buf, off)
	c.hand.Reads.Note(ok)
	if !ok {
		return missed
	}
	c.dataReply(req, buf)
	return answered
}

// tryWriteInline runs a plain write (no FUA) the image can do without
// waiting right here in the reader; false means nothing was written.
func (c *conn) tryWriteInline(req protocol.TransmissionRequestHeader, payload []byte) bool {
	off := int64(req.Offset)
	if !c.srv.opts.Writable || req.CommandFlags != 0 || len(payload) == 0 || req.Offset >= 1<<63 || off+int64(len(payload)) > c.srv.img.Size() {
		return false
	}
	done, err := c.srv.img.TryWriteAt(payload, off)
	if !done {
		return false
	}
	if err != nil {
		c.errorReply(req, errnoOf(err), err.Error())
		return true
	}
	c.simpleReply(req.Handle, 0, nil)
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
func (c *conn) handle(ctx context.Context, req protocol.TransmissionRequestHeader, payload []byte) {
	if ctx.Err() != nil {
		return // the client is gone: nobody to answer
	}
	img := c.srv.img
	off, n := int64(req.Offset), int64(req.Length)
	size := img.Size()
	inRange := off >= 0 && n >= 0 && off <= size && n <= size-off && req.Offset < 1<<63
	writeLike := req.Type == wire.CmdWrite || req.Type == wire.CmdTrim || req.Type == wire.CmdWriteZeroes
	switch {
	case writeLike && !c.srv.opts.Writable:
		c.errorReply(req, wire.EPerm, "the export is read-only")
		return
	case req.Type == wire.CmdRead || req.Type == wire.CmdWrite || req.Type == wire.CmdTrim || req.Type == wire.CmdWriteZeroes || req.Type == wire.CmdCache || req.Type == wire.CmdBlockStatus:
		if req.Length > maxRequest && req.Type != wire.CmdTrim && req.Type != wire.CmdWriteZeroes && req.Type != wire.CmdBlockStatus {
			c.errorReply(req, wire.EOverflow, "request larger than the advertised maximum")
			return
		}
		if !inRange {
			code := wire.EInval
			if req.Type == wire.CmdWrite || req.Type == wire.CmdWriteZeroes {
				code = wire.ENoSpc
			}
			c.errorReply(req, code, "request beyond the end of the export")
			return
		}
	}
	var err error
	switch req.Type {
	case wire.CmdRead:
		buf, bp := c.srv.bufs.Buffer(int(n))
		defer c.srv.bufs.Release(bp) // the reply is written before handle returns
		if _, err = img.ReadAt(ctx, buf, off); err == nil {
			c.dataReply(req, buf)
			return
		}
	case wire.CmdWrite:
		if _, err = img.WriteAt(ctx, payload, off); err == nil && req.CommandFlags&wire.CmdFlagFUA != 0 {
			err = img.Flush(ctx)
		}
	case wire.CmdFlush:
		err = img.Flush(ctx)
	case wire.CmdTrim:
		if err = img.Discard(ctx, off, n); err == nil && req.CommandFlags&wire.CmdFlagFUA != 0 {
			err = img.Flush(ctx)
		}
	case wire.CmdWriteZeroes:
		if req.CommandFlags&wire.CmdFlagFastZero != 0 && !fastZero(img) {
			c.errorReply(req, wire.ENotSup, "zeroing would be slow")
			return
		}
		if err = img.WriteZeroes(ctx, off, n, req.CommandFlags&wire.CmdFlagNoHole == 0); err == nil && req.CommandFlags&wire.CmdFlagFUA != 0 {
			err = img.Flush(ctx)
		}
	case wire.CmdCache:
		// A hint: read through once so the data is in the host cache.
		err = c.cache(ctx, off, n)
	case wire.CmdBlockStatus:
		if !c.neg.structured || !c.neg.metaAlloc {
			c.errorReply(req, wire.EInval, "block status needs structured replies and base:allocation")
			return
		}
		c.blockStatus(req, off, n)
		return
	default:
		c.errorReply(req, wire.EInval, "unknown command")
		return
	}
	if err != nil {
		c.log.Debug("NBD request failed", "type", req.Type, "off", off, "len", n, "err", err)
		c.errorReply(req, errnoOf(err), err.Error())
		return
	}
	c.done(req)
}

// fastZero says whether the image zeroes without writing data (NBD's
// FAST_ZERO asks to fail rather than be slow).
func fastZero(img formats.Image) bool { return img.Features().FastZero }

func (c *conn) cache(ctx context.Context, off, n int64) error {
	buf, bp := c.srv.bufs.Buffer(int(min(n, 1<<20)))
	defer c.srv.bufs.Release(bp)
	for n > 0 {
		k := min(n, int64(len(buf)))
		if _, err := c.srv.img.ReadAt(ctx, buf[:k], off); err != nil {
			return err
		}
		off += k
		n -= k
	}
	return nil
}

// blockStatus sends base:allocation extents for [off, off+n).
func (c *conn) blockStatus(req protocol.TransmissionRequestHeader, off, n int64) {
	ctx := c.ctx
	payload := be.AppendUint32(nil, baseAllocID)
	end := off + n
	for count := 0; off < end && count < 1024; count++ {
		e, err := c.srv.img.Extent(ctx, off, end-off)
		if err != nil {
			c.errorReply(req, errnoOf(err), err.Error())
			return
		}
		length := min(e.Length, 1<<31) // a descriptor length is 32 bits
		var flags uint32
		if !e.Data {
			flags |= wire.StateHole
		}
		if e.Zero {
			flags |= wire.StateZero
		}
		payload = be.AppendUint32(payload, uint32(length))
		payload = be.AppendUint32(payload, flags)
		off += length
		if req.CommandFlags&wire.CmdFlagReqOne != 0 {
			break
		}
	}
	c.chunk(req.Handle, wire.ChunkFlagDone, wire.ChunkBlockStatus, payload)
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

// done answers a command that succeeded and returns no data. That is a
// simple reply even when structured replies are on: the spec requires
// structured replies only for reads (and block status), and the 16-byte
// simple reply costs a client one receive where a chunk costs two. QEMU
// answers the same way.
func (c *conn) done(req protocol.TransmissionRequestHeader) {
	c.simpleReply(req.Handle, 0, nil)
}

// dataReply answers a read with what it found. With structured replies, a
// run of zeroes goes as an OFFSET_HOLE chunk, which carries no payload: the
// client fills zeroes itself and the bytes never cross the socket. QEMU
// finds such runs with block status; we find them in the data, which costs
// a memory compare instead of a metadata lookup or lseek and catches zeroes
// any format returns. DF asks for one chunk, so then the data goes whole.
func (c *conn) dataReply(req protocol.TransmissionRequestHeader, data []byte) {
	if !c.neg.structured {
		c.simpleReply(req.Handle, 0, data)
		return
	}
	if len(data) == 0 {
		// A read of nothing: one final chunk without content.
		c.chunk(req.Handle, wire.ChunkFlagDone, 0, nil) // NBD_REPLY_TYPE_NONE
		return
	}
	off := req.Offset
	sparse := req.CommandFlags&wire.CmdFlagDF == 0
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
			c.chunk3(req.Handle, flags, wire.ChunkOffsetHole, h[:], nil)
		} else {
			c.chunk3(req.Handle, flags, wire.ChunkOffsetData, h[:8], data[:n])
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

func (c *conn) errorReply(req protocol.TransmissionRequestHeader, code uint32, msg string) {
	if c.neg.structured {
		if len(msg) > 4096 {
			msg = msg[:4096]
		}
		p := be.AppendUint32(nil, code)
		p = be.AppendUint16(p, uint16(len(msg)))
		c.chunk(req.Handle, wire.ChunkFlagDone, wire.ChunkError, append(p, msg...))
		return
	}
	c.simpleReply(req.Handle, code, nil)
}

func (c *conn) simpleReply(handle uint64, code uint32, data []byte) {
	h := protocol.TransmissionReplyHeader{ReplyMagic: wire.MagicSimple, Error: code, Handle: handle}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	b := c.hdr[:16]
	be.PutUint32(b[0:], h.ReplyMagic)
	be.PutUint32(b[4:], h.Error)
	be.PutUint64(b[8:], h.Handle)
	c.send(b, data)
}

func (c *conn) chunk(handle uint64, flags, typ uint16, payload []byte) {
	c.chunk3(handle, flags, typ, nil, payload)
}

// chunk3 sends a structured reply chunk whose payload is a (a few bytes of
// fields, at most 12) then b.
func (c *conn) chunk3(handle uint64, flags, typ uint16, a, b []byte) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	h := c.hdr[:20+len(a)]
	be.PutUint32(h[0:], wire.MagicStructured)
	be.PutUint16(h[4:], flags)
	be.PutUint16(h[6:], typ)
	be.PutUint64(h[8:], handle)
	be.PutUint32(h[16:], uint32(len(a)+len(b)))
	copy(h[20:], a)
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
