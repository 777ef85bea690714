package http

import (
	"bytes"
	"context"
	"encoding/pem"
	"errors"
	"fmt"
	nethttp "net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/blockexport/blockexport/formats/remote"
)

// A lone reader's GET spins for its reply before it sleeps in the poller
// (replySpin). These drive that read over plain TCP and TLS with replies
// that come inside the spin, after it, in pieces, never, or cut short:
// the right bytes or an error, and the context's deadline still holds.
func TestLoneReadsSpinThenSleep(t *testing.T) {
	for _, tlsOn := range []bool{false, true} {
		t.Run(map[bool]string{false: "http", true: "https"}[tlsOn], func(t *testing.T) {
			const size = 1 << 20
			var mode sync.Map // range start -> what the server does
			l := &liar{data: make([]byte, size), etag: `"v1"`}
			for i := range l.data {
				l.data[i] = byte(i*7 + i>>12)
			}
			var done = make(chan struct{})
			l.lie = func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
				if r.Method != nethttp.MethodGet {
					return false
				}
				off, last := rangeOf(r)
				m, _ := mode.Load(off)
				if m == nil {
					return false
				}
				c, buf, err := w.(nethttp.Hijacker).Hijack()
				if err != nil {
					panic(err)
				}
				defer c.Close()
				body := l.data[off : last+1]
				head := fmt.Sprintf("HTTP/1.1 206 Partial Content\r\nContent-Range: bytes %d-%d/%d\r\nETag: \"v1\"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n", off, last, size, len(body))
				switch m {
				case "trickle": // the head after the spin, the body in three pieces
					time.Sleep(3 * time.Millisecond)
					buf.WriteString(head)
					buf.Flush()
					for k := 0; k < 3; k++ {
						time.Sleep(2 * time.Millisecond)
						buf.Write(body[k*len(body)/3 : (k+1)*len(body)/3])
						buf.Flush()
					}
				case "hang":
					select {
					case <-done:
					case <-time.After(10 * time.Second):
					}
				case "cut": // half the body, then the end of the stream
					buf.WriteString(head)
					buf.Write(body[:len(body)/2])
					buf.Flush()
				}
				return true
			}
			var srv *httptest.Server
			var o Options
			if tlsOn {
				srv = httptest.NewTLSServer(l)
				ca := filepath.Join(t.TempDir(), "ca.pem")
				if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600); err != nil {
					t.Fatal(err)
				}
				o.TLSCA = ca
			} else {
				srv = httptest.NewServer(l)
			}
			t.Cleanup(srv.Close)
			t.Cleanup(func() { close(done) })
			b, err := New(srv.URL+"/disk.img", o)
			if err != nil {
				t.Fatal(err)
			}
			defer b.Close()
			if b.fast == nil {
				t.Fatal("the range GETs do not go through the fast client")
			}
			obj, err := b.Stat(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			lone := remote.Lone(context.Background())
			read := func(ctx context.Context, off, n int64) error {
				p := make([]byte, n)
				if err := b.ReadRange(ctx, obj, p, off); err != nil {
					return err
				}
				if !bytes.Equal(p, l.data[off:off+n]) {
					return errors.New("wrong bytes")
				}
				return nil
			}
			// Honest replies on a kept-alive connection, of sizes that take
			// one read and several.
			for k := int64(0); k < 64; k++ {
				n := int64(4096) << (k % 6)
				if err := read(lone, k*12345%(size-n), n); err != nil {
					t.Fatalf("honest reply %d: %v", k, err)
				}
			}
			mode.Store(int64(4096), "trickle")
			if err := read(lone, 4096, 64<<10); err != nil {
				t.Fatalf("a reply in pieces, after the spin: %v", err)
			}
			mode.Store(int64(8192), "hang")
			ctx, cancel := context.WithTimeout(lone, 200*time.Millisecond)
			defer cancel()
			start := time.Now()
			if err := read(ctx, 8192, 4096); err == nil {
				t.Fatal("a reply that never comes: no error")
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Fatalf("a reply that never comes: the 200 ms deadline ended the read after %v", d)
			}
			mode.Store(int64(12288), "cut")
			if err := read(lone, 12288, 64<<10); err == nil || !errors.Is(err, remote.ErrTemporary) {
				t.Fatalf("a body cut short: %v, want a temporary error", err)
			}
			// The connections left are still good for the next reader.
			if err := read(lone, 1<<19, 4096); err != nil {
				t.Fatalf("after the faults: %v", err)
			}
		})
	}
}

// IsLone sees Lone's mark through contexts derived from it, and only
// there.
func TestLoneMark(t *testing.T) {
	ctx, cancel := context.WithTimeout(remote.Lone(context.Background()), time.Second)
	defer cancel()
	if !remote.IsLone(ctx) || remote.IsLone(context.Background()) {
		t.Fatal("IsLone: " + strconv.FormatBool(remote.IsLone(ctx)))
	}
}
