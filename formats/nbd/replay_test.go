package nbd

import (
	"bytes"
	"testing"
)

// TestReplayLogSlabs: entries keep their own data while slabs are
// recycled under them (a flush drops the oldest), and a log that keeps
// being flushed reuses its slabs instead of taking fresh memory.
func TestReplayLogSlabs(t *testing.T) {
	var l replayLog
	data := func(i int) []byte { return bytes.Repeat([]byte{byte(i), byte(i >> 8)}, 2048) }
	check := func() {
		t.Helper()
		for _, e := range l.entries {
			if i := int(e.off); e.cmd == 1 && !bytes.Equal(e.data, data(i)) {
				t.Fatalf("entry %d holds other data after slabs were recycled", i)
			}
		}
	}
	next := 0
	add := func(n int) {
		for range n {
			l.add(logEntry{cmd: 1, off: int64(next), length: 4096, data: data(next)})
			if next%7 == 0 { // entries without data mixed in
				l.add(logEntry{cmd: 6, off: int64(next), length: 4096})
			}
			next++
		}
	}
	add(3000) // about 12 MiB: 12 slabs
	l.durable(l.flushed + len(l.entries)/2)
	check()
	if len(l.spare) == 0 {
		t.Fatal("a flush that dropped half the log recycled no slab")
	}
	made := l.nextSlab
	for range 20 {
		add(1000)
		l.durable(l.mark())
		check()
	}
	if len(l.entries) != 0 || l.bytes != 0 {
		t.Fatalf("after flushing everything: %d entries, %d bytes", len(l.entries), l.bytes)
	}
	if fresh := l.nextSlab - made; fresh > 0 && len(l.spare) > int(made)+1 {
		t.Fatalf("%d spare slabs for a log that never held more than %d", len(l.spare), made)
	}
	add(1)
	if len(l.slabs) != 1 || cap(l.slabs[0].b) != slabSize {
		t.Fatalf("after a full flush the next write takes %d slabs", len(l.slabs))
	}
}
