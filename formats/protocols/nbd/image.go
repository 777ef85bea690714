// Package nbd is an image on an NBD server (qemu-nbd, nbdkit,
// qemu-storage-daemon, blockexport nbd) named by an NBD URI: the client
// side of what export/nbd serves, with extended headers or structured
// replies, base:allocation, the server's block sizes, any number of
// requests in flight and several connections where the server allows it.
//
// A connection that breaks is made again, with backoff, for up to
// Options.ReconnectTimeout, and its requests go again on the new one (NBD
// promises no order among requests in flight), which must carry all the
// first one negotiated (see carries) or every request fails with EIO.
// Unflushed writes a server may have lost are replayed, or reported by the
// next flush (see replayLog).
package nbd

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/blockexport/blockexport/coroutines"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
)

// Options say how to reach and use the export.
type Options struct {
	Writable bool
	// Connections is how many connections to open when the server allows
	// several (CAN_MULTI_CONN); one otherwise. 0 means 1.
	Connections int
	// ReconnectTimeout bounds how long a request keeps trying after its
	// first failure (a broken connection, or one that keeps breaking)
	// before it fails with EIO; 0 fails at once.
	ReconnectTimeout time.Duration
	// TLS is the client's TLS configuration for nbds URIs (see TLSConfig).
	TLS    *tls.Config
	Logger *slog.Logger
}

// Image is an export on an NBD server.
type Image struct {
	formats.NoFastPath
	addr Address
	o    Options
	d    dialer
	info exportInfo // the first connection's; later ones must agree

	slots []*slot
	next  atomic.Uint32

	// log keeps unflushed writes to send again after a reconnect (one
	// connection). With several, dirty says some were acknowledged since
	// the last flush, and lost that a connection broke meanwhile: the
	// next flush reports it.
	log   replayLog
	dirty atomic.Bool
	lost  atomic.Bool
	// writing serialises overlapping write-type requests: an unaligned
	// write reads whole blocks and writes them back, and a write, zeroing
	// or trim that landed in between would be undone (QEMU serialises
	// them the same way).
	writing coroutines.RangeLock
	// changed: the export came back unable to carry what the first
	// connection promised; every request fails from then on.
	changed atomic.Pointer[error]
	// loopDone: a serve loop read replies and has let go (see
	// ReleaseCompletions); connections made later are never its.
	loopDone atomic.Bool
	// logFlushing: a background flush empties the replay log; bg
	// counts it, for Close.
	logFlushing atomic.Bool
	bg          sync.WaitGroup
}

// slot is one of the image's connections, made again when it breaks.
type slot struct {
	mu   sync.Mutex
	c    *conn
	lost atomic.Bool // an outage has been logged and not yet ended
	// During an outage: when it began (unix nanoseconds), the reconnects in
	// it, whether a request gave up (logged once). An outage within
	// stormWindow of the last one logged is only counted (quiet), so that a
	// storm is a few lines, not one per reconnect.
	since   atomic.Int64
	redials atomic.Int64
	gaveUp  atomic.Bool
	loud    atomic.Bool  // this outage is logged
	logged  atomic.Int64 // when the last logged outage began
	quiet   atomic.Int64 // outages not logged since
	// live is c, for a serve loop that must not wait for mu (a
	// reconnect holds it while it replays writes).
	live atomic.Pointer[conn]
}

func (s *slot) set(c *conn) {
	s.c = c
	s.live.Store(c)
}

// Open connects to the export addr names.
func Open(ctx context.Context, addr Address, o Options) (*Image, error) {
	o.Logger = cmp.Or(o.Logger, slog.Default())
	if addr.TLS && o.TLS == nil {
		return nil, fmt.Errorf("nbd: %s: a TLS URI needs TLS settings", addr.URI)
	}
	if !addr.TLS {
		o.TLS = nil
	}
	img := &Image{addr: addr, o: o, d: dialer{addr: addr, tls: o.TLS}}
	s, info, err := img.d.dial(ctx)
	if err != nil {
		return nil, err
	}
	img.info = info
	first := newConn(s, info)
	if o.Writable && info.flags&wire.FlagReadOnly != 0 {
		first.close()
		return nil, fmt.Errorf("nbd: %s: the server exports it read-only: %w", addr.URI, formats.ErrReadOnly)
	}
	n := max(o.Connections, 1)
	if n > 1 && info.flags&wire.FlagCanMultiConn == 0 {
		o.Logger.Info("the NBD server does not allow several connections to this export (no CAN_MULTI_CONN); using one", "uri", addr.URI)
		n = 1
	}
	img.slots = []*slot{{}}
	img.slots[0].set(first)
	for i := 1; i < n; i++ {
		c, err := img.redial(ctx)
		if err != nil {
			o.Logger.Warn("opening more NBD connections failed; using fewer", "uri", addr.URI, "connections", i, "err", err)
			break
		}
		s := &slot{}
		s.set(c)
		img.slots = append(img.slots, s)
	}
	return img, nil
}

