package remote

import (
	"bytes"
	"context"
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
	g := &goidBackend{memBackend: &memBackend{data: rhData(1 << 20)}}
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
	m := &memBackend{data: rhData(4 << 20)}
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
				errs <- errBadReply
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}
