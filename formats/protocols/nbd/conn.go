package nbd

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/blockexport/blockexport/aio/sock"
	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
	"golang.org/x/sys/unix"
)

var be = binary.BigEndian

// errLost marks a request whose connection broke before its reply: it
// may be sent again on a new connection.
var errLost = errors.New("nbd: connection lost")

// errProtocol marks a reply that breaks the protocol: the connection is
// dropped and its requests fail, never retried (a server that sends
// garbage once will again).
var errProtocol = errors.New("nbd: protocol error")

// conn is one transmission-phase connection: requests are written under
// wmu with cookies of their own, any number in flight, answered in any
// order. There is no reader goroutine: a waiting request reads replies,
// for whoever they are, until its own has come (one reader at a time,
// under rmu), then hands reading on, so that at queue depth one the reply
// lands in the goroutine that waits for it. A serve loop may take the
// reading over (formats.Completions) so that one thread does it all, as
// QEMU's event loop does; a lone request (run by the loop itself) still
// reads its own.
type conn struct {
	s    sock.Stream
	r    *bufio.Reader
	info exportInfo
	wmu  sync.Mutex
	// wbufs gathers a request and its payload for one sendmsg (under
	// wmu); scratch holds the fixed parts of a reply (the reader's
	// alone): per-request allocations otherwise.
	wbufs   [2][]byte
	scratch [wire.ExtendedReplySize]byte
	readied bool // the reader answered a request since it last yielded

	rmu  sync.Mutex    // held by the goroutine reading replies
	turn chan struct{} // a token: nobody reads while requests wait

	// reader says who reads replies: the requests waiting for them
	// (selfRead), or a serve loop (loopReads: formats.Completions) until
	// it lets go (loopGone, then closed).
	reader   atomic.Int32
	loopGone chan struct{}

	mu     sync.Mutex
	calls  map[uint64]*call
	cookie uint64
	err    error         // why the connection ended; set once
	dead   chan struct{} // closed when err is set
	// writers counts the goroutines writing to the stream (under mu).
	// The stream is closed only once the connection is dead and none is
	// left: a writer never writes into a closed descriptor, or into
	// another connection that reused its number. fail shuts the socket
	// down instead, which wakes a writer blocked in it.
	writers int
	closed  bool // the stream is closed (under mu)
}

// call is one request in flight.
type call struct {
	hdr  [wire.ExtendedRequestSize]byte // the request as sent: no allocation of its own
	cmd  uint16
	off  int64
	buf  []byte // READ: where the data goes
	done chan struct{}
	err  error
	// BLOCK_STATUS: the first extent's length and flags.
	extLen   uint64
	extFlags uint32
	gotExt   bool
	// lone: the request runs in a serve loop, which cannot read its
	// reply for it (coroutines.Lone).
	lone bool
	// READ: the parts of buf the reply's chunks covered, disjoint and
	// sorted (seenBuf holds the first few: no allocation for a reply in
	// a few chunks), and how many bytes they hold. A successful READ must
	// have covered all of buf, or the caller would get stale bytes.
	seen    []span
	seenBuf [2]span
	covered uint64
}

// span is [start, end) of a READ's buffer.
type span struct{ start, end uint64 }

// maxSpans bounds how fragmented a READ's reply may be (chunks that are
// neither in order nor adjacent): a server that scatters a reply in more
// pieces breaks it, and the bound keeps the bookkeeping linear.
const maxSpans = 1024