// conn returns slot s's connection, connecting again if it broke: with
// backoff from 50 ms to 1 s until deadline (zero: one try).
func (img *Image) conn(ctx context.Context, s *slot, deadline time.Time) (*conn, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.c != nil && s.c.alive() {
		return s.c, nil
	}
	backoff := 50 * time.Millisecond
	for {
		c, err := img.redialBy(ctx, deadline)
		if err == nil {
			s.redials.Add(1) // the outage ends when a request gets through (back)
			s.set(c)
			return c, nil
		}
		if errors.Is(err, errChanged) && img.changed.CompareAndSwap(nil, &err) {
			// For good: requests shaped for the first connection must
			// not go out reshaped, nor wait for a server that came back.
			img.o.Logger.Error("the NBD export came back unable to carry what it promised; its requests fail", "uri", img.addr.URI, "err", err)
		}
		left := time.Until(deadline)
		if deadline.IsZero() || left <= 0 || errors.Is(err, errChanged) {
			return nil, err
		}
		wait := min(backoff, left)
		img.o.Logger.Debug("NBD reconnect failed; retrying", "uri", img.addr.URI, "in", wait, "err", err)
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(wait):
		}
		backoff = min(2*backoff, time.Second)
	}
}

// redialBy is redial with the handshake bounded by the request's
// deadline too (zero: by the handshake's own limit alone): a server that
// accepts and then stalls must not hold a request past ReconnectTimeout.
func (img *Image) redialBy(ctx context.Context, deadline time.Time) (*conn, error) {
	if deadline.IsZero() {
		return img.redial(ctx)
	}
	dctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	return img.redial(dctx)
}

// errChanged: the export came back different; no retry helps.
var errChanged = errors.New("nbd: the export changed")

// redial makes a new connection after the first: see carries and replayLog.
func (img *Image) redial(ctx context.Context) (*conn, error) {
	if p := img.changed.Load(); p != nil {
		return nil, *p
	}
	s, info, err := img.d.dial(ctx)
	if err != nil {
		return nil, err
	}
	if err := img.carries(info); err != nil {
		s.Close()
		return nil, fmt.Errorf("%w: %v", errChanged, err)
	}
	c := newConn(s, info)
	switch {
	case img.replaying():
		refused, err := img.log.replay(c)
		if err != nil {
			c.close()
			return nil, err
		}
		if refused {
			img.lost.Store(true)
		}
	case img.dirty.Load():
		img.lost.Store(true)
	}
	return c, nil
}

