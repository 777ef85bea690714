package nbd

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/aio/sock"
	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
)

// readWithin runs img.ReadAt of n bytes at off and fails the test if it
// does not end within d.
func readWithin(t *testing.T, img *Image, n int, off int64, d time.Duration) (int, []byte, error) {
	t.Helper()
	type res struct {
		n   int
		err error
	}
	p := bytes.Repeat([]byte{0xee}, n)
	done := make(chan res, 1)
	go func() {
		k, err := img.ReadAt(context.Background(), p, off)
		done <- res{k, err}
	}()
	select {
	case r := <-done:
		return r.n, p, r.err
	case <-time.After(d):
		t.Fatalf("a read of %d bytes at %d did not end within %v", n, off, d)
	}
	return 0, nil, nil
}

// TestChunkOffsetsThatOverflow: data and hole chunks whose offset plus
// length wraps past 2^63 (relative to the request, and absolute) are
// protocol errors, not a panic.
func TestChunkOffsetsThatOverflow(t *testing.T) {
	const big = 1<<63 - 1
	data := func(off uint64) []byte { return append(be.AppendUint64(nil, off), make([]byte, 4096)...) }
	hole := func(off uint64, n uint32) []byte { return be.AppendUint32(be.AppendUint64(nil, off), n) }
	cases := map[string]func(q fakeReq) []byte{
		"data at request+2^63-1": func(q fakeReq) []byte {
			return chunk(q.cookie, wire.ChunkFlagDone, wire.ChunkOffsetData, data(q.off+big))
		},
		"data ending at 2^64": func(q fakeReq) []byte {
			return chunk(q.cookie, wire.ChunkFlagDone, wire.ChunkOffsetData, data(1<<64-4096))
		},
		"hole at 2^63-1 of 1": func(q fakeReq) []byte {
			return chunk(q.cookie, wire.ChunkFlagDone, wire.ChunkOffsetHole, hole(big, 1))
		},
		"hole at request+2^63-1 of 4 GiB-1": func(q fakeReq) []byte {
			return chunk(q.cookie, wire.ChunkFlagDone, wire.ChunkOffsetHole, hole(q.off+big, 1<<32-1))
		},
		"hole before the request": func(q fakeReq) []byte {
			return chunk(q.cookie, wire.ChunkFlagDone, wire.ChunkOffsetHole, hole(q.off-1, 2))
		},
	}
	for name, reply := range cases {
		t.Run(name, func(t *testing.T) {
			f := newFakeNBD(t, 1<<20, func(int) fakeInfo { return fakeInfo{structured: true} })
			f.handle = func(q fakeReq, _ fakeInfo) ([]byte, bool) {
				if q.cmd == wire.CmdRead {
					return reply(q), false
				}
				return nil, false
			}
			img := f.open(Options{})
			n, _, err := readWithin(t, img, 4096, 8192, 10*time.Second)
			if !errors.Is(err, syscall.EIO) || n != 0 {
				t.Fatalf("read: %d, %v; want EIO", n, err)
			}
		})
	}
}

// TestShortReadFails: a READ whose chunks do not cover it fails with EIO
// and hands nothing back: the bytes the server left out are whatever the
// buffer held (another request's data), never the read's. Chunks that
// overlap (and so may cover the count of bytes with a gap) break the
// protocol. A reply in scattered pieces that do cover it all reads right.
func TestShortReadFails(t *testing.T) {
	data := func(off uint64, n int) []byte {
		return append(be.AppendUint64(nil, off), bytes.Repeat([]byte{0xab}, n)...)
	}
	hole := func(off uint64, n uint32) []byte { return be.AppendUint32(be.AppendUint64(nil, off), n) }
	cases := map[string]func(q fakeReq, ext bool) []byte{
		"NONE and DONE only": func(q fakeReq, ext bool) []byte {
			if ext {
				return extChunk(q.cookie, q.off, wire.ChunkFlagDone, wire.ChunkNone, nil)
			}
			return chunk(q.cookie, wire.ChunkFlagDone, wire.ChunkNone, nil)
		},
		"half the data then DONE": func(q fakeReq, ext bool) []byte {
			if ext {
				return append(extChunk(q.cookie, q.off, 0, wire.ChunkOffsetData, data(q.off, 2048)),
					extChunk(q.cookie, q.off, wire.ChunkFlagDone, wire.ChunkNone, nil)...)
			}
			return chunk(q.cookie, wire.ChunkFlagDone, wire.ChunkOffsetData, data(q.off, 2048))
		},
		"overlapping chunks that add up": func(q fakeReq, ext bool) []byte {
			if ext {
				return append(extChunk(q.cookie, q.off, 0, wire.ChunkOffsetData, data(q.off, 3072)),
					extChunk(q.cookie, q.off, wire.ChunkFlagDone, wire.ChunkOffsetHole, hole(q.off+1024, 1024))...)
			}
			return append(chunk(q.cookie, 0, wire.ChunkOffsetData, data(q.off, 3072)),
				chunk(q.cookie, wire.ChunkFlagDone, wire.ChunkOffsetHole, hole(q.off+1024, 1024))...)
		},
	}
	for _, ext := range []bool{false, true} {
		for name, reply := range cases {
			t.Run(map[bool]string{false: "structured/", true: "extended/"}[ext]+name, func(t *testing.T) {
				f := newFakeNBD(t, 1<<20, func(int) fakeInfo { return fakeInfo{structured: true, extended: ext} })
				f.handle = func(q fakeReq, _ fakeInfo) ([]byte, bool) {
					if q.cmd == wire.CmdRead {
						return reply(q, ext), false
					}
					return nil, false
				}
				img := f.open(Options{})
				n, _, err := readWithin(t, img, 4096, 8192, 10*time.Second)
				if !errors.Is(err, syscall.EIO) || n != 0 {
					t.Fatalf("read: %d bytes, %v; want EIO", n, err)
				}
			})
		}
	}
	// Four pieces out of order, holes and data, that cover it all.
	f := newFakeNBD(t, 1<<20, func(int) fakeInfo { return fakeInfo{structured: true} })
	f.handle = func(q fakeReq, _ fakeInfo) ([]byte, bool) {
		if q.cmd != wire.CmdRead {
			return nil, false
		}
		var b []byte
		b = append(b, chunk(q.cookie, 0, wire.ChunkOffsetData, data(q.off+3072, 1024))...)
		b = append(b, chunk(q.cookie, 0, wire.ChunkOffsetHole, hole(q.off, 1024))...)
		b = append(b, chunk(q.cookie, 0, wire.ChunkOffsetHole, hole(q.off+2048, 1024))...)
		return append(b, chunk(q.cookie, wire.ChunkFlagDone, wire.ChunkOffsetData, data(q.off+1024, 1024))...), false
	}
	img := f.open(Options{})
	n, got, err := readWithin(t, img, 4096, 8192, 10*time.Second)
	want := append(append(append(make([]byte, 1024), bytes.Repeat([]byte{0xab}, 1024)...), make([]byte, 1024)...), bytes.Repeat([]byte{0xab}, 1024)...)
	if err != nil || n != 4096 || !bytes.Equal(got, want) {
		t.Fatalf("a read in four scattered chunks: %d, %v", n, err)
	}
}