// cover records that a chunk filled [start, start+n) of cl.buf (both
// within it). Chunks of one reply must not overlap (the spec; libnbd
// counts bytes the same way): with disjoint chunks, covering len(buf)
// bytes is covering all of it.
func (cl *call) cover(start, n uint64) error {
	end := start + n
	if cl.seen == nil {
		cl.seen = cl.seenBuf[:0]
	}
	s := cl.seen
	// The first span that ends after start; spans before it end at or
	// before start.
	i, _ := slices.BinarySearchFunc(s, start, func(sp span, v uint64) int {
		if sp.end <= v {
			return -1
		}
		return 1
	})
	if i < len(s) && s[i].start < end {
		return fmt.Errorf("%w: READ chunks overlap at [%d, %d)", errProtocol, max(start, s[i].start), min(end, s[i].end))
	}
	joinPrev := i > 0 && s[i-1].end == start
	joinNext := i < len(s) && s[i].start == end
	switch {
	case joinPrev && joinNext:
		s[i-1].end = s[i].end
		s = slices.Delete(s, i, i+1)
	case joinPrev:
		s[i-1].end = end
	case joinNext:
		s[i].start = start
	default:
		if len(s) >= maxSpans {
			return fmt.Errorf("%w: a READ reply in more than %d scattered chunks", errProtocol, maxSpans)
		}
		s = slices.Insert(s, i, span{start, end})
	}
	cl.seen = s
	cl.covered += n
	return nil
}

// Who reads a connection's replies (conn.reader).
const (
	selfRead  = iota // the requests that wait for them
	loopReads        // a serve loop (see Image.CompletionFds)
	loopGone         // the loop has let go: the requests again
)

func newConn(s sock.Stream, info exportInfo) *conn {
	return &conn{s: s, r: bufio.NewReaderSize(s, 64<<10), info: info, calls: map[uint64]*call{},
		dead: make(chan struct{}), turn: make(chan struct{}, 1), loopGone: make(chan struct{})}
}

// fd is the connection's descriptor, for a loop to wait on; -1 when the
// stream has none (a pipe in tests).
func (c *conn) fd() int {
	if f, ok := c.s.(interface{ Fd() int }); ok {
		return f.Fd()
	}
	return -1
}

// attachLoop makes a serve loop the reader of replies (once: a connection
// is attached to one loop, and never again after it let go).
func (c *conn) attachLoop() bool {
	return c.reader.CompareAndSwap(selfRead, loopReads) || c.reader.Load() == loopReads
}

// releaseLoop gives reading back to the requests and wakes those waiting.
func (c *conn) releaseLoop() {
	if c.reader.CompareAndSwap(loopReads, loopGone) {
		close(c.loopGone)
	}
}

// serveReplies reads the replies that have come, without waiting for
// more (the loop's side of formats.Completions). A reply that has begun
// is read to its end. Nothing happens while someone else reads.
func (c *conn) serveReplies() {
	if !c.rmu.TryLock() {
		return
	}
	for c.alive() && (c.r.Buffered() > 0 || c.s.Pending()) {
		if !c.readOrFail() {
			break
		}
	}
	c.rmu.Unlock()
	// A request that found us reading after the loop let go waits for
	// the turn; while the loop reads, requests wait for it instead.
	if c.reader.Load() != loopReads {
		c.passTurn()
	}
}

// readOrFail reads one reply; one that cannot be read ends the connection
// (false). The caller holds rmu.
func (c *conn) readOrFail() bool {
	err := c.readReply()
	if err == nil {
		return true
	}
	if !errors.Is(err, errProtocol) {
		err = fmt.Errorf("%w: %v", errLost, err)
	}
	c.fail(err)
	return false
}

// alive says whether the connection still carries requests.
func (c *conn) alive() bool {
	select {
	case <-c.dead:
		return false
	default:
		return true
	}
}

// fail ends the connection: every request in flight gets err. Only the
// reader calls it (it alone writes to requests in flight, and reads stop
// with it: both under rmu); others shut the socket down and let the
// reader fail (close, when nothing is in flight). The stream is closed
// here only when nobody writes to it; else by the last writer (release).
func (c *conn) fail(err error) {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	c.err = err
	calls := c.calls
	c.calls = nil
	close(c.dead)
	closeNow := c.writers == 0
	c.closed = closeNow
	c.mu.Unlock()
	if closeNow {
		c.s.Close()
	} else {
		c.shutdown() // the writers' descriptor stays theirs until they let go
	}
	for _, cl := range calls {
		cl.err = err // a server's error for the request counts for less
		close(cl.done)
	}
}