// carries says what a new connection lacks of what the first one
// negotiated, which requests were shaped for and callers were promised. It
// may offer more; the preferred block size (a hint) and the context id
// (each connection's own) may differ.
func (img *Image) carries(n exportInfo) error {
	o := img.info
	var lacks []string
	if n.size != o.size {
		lacks = append(lacks, fmt.Sprintf("size %d (was %d)", n.size, o.size))
	}
	if o.extended && !n.extended {
		lacks = append(lacks, "extended headers")
	}
	if o.structured && !n.structured {
		lacks = append(lacks, "structured replies")
	}
	if o.hasAlloc && !n.hasAlloc {
		lacks = append(lacks, "base:allocation")
	}
	if n.minBlock > o.minBlock {
		lacks = append(lacks, fmt.Sprintf("minimum block %d (was %d)", n.minBlock, o.minBlock))
	}
	if n.maxBlock < o.maxBlock {
		lacks = append(lacks, fmt.Sprintf("maximum block %d (was %d)", n.maxBlock, o.maxBlock))
	}
	// A client that never writes sends no write-type command, so a
	// server that comes back read-only or without them still serves it
	// (qemu-nbd restarted with --read-only under a read-only export); and
	// CAN_MULTI_CONN promises consistency between connections, which one
	// connection does not need.
	writes := img.o.Writable
	if writes && n.flags&wire.FlagReadOnly != 0 && o.flags&wire.FlagReadOnly == 0 {
		lacks = append(lacks, "read-only now")
	}
	names := []struct {
		f      uint16
		name   string
		needed bool
	}{
		{wire.FlagHasFlags, "HAS_FLAGS", true}, {wire.FlagSendFlush, "SEND_FLUSH", writes}, {wire.FlagSendFUA, "SEND_FUA", writes},
		{wire.FlagSendTrim, "SEND_TRIM", writes}, {wire.FlagSendZeroes, "SEND_WRITE_ZEROES", writes}, {wire.FlagSendDF, "SEND_DF", true},
		{wire.FlagCanMultiConn, "CAN_MULTI_CONN", len(img.slots) > 1}, {wire.FlagSendCache, "SEND_CACHE", true},
		{wire.FlagSendFastZero, "SEND_FAST_ZERO", writes},
	}
	for _, f := range names {
		if f.needed && o.flags&f.f != 0 && n.flags&f.f == 0 {
			lacks = append(lacks, "no "+f.name)
		}
	}
	if len(lacks) > 0 {
		return fmt.Errorf("the export now has %s", strings.Join(lacks, ", "))
	}
	return nil
}

// do runs one request, on the next connection in turn, again on a new
// connection while its connection breaks, for up to ReconnectTimeout.
func (img *Image) do(ctx context.Context, cl call, flags uint16, length uint64, payload []byte) (call, error) {
	s := img.slots[int(img.next.Add(1))%len(img.slots)]
	// deadline bounds the request's whole time from the outage's start:
	// a server that comes back and breaks again at once (say, it hangs
	// up on every write) must not have it retried for ever.
	var deadline time.Time
	var backoff time.Duration
	// again says whether to try once more after err.
	again := func(err error) bool {
		if img.o.ReconnectTimeout <= 0 || errors.Is(err, errChanged) || ctx.Err() != nil {
			return false
		}
		if deadline.IsZero() {
			img.outage(s, err)
			// As QEMU's reconnect-delay: requests wait for the connection
			// during the first ReconnectTimeout of an outage only; later
			// ones fail after their own try until it is back (each
			// waiting a whole timeout made an unmount or a dd of a gone
			// server take a timeout per request).
			since := s.since.Load()
			if since == 0 {
				since = time.Now().UnixNano()
			}
			deadline = time.Unix(0, since).Add(img.o.ReconnectTimeout)
		}
		return time.Now().Before(deadline)
	}
	giveUp := func(err error) error {
		if !deadline.IsZero() && s.loud.Load() && s.gaveUp.CompareAndSwap(false, true) {
			img.o.Logger.Warn("NBD requests fail: the connection did not come back in time", "uri", img.addr.URI,
				"timeout", img.o.ReconnectTimeout, "reconnects", s.redials.Load(), "err", err)
		}
		return fmt.Errorf("nbd: %s: %v: %w", img.addr.URI, err, syscall.EIO)
	}
	for {
		c, err := img.conn(ctx, s, deadline)
		if err != nil {
			// A request that finds the server gone waits for it as one
			// that was in flight does.
			if again(err) {
				continue
			}
			return cl, giveUp(err)
		}
		try := cl
		try.lone = coroutines.PathOf(ctx) == coroutines.Lone
		err = c.do(&try, flags, length, payload)
		if !errors.Is(err, errLost) {
			img.back(s)
			if errors.Is(err, errProtocol) {
				img.o.Logger.Error("the NBD server broke the protocol; its connection is dropped", "uri", img.addr.URI, "err", err)
				return try, fmt.Errorf("%v: %w", err, syscall.EIO)
			}
			return try, err
		}
		if !again(err) {
			return try, giveUp(err)
		}
		// The first retry goes at once (a server that restarted is
		// back); later ones back off, 50 ms doubling to 1 s, within the
		// deadline.
		if backoff > 0 {
			select {
			case <-ctx.Done():
				return try, giveUp(ctx.Err())
			case <-time.After(min(backoff, time.Until(deadline))):
			}
			backoff = min(2*backoff, time.Second)
		} else {
			backoff = 50 * time.Millisecond
		}
	}
}

