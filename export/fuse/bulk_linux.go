package fuse

import (
	"sync"
	"sync/atomic"
	"time"
)

// bulkHelper is a second queue that serves only while large writes come,
// so that two threads do a write's two copies (docs/design.md, Our own
// /dev/fuse loop); it parks once none has come for bulkIdle (for small
// requests two readers of one queue only take turns sleeping). Its fd
// stays open: requests it handed to goroutines reply through it.
type bulkHelper struct {
	mu      sync.Mutex
	fd      int  // -1 until cloned
	reading bool // the helper is serving (not parked)
	wake    chan struct{}
	stop    chan struct{} // closed when the connection has ended
	last    atomic.Int64  // when the last large write came (UnixNano)
}

// bulkWrite is the write size that calls the bulk helper in, and from which
// a handed-off write takes the loop's buffer rather than a copy (see
// handOff); bulkIdle is how long the helper serves after the last one.
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
		fd, err := s.cloneFd(true) // see loop
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
