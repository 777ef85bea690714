package nbd

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
)

// logCount is a slog handler that counts records (and keeps their
// messages), to bound what a storm logs.
type logCount struct {
	mu   sync.Mutex
	msgs []string
}

func (h *logCount) Enabled(context.Context, slog.Level) bool { return true }

func (h *logCount) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if r.Level >= slog.LevelInfo {
		h.msgs = append(h.msgs, r.Message)
	}
	return nil
}

func (h *logCount) WithAttrs([]slog.Attr) slog.Handler { return h }

func (h *logCount) WithGroup(string) slog.Handler { return h }

func (h *logCount) lines() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.msgs...)
}

// fullInfo is a first connection that negotiated everything.
func fullInfo() fakeInfo {
	return fakeInfo{
		extended: true, structured: true, alloc: true, min: 512, pref: 4096, max: 1 << 20,
		flags: wire.FlagSendFlush | wire.FlagSendFUA | wire.FlagSendTrim | wire.FlagSendZeroes |
			wire.FlagSendFastZero | wire.FlagCanMultiConn,
	}
}

// TestReconnectMustCarryWhatWasPromised: the server comes back (after a
// hang-up) lacking one thing the first connection negotiated; every
// request then fails with EIO, nothing is sent reshaped to fit the new
// connection, and the change is logged once. Coming back the same works.
func TestReconnectMustCarryWhatWasPromised(t *testing.T) {
	less := map[string]func(i *fakeInfo){
		"no extended headers":   func(i *fakeInfo) { i.extended = false },
		"no structured replies": func(i *fakeInfo) { i.extended, i.structured = false, false },
		"no base:allocation":    func(i *fakeInfo) { i.alloc = false },
		"minimum block 4096":    func(i *fakeInfo) { i.min = 4096 },
		"maximum block 64 KiB":  func(i *fakeInfo) { i.max = 64 << 10 },
		"no SEND_FLUSH":         func(i *fakeInfo) { i.flags &^= wire.FlagSendFlush },
		"no SEND_FUA":           func(i *fakeInfo) { i.flags &^= wire.FlagSendFUA },
		"no SEND_TRIM":          func(i *fakeInfo) { i.flags &^= wire.FlagSendTrim },
		"no SEND_WRITE_ZEROES":  func(i *fakeInfo) { i.flags &^= wire.FlagSendZeroes },
		"no SEND_FAST_ZERO":     func(i *fakeInfo) { i.flags &^= wire.FlagSendFastZero },
		// One connection needs no consistency between connections.
		"no CAN_MULTI_CONN, one connection (ok)": func(i *fakeInfo) { i.flags &^= wire.FlagCanMultiConn },
		"read-only":                              func(i *fakeInfo) { i.flags |= wire.FlagReadOnly },
		"another size":                           func(i *fakeInfo) { i.size = 2 << 20 },
		"the same (works)":                       func(*fakeInfo) {},
		"more than before (ok)":                  func(i *fakeInfo) { i.min, i.max, i.flags = 1, 32<<20, i.flags|wire.FlagSendCache },
		"another preferred (ok)":                 func(i *fakeInfo) { i.pref = 65536 },
	}
	for name, change := range less {
		t.Run(name, func(t *testing.T) {
			f := newFakeNBD(t, 1<<20, func(n int) fakeInfo {
				i := fullInfo()
				if n > 0 {
					change(&i)
				}
				return i
			})
			var hungUp atomic.Bool
			f.handle = func(q fakeReq, _ fakeInfo) ([]byte, bool) {
				// The first connection hangs up on its first request
				// after the test's first write.
				if q.conn == 0 && q.cmd == wire.CmdWriteZeroes && hungUp.CompareAndSwap(false, true) {
					return nil, true
				}
				return nil, false
			}
			logs := &logCount{}
			img := f.open(Options{Writable: true, ReconnectTimeout: 2 * time.Second, Logger: slog.New(logs)})
			ctx := context.Background()
			ops := []func() error{
				// 5 GiB of zeroes would not fit a compact header: here
				// the export is 1 MiB, so a long zeroing and a trim.
				func() error { return img.WriteZeroes(ctx, 0, 1<<20, false) },
				func() error { _, err := img.ReadAt(ctx, make([]byte, 512), 512); return err },
				func() error { return img.Flush(ctx) },
				func() error { _, err := img.WriteAt(ctx, make([]byte, 512), 1024); return err },
				func() error { _, err := img.Extent(ctx, 0, 1<<20); return err },
			}
			ok := strings.HasSuffix(name, "(works)") || strings.HasSuffix(name, "(ok)")
			for i, op := range ops {
				began := time.Now()
				err := op()
				if ok {
					// The flush after the reconnect may report writes lost
					// with the connection; nothing else fails.
					if err != nil && i != 2 {
						t.Fatalf("op %d after coming back the same: %v", i, err)
					}
					continue
				}
				if !errors.Is(err, syscall.EIO) {
					t.Fatalf("op %d after the export came back lacking it: %v, want EIO", i, err)
				}
				if took := time.Since(began); took > time.Second {
					t.Fatalf("op %d took %v to fail (%v): a changed export is no outage to wait for", i, took, err)
				}
			}
			if ok {
				return
			}
			for _, q := range f.requests() {
				if q.conn > 0 {
					t.Fatalf("a request reached the lesser connection: %+v", q)
				}
			}
			n := 0
			for _, m := range logs.lines() {
				if strings.Contains(m, "unable to carry") {
					n++
				}
			}
			if n != 1 {
				t.Fatalf("the change was logged %d times, want once: %q", n, logs.lines())
			}
		})
	}
}