// shutdown ends both directions of the socket, waking a reader and a
// writer blocked in it, and keeps the descriptor (the stream is open).
func (c *conn) shutdown() {
	if fd := c.fd(); fd >= 0 {
		unix.Shutdown(fd, unix.SHUT_RDWR)
		return
	}
	c.s.CloseRead()
}

// acquire makes the caller a writer of the stream, which stays open until
// it calls release; false when the connection has ended.
func (c *conn) acquire() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return false
	}
	c.writers++
	return true
}

// release ends a write; the last writer of a dead connection closes it.
func (c *conn) release() {
	c.mu.Lock()
	c.writers--
	closeNow := c.writers == 0 && c.err != nil && !c.closed
	if closeNow {
		c.closed = true
	}
	c.mu.Unlock()
	if closeNow {
		c.s.Close()
	}
}

// close says goodbye (NBD_CMD_DISC) and ends the connection. Nothing may
// be in flight.
func (c *conn) close() {
	if c.acquire() {
		var hdr [wire.ExtendedRequestSize]byte
		n := c.putRequest(hdr[:], 0, wire.CmdDisc, 0, 0, 0)
		c.wmu.Lock()
		c.s.Write(hdr[:n])
		c.wmu.Unlock()
		c.shutdown() // a reader still waiting wakes up and lets go
		c.release()
	}
	c.rmu.Lock()
	c.fail(net.ErrClosed)
	c.rmu.Unlock()
}

// do sends one request and waits for its reply. payload is a WRITE's
// data; cl.buf a READ's destination.
func (c *conn) do(cl *call, flags uint16, length uint64, payload []byte) error {
	cl.done = make(chan struct{})
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return errLost
	}
	c.cookie++
	cookie := c.cookie
	c.calls[cookie] = cl
	c.writers++ // the stream stays open until the request is written
	c.mu.Unlock()

	if len(payload) > 0 && c.info.extended {
		flags |= wire.CmdFlagPayloadLen
	}
	hdr := cl.hdr[:c.putRequest(cl.hdr[:], flags, cl.cmd, cookie, uint64(cl.off), length)]
	c.wmu.Lock()
	var err error
	if len(payload) > 0 {
		c.wbufs = [2][]byte{hdr, payload}
		err = c.s.WriteBuffers(c.wbufs[:])
		c.wbufs = [2][]byte{}
	} else {
		_, err = c.s.Write(hdr)
	}
	c.wmu.Unlock()
	if err != nil {
		c.shutdown() // the reader fails every request, this one too
	}
	c.release()
	c.wait(cl)
	return cl.err
}

// wait reads replies until cl's has come, or waits while another goroutine
// (or the serve loop) reads them. Whoever takes the turn (the token that
// says "nobody reads while requests wait") reads or passes it on, never
// drops it: the next waiter would wait for ever with nobody reading.
func (c *conn) wait(cl *call) {
	haveTurn := false
	defer func() {
		if haveTurn {
			c.passTurn()
		}
	}()
	for {
		select {
		case <-cl.done:
			return
		default:
		}
		if c.reader.Load() == loopReads && !cl.lone {
			// The loop reads (a lone request runs in the loop, which
			// is busy with it: that one reads itself).
			select {
			case <-cl.done:
				return
			case <-c.loopGone:
				continue
			}
		}
		if c.rmu.TryLock() {
			haveTurn = false // the turn is ours: we read, and pass it on after
			c.readUntil(cl)
			c.rmu.Unlock()
			c.passTurn()
			return
		}
		// Someone else reads. A turn we hold stays ours (we pass it on
		// when we return, or read with it): a turn more is harmless, one
		// fewer leaves waiters with nobody reading.
		select {
		case <-cl.done:
			return
		case <-c.turn:
			haveTurn = true
		}
	}
}