// outage notes that slot s's connection broke: logged once per outage.
func (img *Image) outage(s *slot, err error) {
	if !s.lost.CompareAndSwap(false, true) {
		return
	}
	now := time.Now()
	s.since.Store(now.UnixNano())
	s.redials.Store(0)
	s.gaveUp.Store(false)
	if last := s.logged.Load(); last != 0 && now.Sub(time.Unix(0, last)) < stormWindow {
		s.loud.Store(false)
		s.quiet.Add(1)
		return
	}
	s.loud.Store(true)
	s.logged.Store(now.UnixNano())
	img.o.Logger.Warn("NBD connection lost; reconnecting", "uri", img.addr.URI, "err", err, "timeout", img.o.ReconnectTimeout,
		"outages_not_logged_since", s.quiet.Swap(0))
}

// stormWindow: outages that follow a logged one this closely are counted,
// not logged one by one.
const stormWindow = 10 * time.Second

// back ends slot s's outage, if any, once a request got an answer: one
// line that sums it up.
func (img *Image) back(s *slot) {
	if s.lost.Load() && s.lost.CompareAndSwap(true, false) && s.loud.Load() {
		img.o.Logger.Info("NBD connection made again", "uri", img.addr.URI,
			"after", time.Since(time.Unix(0, s.since.Load())).Round(time.Millisecond), "reconnects", s.redials.Load())
	}
}

// Each request is cut at the server's maximum and aligned to its minimum.

func (img *Image) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	if err := img.inRange(off, int64(len(p))); err != nil {
		return 0, err
	}
	start, end, aligned := img.blocks(off, len(p))
	b := p
	if !aligned {
		b = make([]byte, end-start)
	}
	if err := img.read(ctx, b, start); err != nil {
		return 0, err
	}
	if !aligned {
		copy(p, b[off-start:])
	}
	return len(p), nil
}

// blocks widens [off, off+n) to the server's minimum block; ok says it
// was aligned already.
func (img *Image) blocks(off int64, n int) (start, end int64, ok bool) {
	a := int64(img.info.minBlock)
	start, end = off&^(a-1), (off+int64(n)+a-1)&^(a-1)
	return start, end, start == off && end == off+int64(n)
}

func (img *Image) read(ctx context.Context, p []byte, off int64) error {
	for len(p) > 0 {
		n := min(len(p), int(img.info.maxBlock))
		if _, err := img.do(ctx, call{cmd: wire.CmdRead, off: off, buf: p[:n]}, 0, uint64(n), nil); err != nil {
			return fmt.Errorf("nbd: read %d bytes at %d: %w", n, off, err)
		}
		p, off = p[n:], off+int64(n)
	}
	return nil
}

func (img *Image) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	if err := img.canWrite(off, int64(len(p))); err != nil {
		return 0, err
	}
	total := len(p)
	start, end, aligned := img.blocks(off, len(p))
	unlock, err := img.writing.Lock(ctx, start, end-start)
	if err != nil {
		return 0, fmt.Errorf("nbd: write %d bytes at %d: %w", len(p), off, err)
	}
	defer unlock()
	if !aligned {
		// Whole blocks, read first; overlapping writes wait (writing).
		b := make([]byte, end-start)
		if err := img.read(ctx, b, start); err != nil {
			return 0, err
		}
		copy(b[off-start:], p)
		p, off = b, start
	}
	for len(p) > 0 {
		n := min(len(p), int(img.info.maxBlock))
		pos := img.record(logEntry{cmd: wire.CmdWrite, off: off, length: uint64(n), data: p[:n]})
		if _, err := img.do(ctx, call{cmd: wire.CmdWrite, off: off}, 0, uint64(n), p[:n]); err != nil {
			img.log.cancel(pos)
			return 0, fmt.Errorf("nbd: write %d bytes at %d: %w", n, off, err)
		}
		if err := img.acked(ctx, pos); err != nil {
			return 0, err
		}
		p, off = p[n:], off+int64(n)
	}
	return total, nil
}

// bigRequest is the most a request without payload covers in a compact
// header (32-bit lengths).
const bigRequest = 1 << 30