// TestReconnectLesserServesAReader: a client that never writes goes on
// reading from a server that came back read-only, without any write-type
// command and (with two connections) still offering CAN_MULTI_CONN, and
// one that lost CAN_MULTI_CONN fails a reader with two connections.
func TestReconnectLesserServesAReader(t *testing.T) {
	for _, multi := range []bool{true, false} {
		f := newFakeNBD(t, 1<<20, func(n int) fakeInfo {
			i := fullInfo()
			if n >= 2 { // the two first connections are the opening ones
				i.flags |= wire.FlagReadOnly
				i.flags &^= wire.FlagSendFlush | wire.FlagSendFUA | wire.FlagSendTrim | wire.FlagSendZeroes | wire.FlagSendFastZero
				if !multi {
					i.flags &^= wire.FlagCanMultiConn
				}
			}
			return i
		})
		var hungUp atomic.Bool
		f.handle = func(q fakeReq, _ fakeInfo) ([]byte, bool) {
			return nil, q.conn < 2 && q.cmd == wire.CmdRead && hungUp.CompareAndSwap(false, true)
		}
		img := f.open(Options{Connections: 2, ReconnectTimeout: 2 * time.Second})
		ctx := context.Background()
		for i := 0; i < 4; i++ { // both connections break, one after the other
			hungUp.Store(false)
			_, err := img.ReadAt(ctx, make([]byte, 512), 512)
			switch {
			case multi && err != nil:
				t.Fatalf("read %d from a server that came back read-only: %v", i, err)
			case !multi && i == 0 && !errors.Is(err, syscall.EIO):
				t.Fatalf("read from a server that lost CAN_MULTI_CONN under two connections: %v, want EIO", err)
			}
		}
	}
}

// TestReconnectStormIsBounded: a server that completes every handshake
// and hangs up on every WRITE: a write fails with EIO after about the
// reconnect timeout, with few attempts (backing off), and the storm is a
// few log lines, not one per reconnect.
//
// With one connection the write is also in the replay log, which each
// reconnect sends first; with two there is no log, and the request's own
// retries must be bounded.
func TestReconnectStormIsBounded(t *testing.T) {
	for _, conns := range []int{1, 2} {
		t.Run(map[int]string{1: "one connection", 2: "two connections"}[conns], func(t *testing.T) {
			testReconnectStorm(t, conns)
		})
	}
}

