package nbd

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
)

// replayLog keeps the writes sent since the last flush that covered them:
// a server that went away may have lost them, so after a reconnect they
// are sent again, in order, before anything else. A write is recorded
// before it is sent (add; recorded only once acknowledged, one answered
// just before the connection broke could miss the replay), marked when
// acknowledged (ack) and dropped when it failed (cancel). A flush drops
// the writes acknowledged before it was sent; past flushLogBytes the log
// flushes the server itself. With several connections an old write sent
// again on one could land after a newer one on another: there a reconnect
// with unflushed writes makes the next flush report EIO instead (Image.lost).
type replayLog struct {
	mu      sync.Mutex
	entries []logEntry
	bytes   int64
	// flushed counts entries dropped by flushes: positions survive them.
	flushed int
	// acks counts acknowledgements: a flush covers the entries whose
	// ackSeq is at most the count when it was sent.
	acks uint64

	// The write data is copied into slabs, which are reused once flushes
	// have dropped every entry in them: a copy into fresh memory costs a
	// page fault per 4 KiB.
	slabs    []slab // in use, oldest first
	spare    [][]byte
	nextSlab uint64
}

type slab struct {
	b    []byte
	used int
	seq  uint64 // entries name their slab by it; 0 is none
}

type logEntry struct {
	cmd, flags uint16
	off        int64
	length     uint64
	data       []byte // a WRITE's payload, copied
	slab       uint64 // the slab holding data (0: its own allocation, or none)
	state      entryState
	ackSeq     uint64 // acked: the log's acks then
}

// entryState is where a logged request stands.
type entryState uint8

const (
	entrySent      entryState = iota // sent (or about to be), not answered
	entryAcked                       // the server acknowledged it
	entryCancelled                   // it failed: never replayed
)

const (
	// Past flushLogBytes of write data the log has the server flush, in
	// the background; past maxLogBytes a write waits for that flush
	// (back-pressure: the bound on memory).
	flushLogBytes = 64 << 20
	maxLogBytes   = 2 * flushLogBytes
	slabSize      = 1 << 20
)

// logState is what add found: whether a flush should start, or must be
// waited for.
type logState uint8

const (
	logRoomy logState = iota
	logFlushSoon
	logFull
)

// add records a request about to be sent and returns its position.
func (l *replayLog) add(e logEntry) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e.data != nil {
		e.data, e.slab = l.copyIn(e.data)
	}
	e.state = entrySent
	l.entries = append(l.entries, e)
	l.bytes += int64(len(e.data))
	return l.flushed + len(l.entries) - 1
}

// entry is the entry at position pos, or nil when a flush dropped it.
func (l *replayLog) entry(pos int) *logEntry {
	if i := pos - l.flushed; i >= 0 && i < len(l.entries) {
		return &l.entries[i]
	}
	return nil
}

// ack marks the entry at pos acknowledged and says how full the log is.
func (l *replayLog) ack(pos int) logState {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e := l.entry(pos); e != nil {
		l.acks++
		e.state, e.ackSeq = entryAcked, l.acks
	}
	switch {
	case l.bytes > maxLogBytes:
		return logFull
	case l.bytes > flushLogBytes:
		return logFlushSoon
	}
	return logRoomy
}

// copyIn copies b into the current slab (a new one when it is full).
func (l *replayLog) copyIn(b []byte) ([]byte, uint64) {
	if len(b) > slabSize {
		return append([]byte(nil), b...), 0
	}
	if k := len(l.slabs); k == 0 || l.slabs[k-1].used+len(b) > slabSize {
		var buf []byte
		if n := len(l.spare); n > 0 {
			buf, l.spare = l.spare[n-1], l.spare[:n-1]
		} else {
			buf = make([]byte, slabSize)
		}
		l.nextSlab++
		l.slabs = append(l.slabs, slab{b: buf, seq: l.nextSlab})
	}
	s := &l.slabs[len(l.slabs)-1]
	dst := s.b[s.used : s.used+len(b)]
	copy(dst, b)
	s.used += len(b)
	return dst, s.seq
}

// cancel marks the entry at pos failed: it is never replayed (a replay
// of a write the server refused would fail every reconnect). A pos of -1
// (nothing recorded) names no entry.
func (l *replayLog) cancel(pos int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e := l.entry(pos); e != nil {
		e.state = entryCancelled
	}
}