// rangeStep is the most one TRIM, WRITE_ZEROES or BLOCK_STATUS covers.
func (img *Image) rangeStep() int64 {
	if img.info.extended {
		return 1<<63 - 1
	}
	return bigRequest &^ (int64(img.info.minBlock) - 1)
}

func (img *Image) WriteZeroes(ctx context.Context, off, n int64, mayUnmap bool) error {
	if err := img.canWrite(off, n); err != nil {
		return err
	}
	a := int64(img.info.minBlock)
	if img.info.flags&wire.FlagSendZeroes == 0 || off%a != 0 || n%a != 0 {
		// No WRITE_ZEROES, or not on block boundaries: write zeroes.
		return formats.WriteZeroBuffers(ctx, img.WriteAt, off, n, 1)
	}
	var flags uint16
	if !mayUnmap {
		flags |= wire.CmdFlagNoHole
	}
	return img.ranges(ctx, wire.CmdWriteZeroes, flags, off, n)
}

// ranges sends cmd for [off, off+n) in requests of at most bigRequest.
func (img *Image) ranges(ctx context.Context, cmd, flags uint16, off, n int64) error {
	unlock, err := img.writing.Lock(ctx, off, n)
	if err != nil {
		return fmt.Errorf("nbd: command %d for %d bytes at %d: %w", cmd, n, off, err)
	}
	defer unlock()
	step := img.rangeStep()
	for n > 0 {
		k := min(n, step)
		pos := img.record(logEntry{cmd: cmd, flags: flags, off: off, length: uint64(k)})
		if _, err := img.do(ctx, call{cmd: cmd, off: off}, flags, uint64(k), nil); err != nil {
			img.log.cancel(pos)
			return fmt.Errorf("nbd: command %d for %d bytes at %d: %w", cmd, k, off, err)
		}
		if err := img.acked(ctx, pos); err != nil {
			return err
		}
		off, n = off+k, n-k
	}
	return nil
}

// Discard trims where the server can; elsewhere it is a no-op, which the
// interface allows.
func (img *Image) Discard(ctx context.Context, off, n int64) error {
	if err := img.canWrite(off, n); err != nil {
		return err
	}
	a := int64(img.info.minBlock)
	start := (off + a - 1) &^ (a - 1)
	end := (off + n) &^ (a - 1)
	if img.info.flags&wire.FlagSendTrim == 0 || end <= start {
		return nil
	}
	return img.ranges(ctx, wire.CmdTrim, 0, start, end-start)
}

// Flush makes acknowledged writes durable on the server; after a
// reconnect that may have lost some (several connections, see replayLog),
// it reports that once.
func (img *Image) Flush(ctx context.Context) error {
	if !img.o.Writable {
		return nil
	}
	dirty := img.dirty.Swap(false)
	if err := img.flushLog(ctx); err != nil {
		if dirty {
			img.dirty.Store(true)
		}
		return err
	}
	if img.lost.Swap(false) {
		return fmt.Errorf("nbd: %s: the connection broke while writes were not flushed; the server may have lost them: %w", img.addr.URI, syscall.EIO)
	}
	return nil
}

func (img *Image) Size() int64 { return img.info.size }

func (img *Image) Resize(context.Context, int64) error {
	return fmt.Errorf("nbd: the export's size is the server's: %w", formats.ErrNotSupported)
}

// Extent asks the server (base:allocation) for the run at off. A server
// without it reports everything as data, as QEMU reads it.
func (img *Image) Extent(ctx context.Context, off, n int64) (formats.Extent, error) {
	if off < 0 || off >= img.info.size {
		return formats.Extent{}, fmt.Errorf("nbd: extent at %d: %w", off, formats.ErrOutOfRange)
	}
	n = min(n, img.info.size-off)
	e := formats.Extent{Start: off, Length: n, Data: true, Present: true, Offset: off, HasOffset: true, File: img.addr.Canonical()}
	if !img.info.hasAlloc {
		return e, nil
	}
	a := int64(img.info.minBlock)
	start := off &^ (a - 1)
	length := min((off+n+a-1)&^(a-1)-start, img.rangeStep())
	cl, err := img.do(ctx, call{cmd: wire.CmdBlockStatus, off: start}, wire.CmdFlagReqOne, uint64(length), nil)
	if err != nil {
		return formats.Extent{}, fmt.Errorf("nbd: block status at %d: %w", off, err)
	}
	if !cl.gotExt || cl.extLen == 0 {
		return formats.Extent{}, fmt.Errorf("nbd: block status at %d: %w: no extent in the reply", off, syscall.EIO)
	}
	// The server's length is bounded by what was asked (no overflow).
	e.Length = min(start+int64(min(cl.extLen, uint64(length)))-off, n)
	if e.Length <= 0 {
		e.Length = min(a, n) // a run shorter than the minimum block: the block's status
	}
	e.Data = cl.extFlags&wire.StateHole == 0
	e.Zero = cl.extFlags&wire.StateZero != 0
	return e, nil
}