func testReconnectStorm(t *testing.T, conns int) {
	f := newFakeNBD(t, 1<<20, func(int) fakeInfo {
		return fakeInfo{structured: true, min: 1, pref: 4096, max: 1 << 20, flags: wire.FlagCanMultiConn}
	})
	f.handle = func(q fakeReq, _ fakeInfo) ([]byte, bool) { return nil, q.cmd == wire.CmdWrite }
	logs := &logCount{}
	const timeout = time.Second
	img := f.open(Options{Writable: true, Connections: conns, ReconnectTimeout: timeout, Logger: slog.New(logs)})
	done := make(chan error, 1)
	began := time.Now()
	go func() {
		_, err := img.WriteAt(context.Background(), make([]byte, 4096), 0)
		done <- err
	}()
	select {
	case err := <-done:
		took := time.Since(began)
		if !errors.Is(err, syscall.EIO) || took < timeout/2 || took > 3*timeout {
			t.Fatalf("write: %v after %v; want EIO after about %v", err, took, timeout)
		}
	case <-time.After(10 * timeout):
		t.Fatal("the write retried for ever")
	}
	writes := 0
	for _, q := range f.requests() {
		if q.cmd == wire.CmdWrite {
			writes++
		}
	}
	// At once, then 50, 100, 200, 400 ms...: about 6 in a second.
	if writes < 2 || writes > 12 {
		t.Fatalf("the write was sent %d times in %v", writes, timeout)
	}
	if l := logs.lines(); len(l) > 3 {
		t.Fatalf("the storm logged %d lines: %q", len(l), l)
	}
}

// TestUnalignedWriteIsSerialised: an unaligned write reads its block and
// writes it back; an aligned write of the same block sent in between
// must not be undone. The server holds the read until the aligned write
// was sent (or a moment passed, when the client holds it back, as it
// must).
func TestUnalignedWriteIsSerialised(t *testing.T) {
	f := newFakeNBD(t, 1<<20, func(int) fakeInfo { return fakeInfo{structured: true, min: 4096, pref: 4096, max: 1 << 20} })
	alignedSent := make(chan struct{})
	var once, first sync.Once
	readHeld := make(chan struct{})
	f.handle = func(q fakeReq, info fakeInfo) ([]byte, bool) {
		held := false
		if q.cmd == wire.CmdRead {
			first.Do(func() { held = true })
		}
		switch {
		case held:
			close(readHeld)
			select {
			case <-alignedSent:
			case <-time.After(500 * time.Millisecond):
			}
			// The server's worker pool answers in its own order: the
			// read goes out, then whatever came meanwhile.
		case q.cmd == wire.CmdWrite && q.length == 4096 && q.payload[0] == 0xbb:
			once.Do(func() { close(alignedSent) })
		}
		return nil, false
	}
	img := f.open(Options{Writable: true})
	ctx := context.Background()
	unaligned := make(chan error, 1)
	go func() {
		_, err := img.WriteAt(ctx, bytes.Repeat([]byte{0xaa}, 512), 512)
		unaligned <- err
	}()
	<-readHeld
	if _, err := img.WriteAt(ctx, bytes.Repeat([]byte{0xbb}, 4096), 0); err != nil {
		t.Fatal(err)
	}
	if err := <-unaligned; err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4096)
	if _, err := img.ReadAt(ctx, got, 0); err != nil {
		t.Fatal(err)
	}
	// Either order is right: the aligned write whole, or it with the
	// unaligned one's 512 bytes on top; zeroes mean it was undone.
	allB := bytes.Repeat([]byte{0xbb}, 4096)
	withA := bytes.Clone(allB)
	copy(withA[512:1024], bytes.Repeat([]byte{0xaa}, 512))
	if !bytes.Equal(got, allB) && !bytes.Equal(got, withA) {
		t.Fatalf("the block reads %x...: the aligned write was undone by the read-modify-write", got[:8])
	}
}

