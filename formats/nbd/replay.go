package nbd

import (
	"context"
	"fmt"
	"sync"

	"github.com/blockexport/blockexport/formats/nbd/wire"
)

// replayLog keeps the writes the server acknowledged since the last flush
// it completed: a server that went away may have lost them (they need not
// have reached its disk), so after a reconnect they are sent again, in the
// order they were acknowledged, before anything else. A flush empties the
// log; past maxBytes of data the log flushes the server itself.
//
// It replays over a single connection only: with several, an old write
// sent again on one could land after a newer one another connection
// carried. There, a reconnect with unflushed writes makes the next flush
// report EIO instead (see Image.lost).
type replayLog struct {
	mu      sync.Mutex
	entries []logEntry
	bytes   int64
	// flushed counts entries dropped by flushes: positions survive them.
	flushed int

	// The write data is copied into slabs, which are reused once flushes
	// have dropped every entry in them: on this machine a copy into
	// fresh memory took a page fault per 4 KiB, a third of a 4 KiB
	// write's CPU (pprof).
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
}

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

// add records an acknowledged request and says how full the log is.
func (l *replayLog) add(e logEntry) logState {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e.data != nil {
		e.data, e.slab = l.copyIn(e.data)
	}
	l.entries = append(l.entries, e)
	l.bytes += int64(len(e.data))
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

// mark is the log's position now: a flush that starts here makes what
// came before it durable.
func (l *replayLog) mark() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.flushed + len(l.entries)
}

// durable drops the entries before mark: a flush covered them.
func (l *replayLog) durable(mark int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := mark - l.flushed
	if n <= 0 {
		return
	}
	for _, e := range l.entries[:n] {
		l.bytes -= int64(len(e.data))
	}
	l.entries = append(l.entries[:0:0], l.entries[n:]...)
	l.flushed = mark
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

// replay sends every entry again on c, in order, one at a time (two
// entries may overlap; the later must land last).
func (l *replayLog) replay(c *conn) error {
	l.mu.Lock()
	entries := append([]logEntry(nil), l.entries...)
	l.mu.Unlock()
	for _, e := range entries {
		cl := call{cmd: e.cmd, off: e.off}
		if err := c.do(&cl, e.flags, e.length, e.data); err != nil {
			return fmt.Errorf("replaying unflushed writes: %w", err)
		}
	}
	return nil
}

// acked records a write-type request the server acknowledged. When the
// log has grown past flushLogBytes the server is flushed in the
// background, which empties it; only a write that finds it past
// maxLogBytes (the flush has not kept up) waits for one. (A write that
// waited for every flush stalled its client for the whole fdatasync of
// 64 MiB of scattered pages: random 4 KiB writes at queue depth one ran
// at 0.67x QEMU's.)
func (img *Image) acked(ctx context.Context, e logEntry) error {
	if !img.replaying() {
		img.dirty.Store(true)
		return nil
	}
	switch img.log.add(e) {
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
