package fuse

import (
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// bulkHelper is a second queue that serves only while large writes come.
//
// Why: with one queue, a buffered write's two copies (out of /dev/fuse
// into our buffer, then into the page cache) run in turn on the loop's
// thread, where QEMU overlaps them on several threads; a second queue
// overlaps them too. It is not kept for small requests, where two readers
// of one queue take turns sleeping (docs/design.md, Our own
// /dev/fuse loop). So the helper is cloned at the first large write and parks
// (stops reading /dev/fuse) once none has come for bulkIdle; its fd stays
// open, since requests it handed to goroutines reply through it.
type bulkHelper struct {
	mu      sync.Mutex
	fd      int  // -1 until cloned
	reading bool // the helper is serving (not parked)
	wake    chan struct{}
	stop    chan struct{} // closed when the connection has ended
	last    atomic.Int64  // when the last large write came (UnixNano)
}

// bulkWrite is the write size that calls the bulk helper in, and from which
// a write that cannot finish in place (qcow2 allocating or copying on
// write) leaves the loop with the buffer it was read into rather than
// being copied out of it (below it the copy costs less than a fresh
// buffer); bulkIdle is how long the helper serves after the last one.
const (
	bulkWrite = 128 << 10
	bulkIdle  = 20 * time.Millisecond
)

// sawBulkWrite notes a large write and makes sure the helper is reading.
func (s *server) sawBulkWrite() {
	b := &s.bulk
	b.last.Store(time.Now().UnixNano())
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.reading {
		return
	}
	if b.fd < 0 {
		fd, err := s.cloneFd()
		if err == nil {
			err = unix.SetNonblock(fd, true) // see loop
			if err != nil {
				unix.Close(fd)
			}
		}
		if err != nil {
			s.exp.log.Debug("no bulk-write queue", "err", err)
			return
		}
		b.fd, b.wake = fd, make(chan struct{}, 1)
		b.reading = true
		s.loops.Add(1)
		go s.loop(fd, true, nil)
		return
	}
	b.reading = true
	b.wake <- struct{}{}
}

// bulkPark runs after each request the helper serves: once large writes
// have stopped, it parks the helper until they resume or the connection
// ends (false: exit).
func (s *server) bulkPark() bool {
	b := &s.bulk
	if time.Since(time.Unix(0, b.last.Load())) < bulkIdle {
		return true
	}
	b.mu.Lock()
	if time.Since(time.Unix(0, b.last.Load())) < bulkIdle {
		b.mu.Unlock()
		return true
	}
	b.reading = false
	b.mu.Unlock()
	select {
	case <-b.wake:
		return true
	case <-b.stop:
		return false
	}
}