// TestTurnPassedOnWhenReplyCame: a waiter that takes the reading turn
// and finds its reply already read passes the turn on to the requests
// still waiting (here b); dropping it left them with nobody reading.
func TestTurnPassedOnWhenReplyCame(t *testing.T) {
	for i := range 200 {
		a, b := net.Pipe()
		st, err := sock.New(a, 0)
		if err != nil {
			t.Fatal(err)
		}
		c := newConn(st, exportInfo{structured: true})
		ca, cb := &call{done: make(chan struct{})}, &call{done: make(chan struct{})}
		c.calls[1], c.calls[2] = ca, cb
		c.rmu.Lock() // someone else reads
		returned := make(chan struct{})
		go func() { c.wait(ca); close(returned) }()
		time.Sleep(100 * time.Microsecond) // let it wait, mostly
		c.turn <- struct{}{}               // the reader stops and passes the turn...
		c.mu.Lock()
		delete(c.calls, 1) // ...having read a's reply
		c.mu.Unlock()
		close(ca.done)
		select {
		case <-returned:
		case <-time.After(5 * time.Second):
			t.Fatal("the waiter never returned")
		}
		if len(c.turn) != 1 {
			t.Fatalf("round %d: the turn was dropped with a request still waiting and nobody reading", i)
		}
		c.rmu.Unlock()
		a.Close()
		b.Close()
	}
}

// strictStream is a stream that records misuse of its descriptor: a
// close while a write is in progress (the descriptor's number may be
// reused by then, and the write go on into another file), and any use
// after the close. Writes block until the stream is shut down or closed;
// reads return replies, then wait for that.
type strictStream struct {
	mu      sync.Mutex
	writing int
	closed  bool
	bad     []string
	shut    chan struct{}
	once    sync.Once
	started chan struct{}
	replies *bytes.Reader
}

func (s *strictStream) use(what string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		s.bad = append(s.bad, what+" after close")
	}
}

func (s *strictStream) write() error {
	s.use("write")
	s.mu.Lock()
	s.writing++
	s.mu.Unlock()
	select {
	case s.started <- struct{}{}:
	default:
	}
	<-s.shut
	s.mu.Lock()
	s.writing--
	s.mu.Unlock()
	return syscall.EPIPE
}

func (s *strictStream) Write(p []byte) (int, error) { return 0, s.write() }

func (s *strictStream) WriteBuffers(bufs [][]byte) error { return s.write() }

func (s *strictStream) Pending() bool { return true }

func (s *strictStream) Read(p []byte) (int, error) {
	s.use("read")
	if s.replies.Len() > 0 {
		return s.replies.Read(p)
	}
	<-s.shut
	return 0, io.EOF
}

func (s *strictStream) CloseRead() error {
	s.use("shutdown")
	s.once.Do(func() { close(s.shut) })
	return nil
}

func (s *strictStream) Close() error {
	s.mu.Lock()
	if s.writing > 0 {
		s.bad = append(s.bad, "closed while a write was in progress")
	}
	s.closed = true
	s.mu.Unlock()
	s.once.Do(func() { close(s.shut) })
	return nil
}

// TestNoWriteIntoAClosedStream: the reader fails the connection (a bad
// reply) while a request is being written; the stream is closed only
// once that write has let go of it.
func TestNoWriteIntoAClosedStream(t *testing.T) {
	s := &strictStream{shut: make(chan struct{}), started: make(chan struct{}, 1), replies: bytes.NewReader(bytes.Repeat([]byte{0xee}, 64))}
	c := newConn(s, exportInfo{structured: true})
	done := make(chan error, 1)
	go func() {
		cl := call{cmd: wire.CmdWrite, off: 0}
		done <- c.do(&cl, 0, 4096, make([]byte, 4096))
	}()
	<-s.started
	c.rmu.Lock()
	c.readOrFail() // bad magic: the connection fails
	c.rmu.Unlock()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("the write succeeded on a failed connection")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the write never returned")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.bad) > 0 || !s.closed {
		t.Fatalf("misuse of the stream: %q (closed at the end: %v)", s.bad, s.closed)
	}
}