// passTurn hands reading on to the requests still waiting, if any: one
// of them takes the turn and reads.
func (c *conn) passTurn() {
	c.mu.Lock()
	waiting := len(c.calls) > 0
	c.mu.Unlock()
	if waiting {
		select {
		case c.turn <- struct{}{}:
		default: // a turn is there already
		}
	}
}

// readUntil reads replies until cl is answered or the connection ends.
func (c *conn) readUntil(cl *call) {
	c.readied = false // our own reply ends the loop: only others' count
	for {
		if !c.alive() {
			// fail may have closed the stream: what is buffered belongs
			// to requests that failed anyway.
			return
		}
		select {
		case <-cl.done:
			// Replies already read into the buffer are read out too
			// before the reader lets go: a serve loop that takes over
			// (even now, while this reads) waits on the socket, which
			// no longer shows them.
			if c.r.Buffered() == 0 {
				return
			}
		default:
		}
		if c.r.Buffered() == 0 && c.readied {
			// The next read may sleep: let the requests just answered,
			// queued on this thread, write their replies here first rather
			// than have the runtime wake another thread for them
			// (docs/design.md, NBD sources: replies written by the reader).
			c.readied = false
			runtime.Gosched()
			select {
			case <-cl.done:
				return
			default:
			}
		}
		if !c.readOrFail() {
			return
		}
	}
}

// putRequest encodes a request header into b, compact (a 32-bit length:
// callers cut their requests to fit) or extended as negotiated, and
// returns its size.
func (c *conn) putRequest(b []byte, flags, cmd uint16, cookie, off, length uint64) int {
	be.PutUint16(b[4:], flags)
	be.PutUint16(b[6:], cmd)
	be.PutUint64(b[8:], cookie)
	be.PutUint64(b[16:], off)
	if c.info.extended {
		be.PutUint32(b[0:], wire.MagicExtendedRequest)
		be.PutUint64(b[24:], length)
		return wire.ExtendedRequestSize
	}
	be.PutUint32(b[0:], wire.MagicRequest)
	be.PutUint32(b[24:], uint32(length))
	return wire.RequestSize
}

// lookup finds the request a reply names. It stays in flight (and fail
// answers it, should the connection break in the middle of its reply)
// until finish.
func (c *conn) lookup(cookie uint64) (*call, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	cl := c.calls[cookie]
	if cl == nil {
		return nil, fmt.Errorf("%w: reply for cookie %d, which no request has", errProtocol, cookie)
	}
	return cl, nil
}

// finish answers the request with cookie, unless fail has.
func (c *conn) finish(cookie uint64, cl *call) {
	c.mu.Lock()
	if c.calls[cookie] != cl {
		c.mu.Unlock()
		return
	}
	delete(c.calls, cookie)
	c.mu.Unlock()
	c.readied = true
	close(cl.done)
}

func (c *conn) readReply() error {
	m, err := c.readFixed(4)
	if err != nil {
		return err
	}
	switch magic := be.Uint32(m); {
	case c.info.extended && magic == wire.MagicExtendedReply:
		return c.chunkReply()
	case c.info.extended:
		return fmt.Errorf("%w: reply magic %#x under extended headers", errProtocol, magic)
	case magic == wire.MagicSimple:
		return c.simpleReply()
	case magic == wire.MagicStructured:
		if !c.info.structured {
			return fmt.Errorf("%w: structured reply without structured replies negotiated", errProtocol)
		}
		return c.chunkReply()
	default:
		return fmt.Errorf("%w: bad reply magic %#x", errProtocol, magic)
	}
}