// mark is the log's acknowledgement count now: a flush sent after it makes
// the entries acknowledged up to it durable.
func (l *replayLog) mark() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.acks
}

// durable drops the leading entries a flush sent at mark covered (and
// those that failed); an entry still unanswered, or acknowledged after
// the flush was sent, stays, and so does everything after it.
func (l *replayLog) durable(mark uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for n < len(l.entries) {
		e := &l.entries[n]
		if e.state == entryCancelled || (e.state == entryAcked && e.ackSeq <= mark) {
			n++
			continue
		}
		break
	}
	if n == 0 {
		return
	}
	for _, e := range l.entries[:n] {
		l.bytes -= int64(len(e.data))
	}
	l.entries = append(l.entries[:0:0], l.entries[n:]...)
	l.flushed += n
	// Slabs older than the oldest one an entry still uses go back to
	// the spares (all of them when no entry uses one).
	keep := l.nextSlab + 1
	for _, e := range l.entries {
		if e.slab != 0 {
			keep = e.slab
			break
		}
	}
	i := 0
	for i < len(l.slabs) && l.slabs[i].seq < keep {
		l.spare = append(l.spare, l.slabs[i].b)
		i++
	}
	l.slabs = append(l.slabs[:0], l.slabs[i:]...)
}

// replay sends every entry that has not failed again on c, in order, one
// at a time (two entries may overlap; the later must land last). Those
// not yet answered are sent too: their own requests send them again
// after this, which writes the same data. A replayed write the server
// refuses does not stop the reconnect; it says so (refused: the data
// may be lost, which the next flush reports).
func (l *replayLog) replay(c *conn) (refused bool, err error) {
	l.mu.Lock()
	entries := make([]logEntry, 0, len(l.entries))
	for _, e := range l.entries {
		if e.state != entryCancelled {
			entries = append(entries, e)
		}
	}
	l.mu.Unlock()
	for _, e := range entries {
		cl := call{cmd: e.cmd, off: e.off}
		if err := c.do(&cl, e.flags, e.length, e.data); errors.Is(err, errLost) || errors.Is(err, errProtocol) {
			return refused, fmt.Errorf("replaying unflushed writes: %w", err)
		} else if err != nil {
			refused = true
		}
	}
	return refused, nil
}

// record logs a write-type request before it is sent; it returns the
// entry's position, or -1 when nothing is kept (see replaying).
func (img *Image) record(e logEntry) int {
	if !img.replaying() {
		return -1
	}
	return img.log.add(e)
}

// acked records a write-type request the server acknowledged. When the
// log has grown past flushLogBytes the server is flushed in the
// background, which empties it; only a write that finds it past
// maxLogBytes (the flush has not kept up) waits for one: a write that
// waited for every flush would stall its client for the whole fdatasync.
func (img *Image) acked(ctx context.Context, pos int) error {
	if pos < 0 {
		img.dirty.Store(true)
		return nil
	}
	switch img.log.ack(pos) {
	case logFull:
		return img.flushLog(ctx)
	case logFlushSoon:
		if img.logFlushing.CompareAndSwap(false, true) {
			img.bg.Add(1)
			go func() {
				defer img.bg.Done()
				defer img.logFlushing.Store(false)
				if err := img.flushLog(context.Background()); err != nil {
					// The entries stay: the next flush tries again and
					// reports its own outcome.
					img.o.Logger.Warn("flushing the NBD server in the background failed", "uri", img.addr.URI, "err", err)
				}
			}()
		}
	}
	return nil
}

// flushLog flushes the server and drops the log entries the flush covers.
func (img *Image) flushLog(ctx context.Context) error {
	mark := img.log.mark()
	if img.info.flags&wire.FlagSendFlush != 0 {
		if _, err := img.do(ctx, call{cmd: wire.CmdFlush}, 0, 0, nil); err != nil {
			return fmt.Errorf("nbd: flush: %w", err)
		}
	}
	img.log.durable(mark)
	return nil
}

// replaying says whether writes are kept for replay: one connection, and
// a reconnect to replay them on.
func (img *Image) replaying() bool { return len(img.slots) == 1 && img.o.ReconnectTimeout > 0 }