// TestWriteLoggedBeforeSent: a write is in the replay log before the
// server sees it, so that a reconnect whose replay runs between the
// server's acknowledgement and the write's return cannot miss it.
func TestWriteLoggedBeforeSent(t *testing.T) {
	f := newFakeNBD(t, 1<<20, func(int) fakeInfo { return fakeInfo{structured: true} })
	seen, hold := make(chan struct{}), make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(hold) }) }
	t.Cleanup(release)
	f.handle = func(q fakeReq, _ fakeInfo) ([]byte, bool) {
		if q.cmd == wire.CmdWrite {
			close(seen)
			<-hold
		}
		return nil, false
	}
	img := f.open(Options{Writable: true, ReconnectTimeout: 5 * time.Second})
	wrote := make(chan error, 1)
	go func() {
		_, err := img.WriteAt(context.Background(), bytes.Repeat([]byte{1}, 4096), 8192)
		wrote <- err
	}()
	<-seen
	img.log.mu.Lock()
	logged := len(img.log.entries) == 1 && img.log.entries[0].off == 8192
	img.log.mu.Unlock()
	release()
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}
	if !logged {
		t.Fatal("the server had the write before the replay log did")
	}
	img.log.mu.Lock()
	defer img.log.mu.Unlock()
	if len(img.log.entries) != 1 || img.log.entries[0].state != entryAcked {
		t.Fatalf("after its acknowledgement the log holds %+v", img.log.entries)
	}
}

// TestReconnectStormWithReadsBetween: the server hangs up on every WRITE
// but answers reads, so that outages end and begin again, over and
// over: that is one storm, logged in a few lines, not lines per outage.
func TestReconnectStormWithReadsBetween(t *testing.T) {
	f := newFakeNBD(t, 1<<20, func(int) fakeInfo { return fakeInfo{structured: true} })
	f.handle = func(q fakeReq, _ fakeInfo) ([]byte, bool) { return nil, q.cmd == wire.CmdWrite }
	logs := &logCount{}
	img := f.open(Options{Writable: true, ReconnectTimeout: 100 * time.Millisecond, Logger: slog.New(logs)})
	ctx := context.Background()
	for range 8 {
		if _, err := img.ReadAt(ctx, make([]byte, 4096), 0); err != nil {
			t.Fatal(err)
		}
		if _, err := img.WriteAt(ctx, make([]byte, 4096), 0); !errors.Is(err, syscall.EIO) {
			t.Fatalf("write: %v, want EIO", err)
		}
	}
	if _, err := img.ReadAt(ctx, make([]byte, 4096), 0); err != nil {
		t.Fatal(err)
	}
	if l := logs.lines(); len(l) > 3 {
		t.Fatalf("8 outages in a row logged %d lines: %q", len(l), l)
	}
}

// TestReconnectToAStalledServerKeepsTheTimeout: the server comes back,
// accepts, and never says a word; the request still fails with EIO by
// ReconnectTimeout, not after the handshake's own, much longer, limit.
func TestReconnectToAStalledServerKeepsTheTimeout(t *testing.T) {
	f := newFakeNBD(t, 1<<20, func(n int) fakeInfo {
		i := fullInfo()
		i.silent = n > 0
		return i
	})
	f.handle = func(q fakeReq, _ fakeInfo) ([]byte, bool) {
		return nil, q.conn == 0 && q.cmd == wire.CmdWrite // hang up on the first write
	}
	img := f.open(Options{Writable: true, ReconnectTimeout: time.Second})
	began := time.Now()
	_, err := img.WriteAt(context.Background(), make([]byte, 512), 0)
	if !errors.Is(err, syscall.EIO) {
		t.Fatalf("a write while the server stalls: %v, want EIO", err)
	}
	if took := time.Since(began); took > 5*time.Second {
		t.Fatalf("the write took %v to fail with a 1 s reconnect timeout (%v)", took, err)
	}
}
