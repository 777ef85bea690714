package nbd

import (
	"bufio"
	"context"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/null"
	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
)

// gatedImage holds every read until the gate opens, and records how many
// bytes of reads were in its hands at once.
type gatedImage struct {
	formats.Image
	gate              chan struct{}
	calls             atomic.Int64
	inflight, maxSeen atomic.Int64
}

// TryReadAt: a gated read waits, so it never finishes in the reader.
func (g *gatedImage) TryReadAt([]byte, int64) bool { return false }

func (g *gatedImage) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	g.calls.Add(1)
	n := g.inflight.Add(int64(len(p)))
	for {
		m := g.maxSeen.Load()
		if n <= m || g.maxSeen.CompareAndSwap(m, n) {
			break
		}
	}
	<-g.gate
	g.inflight.Add(-int64(len(p)))
	return g.Image.ReadAt(ctx, p, off)
}

// TestMisbehavingClientIsBounded: a client that sends a burst of large
// reads and goes away (1000 READs of 32 MiB drove the server to 7 GiB)
// gets at most the connection's budget in flight, the reader stops reading
// while it is spent (back-pressure, no errors), and once the client is
// gone its queued requests are dropped, not run.
func TestMisbehavingClientIsBounded(t *testing.T) {
	inner, _ := null.New("null", 1<<30, true)
	img := &gatedImage{Image: inner, gate: make(chan struct{})}
	const connBytes = 8 << 20
	s := New(img, Options{Name: "disk", ConnBytes: connBytes, ServerBytes: 64 << 20})
	c, done := goClient(t, s, "disk")
	b := c.c

	const reads, size = 1000, 2 << 20 // larger than the 1 MiB inline buffer
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := range reads {
			h := be.AppendUint32(nil, wire.MagicRequest)
			h = be.AppendUint16(h, 0)
			h = be.AppendUint16(h, wire.CmdRead)
			h = be.AppendUint64(h, uint64(i))
			h = be.AppendUint64(h, uint64(i%256)*size)
			h = be.AppendUint32(h, size)
			if _, err := b.Write(h); err != nil {
				return // the server stopped reading and we closed
			}
		}
	}()
	// The reader fills the budget, then stops taking requests.
	deadline := time.Now().Add(5 * time.Second)
	for img.inflight.Load() < connBytes && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond) // room for a reader that would go on
	if got := img.maxSeen.Load(); got != connBytes {
		t.Fatalf("%d bytes of reads in flight at once, want the budget (%d)", got, connBytes)
	}
	if in := s.budget.InUse(); in != connBytes {
		t.Fatalf("the server's budget has %d in use, want %d", in, connBytes)
	}
	// The client goes away; the reads in hand finish, their replies fail,
	// and nothing queued behind them runs.
	b.Close()
	close(img.gate)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the connection did not end after the client went away")
	}
	wg.Wait()
	if calls := img.calls.Load(); calls > 2*connBytes/size {
		t.Fatalf("%d reads ran after the client had gone; want at most the %d in flight and a few more", calls, connBytes/size)
	}
	if in := s.budget.InUse(); in != 0 {
		t.Fatalf("%d bytes of budget never came back", in)
	}
}

// TestTruncatedWriteGivesTheBudgetBack: a client that announces a large
// write and hangs up before its payload must not keep the server's budget
// (a few such clients would lock every other client out).
func TestTruncatedWriteGivesTheBudgetBack(t *testing.T) {
	img, _ := null.New("null", 1<<30, true)
	s := New(img, Options{Name: "disk", Writable: true})
	for range 3 {
		c, done := goClient(t, s, "disk")
		c.request(wire.CmdWrite, 0, 1, 0, 16<<20, make([]byte, 1000)) // larger than the inline buffer, cut short
		c.c.Close()
		<-done
	}
	if in := s.budget.InUse(); in != 0 {
		t.Fatalf("%d bytes of the server's budget kept by clients that are gone", in)
	}
}

// goClient connects a client to s through a pipe and negotiates export
// name with OPT_GO; done closes when the server's side of it has ended.
func goClient(t *testing.T, s *Server, name string) (*client, chan struct{}) {
	t.Helper()
	a, b := net.Pipe()
	cn := newConn(s, pipeStream(t, a), s.log)
	done := make(chan struct{})
	go func() { cn.serve(); close(done) }()
	c := &client{t: t, c: b, r: bufio.NewReader(b)}
	b.SetDeadline(time.Now().Add(20 * time.Second))
	c.greet()
	c.option(wire.OptGo, goData(name))
	return c, done
}
