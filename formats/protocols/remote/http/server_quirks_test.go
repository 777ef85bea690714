package http

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	nethttp "net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/blockexport/blockexport/formats/protocols/remote"
)

// TestChunkedRangeWithoutTerminator: a 206 sent chunked that carries
// the whole range but never its last chunk (the connection left open):
// the read completes when the asked bytes are in, not at the timeout.
func TestChunkedRangeWithoutTerminator(t *testing.T) {
	const size = 1 << 20
	hold := keepOpen(t)
	l, srv := newLiar(t, size, func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
		if r.Method != nethttp.MethodGet || r.Header.Get("Range") == "" {
			return false
		}
		off, last := rangeOf(r)
		c, buf, err := w.(nethttp.Hijacker).Hijack()
		if err != nil {
			panic(err)
		}
		fmt.Fprintf(buf, "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes %d-%d/%d\r\nETag: \"v1\"\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n", off, last, size, last-off+1)
		buf.Write(l.data[off : last+1])
		buf.WriteString("\r\n")
		buf.Flush()
		hold(c)
		return true
	})
	f, err := open(t, srv.URL+"/disk.img", Options{}, 5*time.Second)
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	t0 := time.Now()
	got, err := readAll(f, size)
	if err != nil || !bytes.Equal(got, l.data) {
		t.Fatalf("read: %v", err)
	}
	if d := time.Since(t0); d > 2*time.Second {
		t.Fatalf("reading 1 MiB took %v: each range waited for a terminator", d)
	}
}

// TestStrictIfUnmodifiedSince: a server without ETags that refuses an
// If-Unmodified-Since equal to the object's time (as versitygw 1.8.0
// does) still serves it; a reply with another Last-Modified is ErrChanged.
func TestStrictIfUnmodifiedSince(t *testing.T) {
	const size = 256 << 10
	mtime := time.Unix(1700000000, 0)
	var other bool
	var from int64 // requests up to from (and the open's two) see mtime
	var mu sync.Mutex
	l, srv := newLiar(t, size, func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
		mu.Lock()
		m := mtime
		if other && n > from+2 {
			m = mtime.Add(-time.Hour)
		}
		mu.Unlock()
		if s := r.Header.Get("If-Unmodified-Since"); s != "" {
			since, err := nethttp.ParseTime(s)
			if err != nil || !since.After(m) {
				w.WriteHeader(nethttp.StatusPreconditionFailed)
				return true
			}
			r.Header.Del("If-Unmodified-Since")
		}
		nethttp.ServeContent(w, r, "", m, bytes.NewReader(l.data))
		return true
	})
	f, err := open(t, srv.URL+"/disk.img", Options{}, 2*time.Second)
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	got, err := readAll(f, size)
	if err != nil || !bytes.Equal(got, l.data) {
		t.Fatalf("read from a strict server: %v", err)
	}
	mu.Lock()
	other, from = true, l.n.Load()
	mu.Unlock()
	f2, err := open(t, srv.URL+"/disk.img", Options{}, 2*time.Second)
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	if _, err := readAll(f2, size); !errors.Is(err, remote.ErrChanged) {
		t.Fatalf("a reply with an earlier Last-Modified: %v, want ErrChanged", err)
	}
}

// TestKeptAliveConnectionsClosedByTheServer: the range GETs' own client
// keeps connections between requests; one the server closed meanwhile
// (its idle timeout) is replaced at once, not reported as a failure, and
// the bytes are right whether the body came in one read or many.
func TestKeptAliveConnectionsClosedByTheServer(t *testing.T) {
	const size = 3 << 20
	l := &liar{data: make([]byte, size), etag: `"v1"`}
	for i := range l.data {
		l.data[i] = byte(i * 7 / 5)
	}
	srv := httptest.NewUnstartedServer(l)
	srv.Config.IdleTimeout = 50 * time.Millisecond
	srv.Start()
	t.Cleanup(srv.Close)
	b, err := New(srv.URL+"/disk.img", Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if b.fast == nil {
		t.Fatal("no proxy, plain http: the range GETs should not go through net/http")
	}
	ctx := context.Background()
	obj, err := b.Stat(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i, off := range []int64{0, 12345, 1 << 20, size - 70000} {
		if i > 0 {
			time.Sleep(150 * time.Millisecond) // the server drops the idle connection
		}
		// Blocks of uneven sizes, as the last block of an object is.
		bufs := [][]byte{make([]byte, 16384), make([]byte, 100), make([]byte, 65536-16484), make([]byte, 4000)}
		if err := b.ReadRangev(ctx, obj, bufs, off); err != nil {
			t.Fatalf("read at %d after the server closed the idle connection: %v", off, err)
		}
		got := bytes.Join(bufs, nil)
		if !bytes.Equal(got, l.data[off:off+int64(len(got))]) {
			t.Fatalf("read at %d: wrong bytes", off)
		}
	}
}

// TestUnaskedReplyOnAKeptConnection: a server that sends, after a
// range's reply, a second reply no request asked for (a 206 for the
// range read next, of zeroes) on the connection it keeps open: the
// connection is not used again, and the next range has the object's
// bytes, not the unasked reply's.
func TestUnaskedReplyOnAKeptConnection(t *testing.T) {
	const size = 1 << 20
	hold := keepOpen(t)
	var gets atomic.Int64
	l, srv := newLiar(t, size, func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
		if r.Method != nethttp.MethodGet || r.Header.Get("Range") != "bytes=0-99" || gets.Add(1) > 1 {
			return false
		}
		c, buf, err := w.(nethttp.Hijacker).Hijack()
		if err != nil {
			panic(err)
		}
		fmt.Fprintf(buf, "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-99/%d\r\nETag: \"v1\"\r\nContent-Length: 100\r\n\r\n", size)
		buf.Write(l.data[:100])
		buf.Flush()
		time.Sleep(20 * time.Millisecond)
		fmt.Fprintf(buf, "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 100-199/%d\r\nETag: \"v1\"\r\nContent-Length: 100\r\n\r\n", size)
		buf.Write(make([]byte, 100))
		buf.Flush()
		hold(c)
		return true
	})
	b, err := New(srv.URL+"/disk.img", Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	ctx := context.Background()
	obj, err := b.Stat(ctx)
	if err != nil {
		t.Fatal(err)
	}
	p := make([]byte, 100)
	if err := b.ReadRange(ctx, obj, p, 0); err != nil || !bytes.Equal(p, l.data[:100]) {
		t.Fatalf("first range: %v", err)
	}
	time.Sleep(100 * time.Millisecond) // the unasked reply is in
	if err := b.ReadRange(ctx, obj, p, 100); err != nil {
		t.Fatalf("second range: %v", err)
	}
	if !bytes.Equal(p, l.data[100:200]) {
		t.Fatal("second range: the bytes of a reply nobody asked for")
	}
}

// keepOpen returns hold, which keeps a connection open until the test
// ends: a server that neither finishes nor closes it.
func keepOpen(t *testing.T) (hold func(io.Closer)) {
	var mu sync.Mutex
	var held []io.Closer
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range held {
			c.Close()
		}
	})
	return func(c io.Closer) {
		mu.Lock()
		held = append(held, c)
		mu.Unlock()
	}
}