func (c *conn) simpleReply() error {
	h, err := c.readFixed(wire.SimpleReplySize - 4)
	if err != nil {
		return err
	}
	code, cookie := be.Uint32(h[0:]), be.Uint64(h[4:])
	cl, err := c.lookup(cookie)
	if err != nil {
		return err
	}
	if code == 0 && cl.cmd == wire.CmdRead {
		if c.info.structured {
			return fmt.Errorf("%w: a simple reply to a READ after structured replies were negotiated", errProtocol)
		}
		if _, err := io.ReadFull(c.r, cl.buf); err != nil {
			return err
		}
	}
	if code != 0 {
		cl.err = serverError(code, "")
	}
	c.finish(cookie, cl)
	return nil
}

// chunkReply reads one structured reply chunk: with the 20-byte header,
// or under extended headers the 32-byte one, which also names the
// request's offset and has a 64-bit length.
func (c *conn) chunkReply() error {
	size := wire.StructuredReplySize
	if c.info.extended {
		size = wire.ExtendedReplySize
	}
	h, err := c.readFixed(size - 4)
	if err != nil {
		return err
	}
	flags, typ, cookie := be.Uint16(h[0:]), be.Uint16(h[2:]), be.Uint64(h[4:])
	cl, err := c.lookup(cookie)
	if err != nil {
		return err
	}
	length := uint64(be.Uint32(h[12:]))
	if c.info.extended {
		if off := be.Uint64(h[12:]); off != uint64(cl.off) {
			return fmt.Errorf("%w: reply for offset %d to a request at %d", errProtocol, off, cl.off)
		}
		// Payloads are bounded by the block sizes, which are 32 bits.
		if length = be.Uint64(h[20:]); length > 1<<32-1 {
			return fmt.Errorf("%w: a reply chunk of %d bytes", errProtocol, length)
		}
	}
	if err := c.chunk(cl, typ, uint32(length)); err != nil {
		return err
	}
	if flags&wire.ChunkFlagDone != 0 {
		if cl.cmd == wire.CmdRead && cl.err == nil && cl.covered != uint64(len(cl.buf)) {
			// The rest of buf holds whatever it held before: stale data
			// of another request must not reach the reader as this one.
			cl.err = fmt.Errorf("nbd server: a READ of %d bytes at %d answered with %d: %w", len(cl.buf), cl.off, cl.covered, syscall.EIO)
		}
		c.finish(cookie, cl)
	}
	return nil
}

// readFixed reads n bytes (at most len(scratch)) into the reader's
// scratch buffer; they are good until the next readFixed.
func (c *conn) readFixed(n int) ([]byte, error) {
	b := c.scratch[:n]
	_, err := io.ReadFull(c.r, b)
	return b, err
}

// maxChunkOverhead bounds a chunk's non-data bytes (an error message,
// block-status descriptors we do not read one by one).
const maxChunkOverhead = 64 << 10

