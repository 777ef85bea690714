package nbd

import (
	"context"
	"fmt"
	"sync"
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
}

type logEntry struct {
	cmd, flags uint16
	off        int64
	length     uint32
	data       []byte // a WRITE's payload, copied
}

// maxLogBytes bounds the write data kept for replay.
const maxLogBytes = 64 << 20

// add records an acknowledged request; it says whether the log is over
// its bound (the caller then flushes).
func (l *replayLog) add(e logEntry) bool {
	if e.data != nil {
		e.data = append([]byte(nil), e.data...)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.entries = append(l.entries, e)
	l.bytes += int64(len(e.data))
	return l.bytes > maxLogBytes
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

// acked records a write-type request the server acknowledged, flushing
// when the log is full.
func (img *Image) acked(ctx context.Context, e logEntry) error {
	if !img.replaying() {
		img.dirty.Store(true)
		return nil
	}
	if img.log.add(e) {
		return img.Flush(ctx)
	}
	return nil
}

// replaying says whether writes are kept for replay (one connection).
func (img *Image) replaying() bool { return len(img.slots) == 1 }
