package nbd

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"testing"
	"time"

	exportnbd "github.com/blockexport/blockexport/export/nbd"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/null"
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
			l.ack(l.add(logEntry{cmd: 1, off: int64(next), length: 4096, data: data(next)}))
			if next%7 == 0 { // entries without data mixed in
				l.ack(l.add(logEntry{cmd: 6, off: int64(next), length: 4096}))
			}
			next++
		}
	}
	add(3000) // about 12 MiB: 12 slabs
	l.durable(l.acks / 2)
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

// TestReplayLogStates: the log asks for a flush past flushLogBytes and
// makes writes wait for one past maxLogBytes.
func TestReplayLogStates(t *testing.T) {
	var l replayLog
	chunk := make([]byte, 1<<20)
	var last logState
	for i := 1; i <= 2*flushLogBytes>>20+1; i++ {
		last = l.ack(l.add(logEntry{cmd: 1, length: 1 << 20, data: chunk}))
		want := logRoomy
		switch {
		case int64(i)<<20 > maxLogBytes:
			want = logFull
		case int64(i)<<20 > flushLogBytes:
			want = logFlushSoon
		}
		if last != want {
			t.Fatalf("after %d MiB: state %d, want %d", i, last, want)
		}
	}
}

// heldFlush is an image whose Flush waits until released.
type heldFlush struct {
	formats.Image
	started chan struct{}
	release chan struct{}
}

func (h *heldFlush) Flush(ctx context.Context) error {
	select {
	case h.started <- struct{}{}:
	default:
	}
	<-h.release
	return h.Image.Flush(ctx)
}

// TestReplayLogFlushesInBackground: writes past flushLogBytes do not
// wait for the flush that empties the log (the server holds it here, and
// they go on), up to maxLogBytes; once the flush is done the log is back
// under its bound.
func TestReplayLogFlushesInBackground(t *testing.T) {
	null0, _ := null.New("null", 256<<20, true)
	img0 := &heldFlush{Image: null0, started: make(chan struct{}, 1), release: make(chan struct{})}
	sockPath := filepath.Join(t.TempDir(), "s.sock")
	l, err := net.Listen("unix", sockPath)
	if err != nil {
		t.Fatal(err)
	}
	srv := exportnbd.New(img0, exportnbd.Options{Writable: true, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	go srv.Serve(l)
	t.Cleanup(func() {
		l.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
	})
	a, err := ParseURI("nbd+unix:///?socket=" + sockPath)
	if err != nil {
		t.Fatal(err)
	}
	img, err := Open(context.Background(), a, Options{Writable: true, ReconnectTimeout: 5 * time.Second,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	if !img.replaying() {
		t.Fatal("one connection with a reconnect timeout keeps no replay log")
	}
	chunk := bytes.Repeat([]byte{1}, 1<<20)
	wrote := make(chan error, 1)
	go func() {
		for i := range flushLogBytes>>20 + 16 {
			if _, err := img.WriteAt(context.Background(), chunk, int64(i)<<20); err != nil {
				wrote <- err
				return
			}
		}
		wrote <- nil
	}()
	select {
	case <-img0.started:
	case <-time.After(10 * time.Second):
		t.Fatal("no flush reached the server after 80 MiB of writes")
	}
	select {
	case err := <-wrote:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		close(img0.release)
		t.Fatal("the writes waited for the flush the server held")
	}
	close(img0.release)
	deadline := time.Now().Add(10 * time.Second)
	for {
		img.log.mu.Lock()
		n := img.log.bytes
		img.log.mu.Unlock()
		if n <= flushLogBytes && !img.logFlushing.Load() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the log still holds %d bytes: no background flush emptied it", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