// AllocatedSize is unknown: the server does not say.
func (img *Image) AllocatedSize(context.Context) (int64, error) { return -1, nil }

func (img *Image) inRange(off, n int64) error {
	if off < 0 || n < 0 || off+n > img.info.size {
		return fmt.Errorf("nbd: [%d, +%d) of a %d-byte export: %w", off, n, img.info.size, formats.ErrOutOfRange)
	}
	return nil
}

// canWrite refuses a write to a read-only image, then one out of range.
func (img *Image) canWrite(off, n int64) error {
	if !img.o.Writable {
		return formats.ErrReadOnly
	}
	return img.inRange(off, n)
}

// Info is what qemu-img info says of an NBD image, and what the server
// told us (flags and block sizes) for the human lines.
func (img *Image) Info() formats.Info {
	i := img.info
	yes := map[bool]string{true: "yes", false: "no"}
	flag := func(f uint16) string { return yes[i.flags&f != 0] }
	lines := []string{
		"    export: " + fmt.Sprintf("%q", img.addr.Export),
		"    tls: " + yes[i.tls],
		fmt.Sprintf("    read-only: %s", flag(wire.FlagReadOnly)),
		fmt.Sprintf("    flush: %s, fua: %s, trim: %s, zeroes: %s, fast-zero: %s, multi-conn: %s",
			flag(wire.FlagSendFlush), flag(wire.FlagSendFUA), flag(wire.FlagSendTrim), flag(wire.FlagSendZeroes),
			flag(wire.FlagSendFastZero), flag(wire.FlagCanMultiConn)),
		fmt.Sprintf("    block size: minimum %d, preferred %d, maximum %d", i.minBlock, i.prefBlock, i.maxBlock),
		"    base:allocation: " + yes[i.hasAlloc],
		"    extended headers: " + yes[i.extended],
	}
	if i.description != "" {
		lines = append(lines, fmt.Sprintf("    description: %q", i.description))
	}
	return formats.Info{
		Format:           "raw",
		Filename:         img.addr.Canonical(),
		VirtualSize:      i.size,
		ActualSize:       -1,
		Remote:           true,
		ServerLines:      lines,
		RequestAlignment: int(i.minBlock),
	}
}

// Close says goodbye on every connection.
func (img *Image) Close() error {
	img.bg.Wait() // a background flush uses the connections
	for _, s := range img.slots {
		s.mu.Lock()
		if s.c != nil {
			s.c.close()
		}
		s.mu.Unlock()
	}
	return nil
}

// The serve loop's side (formats.Completions): a FUSE queue that waits on
// the connections' sockets beside /dev/fuse and reads the replies itself.

// CompletionFds lists the live connections' sockets, and makes the loop
// their reader from now on.
func (img *Image) CompletionFds(dst []int) []int {
	if img.loopDone.Load() {
		return dst
	}
	for _, s := range img.slots {
		if c := s.live.Load(); c != nil && c.alive() {
			if fd := c.fd(); fd >= 0 && c.attachLoop() {
				dst = append(dst, fd)
			}
		}
	}
	return dst
}

// ServeCompletions reads the replies that have come on every connection.
func (img *Image) ServeCompletions() {
	for _, s := range img.slots {
		if c := s.live.Load(); c != nil && c.reader.Load() == loopReads {
			c.serveReplies()
		}
	}
}

// ReleaseCompletions hands reading back to the requests, for good.
func (img *Image) ReleaseCompletions() {
	img.loopDone.Store(true)
	for _, s := range img.slots {
		if c := s.live.Load(); c != nil {
			c.releaseLoop()
		}
	}
}
