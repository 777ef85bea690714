package remote

import (
	"bytes"
	"context"
	"errors"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// goid is the calling goroutine's number, from its stack's first line.
func goid() string {
	b := make([]byte, 64)
	b = b[:runtime.Stack(b, false)]
	f := strings.Fields(string(b))
	if len(f) < 2 {
		return ""
	}
	return f[1]
}

// goidBackend records which goroutine made each GET.
type goidBackend struct {
	*memBackend
	mu  sync.Mutex
	ids []string
}

func (g *goidBackend) ReadRangev(ctx context.Context, obj Object, bufs [][]byte, off int64) error {
	g.mu.Lock()
	g.ids = append(g.ids, goid())
	g.mu.Unlock()
	return g.memBackend.ReadRangev(ctx, obj, bufs, off)
}

func (g *goidBackend) last() string {
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.ids) == 0 {
		return ""
	}
	return g.ids[len(g.ids)-1]
}

// A reader whose context has no Done (a serve loop's lone request) makes
// its GET on its own goroutine; a reader that may give up leaves it to a
// fetching goroutine (TestReaderCancelDoesNotWait: the GET goes on for
// others when it does).
func TestReaderThatCannotGiveUpFetchesItself(t *testing.T) {
	g := &goidBackend{memBackend: &memBackend{data: patterned(1 << 20)}}
	f := openMem(t, g.memBackend, Options{})
	f.b = g // the same object, the GETs recorded
	me := goid()
	p := make([]byte, 4096)
	if _, err := f.ReadAt(context.Background(), p, 0); err != nil || !bytes.Equal(p, g.data[:4096]) {
		t.Fatalf("read: %v", err)
	}
	if got := g.last(); got != me {
		t.Fatalf("the GET of a reader that cannot give up ran on goroutine %s, not the reader's (%s)", got, me)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := f.ReadAt(ctx, p, 512<<10); err != nil || !bytes.Equal(p, g.data[512<<10:512<<10+4096]) {
		t.Fatalf("read: %v", err)
	}
	if got := g.last(); got == me || got == "" {
		t.Fatalf("the GET of a reader that may give up ran on the reader's goroutine (%s)", got)
	}
}

// The connection a reader takes for its own GET goes back: with one
// connection, reads one after another (each its own GET), then
// concurrent ones beside a slow GET in flight, all finish with the
// right bytes.
func TestInlineFetchGivesItsConnectionBack(t *testing.T) {
	m := &memBackend{data: patterned(4 << 20)}
	f := openMem(t, m, Options{Connections: 1, ReconnectTimeout: 2 * time.Second})
	p := make([]byte, 4096)
	for i := range 64 {
		off := int64(i) * 64 << 10
		if _, err := f.ReadAt(context.Background(), p, off); err != nil || !bytes.Equal(p, m.data[off:off+4096]) {
			t.Fatalf("read %d at %d: %v", i, off, err)
		}
	}
	f.wg.Wait() // no readahead of the reads above still reads delay
	m.delay = 20 * time.Millisecond
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for i := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			off := int64(64+i) * 32 << 10
			q := make([]byte, 4096)
			ctx := context.Background()
			if i%2 == 1 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithCancel(ctx)
				defer cancel()
			}
			if _, err := f.ReadAt(ctx, q, off); err != nil {
				errs <- err
				return
			}
			if !bytes.Equal(q, m.data[off:off+4096]) {
				errs <- ErrBadReply
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// Close while a reader that cannot give up makes its own GET, which
// hangs: Close cancels that GET (it runs with the file's context, not
// the reader's), waits for it and returns, and the reader gets an error
// rather than hanging until its peer answers.
func TestCloseEndsAnInlineGet(t *testing.T) {
	m := &memBackend{data: patterned(1 << 20), delay: time.Minute}
	f, err := Open(context.Background(), m, Options{ReconnectTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	// Closed on an early failure too, so that the reader's minute-long
	// GET ends with the test (a second Close returns at once).
	t.Cleanup(func() { f.Close() })
	read := make(chan error, 1)
	go func() {
		_, err := f.ReadAt(context.Background(), make([]byte, 4096), 0)
		read <- err
	}()
	for deadline := time.Now().Add(2 * time.Second); m.gets.Load() == 0; {
		if time.Now().After(deadline) {
			t.Fatal("the GET never started")
		}
		time.Sleep(time.Millisecond)
	}
	closed := make(chan error, 1)
	go func() { closed <- f.Close() }()
	select {
	case <-closed:
	case <-time.After(3 * time.Second):
		t.Fatal("Close hangs behind a reader's own GET")
	}
	select {
	case err := <-read:
		if err == nil {
			t.Fatal("the reader whose GET Close cancelled got no error")
		}
	case <-time.After(3 * time.Second):
		t.Fatal("the reader hangs after Close")
	}
}

// A reader's own GET that fails gives its connection back: with one
// connection, a failed inline GET (a permanent error) and then reads of
// both kinds all finish, the later ones with the right bytes.
func TestFailedInlineGetGivesItsConnectionBack(t *testing.T) {
	m := &memBackend{data: patterned(2 << 20)}
	m.fail = func(n int64, _ context.Context) error {
		if n == 1 {
			return errors.New("403 Forbidden")
		}
		return nil
	}
	f := openMem(t, m, Options{Connections: 1, ReconnectTimeout: 2 * time.Second})
	p := make([]byte, 4096)
	if _, err := f.ReadAt(context.Background(), p, 0); err == nil {
		t.Fatal("the failed GET's read got no error")
	}
	done := make(chan error, 1)
	go func() {
		for i, off := range []int64{256 << 10, 0, 1 << 20} {
			ctx := context.Background()
			var cancel context.CancelFunc = func() {}
			if i == 1 {
				ctx, cancel = context.WithCancel(ctx)
			}
			q := make([]byte, 4096)
			_, err := f.ReadAt(ctx, q, off)
			cancel()
			if err == nil && !bytes.Equal(q, m.data[off:off+4096]) {
				err = ErrBadReply
			}
			if err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("reads after a failed inline GET wait for a connection it kept")
	}
}

// A reader that cannot give up, reading more than one GET's worth with
// one connection: it makes the first GET itself with the only connection
// while the next waits for it as a reader's own fetch (before
// readahead); the read finishes with the right bytes, and a reader that
// may give up, sharing a block whose GET the first makes, cancels
// without waiting for it.
func TestInlineReadOfSeveralGetsOnOneConnection(t *testing.T) {
	m := &memBackend{data: patterned(8 << 20)}
	f := openMem(t, m, Options{Connections: 1, ReconnectTimeout: 5 * time.Second})
	p := make([]byte, 2*maxGet+maxGet/2)
	done := make(chan error, 1)
	go func() {
		_, err := f.ReadAt(context.Background(), p, 4096)
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a read of several GETs on one connection hangs")
	}
	if !bytes.Equal(p, m.data[4096:4096+len(p)]) {
		t.Fatal("wrong bytes")
	}

	m.delay = 2 * time.Second // and 1 s to give up: see TestReaderCancelDoesNotWait
	off := int64(6 << 20)
	inl := make(chan error, 1)
	q := make([]byte, 4096)
	go func() {
		_, err := f.ReadAt(context.Background(), q, off)
		inl <- err
	}()
	time.Sleep(20 * time.Millisecond) // its GET is in flight
	ctx, cancel := context.WithCancel(context.Background())
	other := make(chan error, 1)
	go func() {
		_, err := f.ReadAt(ctx, make([]byte, 4096), off)
		other <- err
	}()
	time.Sleep(10 * time.Millisecond)
	cancel()
	select {
	case err := <-other:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("the reader that gave up: %v, want context.Canceled", err)
		}
	case <-time.After(time.Second):
		t.Fatal("a reader that gave up waited for another reader's own GET")
	}
	if err := <-inl; err != nil || !bytes.Equal(q, m.data[off:off+4096]) {
		t.Fatalf("the reader that made the GET: %v", err)
	}
}