// chunk takes one structured reply chunk of cl.
func (c *conn) chunk(cl *call, typ uint16, length uint32) error {
	switch typ {
	case wire.ChunkNone:
		if length != 0 {
			return fmt.Errorf("%w: NONE chunk with %d bytes", errProtocol, length)
		}
	case wire.ChunkOffsetData, wire.ChunkOffsetHole:
		if cl.cmd != wire.CmdRead {
			return fmt.Errorf("%w: data chunk in reply to command %d", errProtocol, cl.cmd)
		}
		if length < 8 || (typ == wire.ChunkOffsetHole && length != 12) {
			return fmt.Errorf("%w: chunk %d of %d bytes", errProtocol, typ, length)
		}
		fixed := 8 // the offset; a hole's length follows it
		if typ == wire.ChunkOffsetHole {
			fixed = 12
		}
		b, err := c.readFixed(fixed)
		if err != nil {
			return err
		}
		n := uint64(length - 8)
		if typ == wire.ChunkOffsetHole {
			n = uint64(be.Uint32(b[8:]))
		}
		// Unsigned, each bound checked on its own: offsets and lengths
		// are the server's, and a sum of them may wrap.
		off, reqOff, size := be.Uint64(b), uint64(cl.off), uint64(len(cl.buf))
		start := off - reqOff
		if off < reqOff || n == 0 || start > size || n > size-start {
			return fmt.Errorf("%w: chunk for [%d, +%d) outside the request [%d, +%d)", errProtocol, off, n, cl.off, len(cl.buf))
		}
		if err := cl.cover(start, n); err != nil {
			return err
		}
		if typ == wire.ChunkOffsetHole {
			clear(cl.buf[start : start+n])
		} else if _, err := io.ReadFull(c.r, cl.buf[start:start+n]); err != nil {
			return err
		}
	case wire.ChunkBlockStatus, wire.ChunkBlockStatusExt:
		// The context, then descriptors of a 32-bit length and flags; or
		// under extended headers the context, a descriptor count, then
		// 64-bit lengths and flags.
		ext := typ == wire.ChunkBlockStatusExt
		head, desc := uint32(4), uint32(8)
		if ext {
			head, desc = 8, 16
		}
		if cl.cmd != wire.CmdBlockStatus || c.info.extended != ext || length < head+desc || (length-head)%desc != 0 || length > maxChunkOverhead {
			return fmt.Errorf("%w: block status chunk (type %d) of %d bytes", errProtocol, typ, length)
		}
		b := make([]byte, length)
		if _, err := io.ReadFull(c.r, b); err != nil {
			return err
		}
		if n := be.Uint32(b[4:]); ext && uint64(n) != uint64(length-8)/16 {
			return fmt.Errorf("%w: BLOCK_STATUS_EXT chunk of %d bytes says %d descriptors", errProtocol, length, n)
		}
		if be.Uint32(b) == c.info.allocCtx && !cl.gotExt {
			cl.extLen, cl.extFlags, cl.gotExt = uint64(be.Uint32(b[4:])), be.Uint32(b[8:]), true
			if ext { // base: contexts' flags are 32 bits; the high half is zero
				cl.extLen, cl.extFlags = be.Uint64(b[8:]), uint32(be.Uint64(b[16:]))
			}
		}
	case wire.ChunkError, wire.ChunkErrorOffset:
		if length < 6 || length > maxChunkOverhead {
			return fmt.Errorf("%w: error chunk of %d bytes", errProtocol, length)
		}
		b := make([]byte, length)
		if _, err := io.ReadFull(c.r, b); err != nil {
			return err
		}
		msgLen := int(be.Uint16(b[4:]))
		if 6+msgLen > len(b) {
			return fmt.Errorf("%w: error message overruns its chunk", errProtocol)
		}
		if cl.err == nil {
			cl.err = serverError(be.Uint32(b), string(b[6:6+msgLen]))
		}
	default:
		if typ&(1<<15) == 0 {
			return fmt.Errorf("%w: unknown chunk type %d", errProtocol, typ)
		}
		// An unknown error chunk: the request failed; skip its payload.
		if length > maxChunkOverhead {
			return fmt.Errorf("%w: chunk of %d bytes", errProtocol, length)
		}
		if _, err := io.CopyN(io.Discard, c.r, int64(length)); err != nil {
			return err
		}
		if cl.err == nil {
			cl.err = serverError(wire.EIO, fmt.Sprintf("unknown error chunk %d", typ))
		}
	}
	return nil
}

// serverError turns an NBD error code into an errno error. The codes are
// Linux's errno numbers; any the protocol does not define is EIO.
func serverError(code uint32, msg string) error {
	errno := syscall.EIO
	switch code {
	case wire.EPerm, wire.ENoMem, wire.EInval, wire.ENoSpc, wire.EOverflow, wire.ENotSup, wire.EShutdown:
		errno = syscall.Errno(code)
	}
	if msg != "" {
		return fmt.Errorf("nbd server: %.200s: %w", msg, errno)
	}
	return fmt.Errorf("nbd server: %w", errno)
}
