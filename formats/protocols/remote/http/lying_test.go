package http

import (
	"bytes"
	"context"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand"
	"net"
	nethttp "net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/formats/protocols/remote"
)

// liar serves one object honestly (http.ServeContent: ranges, ETag,
// If-Match) except where lie says otherwise: lie sees each request (its
// number from 1) and either answers it itself (true) or lets the honest
// server answer.
type liar struct {
	mu    sync.Mutex
	data  []byte
	etag  string
	n     atomic.Int64
	lie   func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool
	heads atomic.Int64
	auth  atomic.Value // the last Authorization header
}

func (l *liar) ServeHTTP(w nethttp.ResponseWriter, r *nethttp.Request) {
	n := l.n.Add(1)
	if r.Method == nethttp.MethodHead {
		l.heads.Add(1)
	}
	l.auth.Store(r.Header.Get("Authorization"))
	if l.lie != nil && l.lie(w, r, n, l) {
		return
	}
	l.mu.Lock()
	data, etag := l.data, l.etag
	l.mu.Unlock()
	w.Header().Set("ETag", etag)
	nethttp.ServeContent(w, r, "", time.Unix(1700000000, 0), bytes.NewReader(data))
}

// replace swaps the object for another version.
func (l *liar) replace(data []byte, etag string) {
	l.mu.Lock()
	l.data, l.etag = data, etag
	l.mu.Unlock()
}

// rangeOf is the range a request asks for.
func rangeOf(r *nethttp.Request) (off, last int64) {
	s := strings.TrimPrefix(r.Header.Get("Range"), "bytes=")
	a, z, _ := strings.Cut(s, "-")
	off, _ = strconv.ParseInt(a, 10, 64)
	last, _ = strconv.ParseInt(z, 10, 64)
	return off, last
}

// raw writes a reply as bytes on the connection and closes it: what a
// ResponseWriter would not let a server say.
func raw(w nethttp.ResponseWriter, head string, body []byte) {
	c, buf, err := w.(nethttp.Hijacker).Hijack()
	if err != nil {
		panic(err)
	}
	buf.WriteString(strings.ReplaceAll(head, "\n", "\r\n") + "\r\n\r\n")
	buf.Write(body)
	buf.Flush()
	c.Close()
}

// reset closes the connection with a TCP reset, nothing sent.
func reset(w nethttp.ResponseWriter) {
	c, _, err := w.(nethttp.Hijacker).Hijack()
	if err != nil {
		panic(err)
	}
	c.(*net.TCPConn).SetLinger(0)
	c.Close()
}

func newLiar(t *testing.T, size int, lie func(nethttp.ResponseWriter, *nethttp.Request, int64, *liar) bool) (*liar, *httptest.Server) {
	l := &liar{data: make([]byte, size), etag: `"v1"`, lie: lie}
	rand.New(rand.NewSource(int64(size))).Read(l.data)
	srv := httptest.NewServer(l)
	t.Cleanup(srv.Close)
	return l, srv
}

// open opens url through the shared layer with a short reconnect timeout.
func open(t *testing.T, url string, o Options, timeout time.Duration) (*remote.File, error) {
	t.Helper()
	b, err := New(url, o)
	if err != nil {
		return nil, err
	}
	f, err := remote.Open(context.Background(), b, remote.Options{Connections: 4, CacheSize: 4 << 20, ReconnectTimeout: timeout,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() { f.Close() })
	return f, nil
}

// readAll reads the object in 64 KiB reads and says how it ended.
func readAll(f *remote.File, size int) ([]byte, error) {
	got := make([]byte, size)
	for off := 0; off < size; off += 65536 {
		if _, err := f.ReadAt(context.Background(), got[off:min(off+65536, size)], int64(off)); err != nil {
			return got[:off], err
		}
	}
	return got, nil
}

func isEIO(err error) bool {
	var en unix.Errno
	return errors.As(err, &en) && en == unix.EIO
}

// Replies that lie about what they carry end in EIO, never wrong bytes
// or zeroes, and never hang past the reconnect timeout.
func TestLyingRepliesAreEIO(t *testing.T) {
	const size = 1 << 20
	for _, tc := range []struct {
		name string
		lie  func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool
	}{
		{"short body", func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
			off, last := rangeOf(r)
			if r.Method != nethttp.MethodGet || off == 0 && last == 0 {
				return false
			}
			raw(w, fmt.Sprintf("HTTP/1.1 206 Partial Content\nETag: \"v1\"\nContent-Range: bytes %d-%d/%d\nContent-Length: %d", off, last, size, last-off+1), l.data[off:off+(last-off+1)/2])
			return true
		}},
		{"206 for another range", func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
			off, last := rangeOf(r)
			if r.Method != nethttp.MethodGet || off == 0 && last == 0 {
				return false
			}
			off, last = off+512, min(last+512, size-1)
			w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", off, last, size))
			w.WriteHeader(nethttp.StatusPartialContent)
			w.Write(l.data[off : last+1])
			return true
		}},
		{"206 right range, body of another", func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
			off, last := rangeOf(r)
			if r.Method != nethttp.MethodGet || off == 0 && last == 0 {
				return false
			}
			w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", off, last, size))
			w.WriteHeader(nethttp.StatusPartialContent)
			w.Write(l.data[0 : last-off+2]) // one byte too many
			return true
		}},
		{"200 whole object", func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
			off, last := rangeOf(r)
			if r.Method != nethttp.MethodGet || off == 0 && last == 0 {
				return false
			}
			w.WriteHeader(nethttp.StatusOK)
			w.Write(l.data)
			return true
		}},
		{"object replaced", func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
			if n == 3 {
				other := bytes.Repeat([]byte{0xee}, size)
				l.replace(other, `"v2"`)
			}
			return false
		}},
		{"object replaced, If-Match ignored", func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
			if n >= 3 {
				r.Header.Del("If-Match")
				l.replace(bytes.Repeat([]byte{0xee}, size), `"v2"`)
			}
			return false
		}},
		{"object shrunk, conditions ignored", func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
			if n >= 3 {
				r.Header.Del("If-Match")
				w.Header().Set("ETag", `"v1"`)
				off, last := rangeOf(r)
				w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", off, last, size-4096))
				w.WriteHeader(nethttp.StatusPartialContent)
				w.Write(l.data[off : last+1])
				return true
			}
			return false
		}},
		{"gzip", func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
			off, last := rangeOf(r)
			if r.Method != nethttp.MethodGet || off == 0 && last == 0 {
				return false
			}
			w.Header().Set("Content-Encoding", "gzip")
			w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", off, last, size))
			w.WriteHeader(nethttp.StatusPartialContent)
			w.Write(l.data[off : last+1])
			return true
		}},
		{"resets forever", func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
			if off, last := rangeOf(r); r.Method != nethttp.MethodGet || off == 0 && last == 0 {
				return false
			}
			reset(w)
			return true
		}},
		{"503 forever", func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
			if off, last := rangeOf(r); r.Method != nethttp.MethodGet || off == 0 && last == 0 {
				return false
			}
			w.WriteHeader(nethttp.StatusServiceUnavailable)
			return true
		}},
		{"trickling", func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
			off, last := rangeOf(r)
			if r.Method != nethttp.MethodGet || off == 0 && last == 0 {
				return false
			}
			w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", off, last, size))
			w.Header().Set("Content-Length", strconv.FormatInt(last-off+1, 10))
			w.WriteHeader(nethttp.StatusPartialContent)
			for i := off; i <= last; i++ {
				if _, err := w.Write(l.data[i : i+1]); err != nil {
					return true
				}
				w.(nethttp.Flusher).Flush()
				select {
				case <-r.Context().Done():
					return true
				case <-time.After(50 * time.Millisecond):
				}
			}
			return true
		}},
		{"hanging", func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
			if off, last := rangeOf(r); r.Method != nethttp.MethodGet || off == 0 && last == 0 {
				return false
			}
			<-r.Context().Done()
			return true
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, srv := newLiar(t, size, tc.lie)
			f, err := open(t, srv.URL+"/disk.img", Options{}, 1500*time.Millisecond)
			if err != nil {
				t.Fatalf("open: %v", err)
			}
			want := append([]byte(nil), l.data...)
			start := time.Now()
			got, err := readAll(f, size)
			took := time.Since(start)
			if !bytes.Equal(got, want[:len(got)]) {
				t.Fatalf("wrong bytes before the error (%d read)", len(got))
			}
			if err == nil || !isEIO(err) {
				t.Fatalf("read all of a lying server's object: err %v, want EIO", err)
			}
			if took > 3*time.Second {
				t.Fatalf("the error took %v, timeout 1.5s", took)
			}
			if strings.Contains(tc.name, "replaced") && !errors.Is(err, remote.ErrChanged) {
				t.Fatalf("replaced object: err %v, want ErrChanged", err)
			}
		})
	}
}

// Bursts of failures shorter than the reconnect timeout are ridden out:
// the right bytes come back.
func TestBurstsAreRetried(t *testing.T) {
	const size = 1 << 20
	for _, tc := range []struct {
		name string
		fail func(w nethttp.ResponseWriter, r *nethttp.Request)
	}{
		{"503", func(w nethttp.ResponseWriter, r *nethttp.Request) { w.WriteHeader(nethttp.StatusServiceUnavailable) }},
		{"429", func(w nethttp.ResponseWriter, r *nethttp.Request) { w.WriteHeader(nethttp.StatusTooManyRequests) }},
		{"reset", func(w nethttp.ResponseWriter, r *nethttp.Request) { reset(w) }},
		{"truncated", func(w nethttp.ResponseWriter, r *nethttp.Request) {
			off, last := rangeOf(r)
			raw(w, fmt.Sprintf("HTTP/1.1 206 Partial Content\nContent-Range: bytes %d-%d/%d\nContent-Length: %d", off, last, size, last-off+1), []byte{})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, srv := newLiar(t, size, func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, _ *liar) bool {
				if n%3 != 0 && n < 12 {
					tc.fail(w, r)
					return true
				}
				return false
			})
			f, err := open(t, srv.URL+"/disk.img", Options{}, 5*time.Second)
			if err != nil {
				t.Fatalf("open: %v", err)
			}
			got, err := readAll(f, size)
			if err != nil || !bytes.Equal(got, l.data) {
				t.Fatalf("read through a burst of %s: %v", tc.name, err)
			}
		})
	}
}

// What is wrong at open fails at open, with one line and no retries
// where a retry cannot help.
func TestOpenRefusals(t *testing.T) {
	const size = 1 << 20
	for _, tc := range []struct {
		name, want string
		lie        func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool
	}{
		{"404", "404", func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
			nethttp.NotFound(w, r)
			return true
		}},
		{"403", "403", func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
			w.WriteHeader(nethttp.StatusForbidden)
			return true
		}},
		{"lying HEAD", "HEAD says", func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
			if r.Method == nethttp.MethodHead {
				w.Header().Set("Content-Length", strconv.Itoa(2*size))
				w.WriteHeader(nethttp.StatusOK)
				return true
			}
			return false
		}},
		{"no ranges", "byte ranges", func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
			w.Write(l.data)
			return true
		}},
		{"Content-Length 2^63", "Content-Length", func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
			raw(w, "HTTP/1.1 206 Partial Content\nContent-Range: bytes 0-0/9223372036854775807\nContent-Length: 9223372036854775808", []byte("x"))
			return true
		}},
		{"size 2^63-1", "9223372036854775807", func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
			if r.Method == nethttp.MethodHead {
				return false
			}
			w.Header().Set("Content-Range", "bytes 0-0/9223372036854775807")
			w.WriteHeader(nethttp.StatusPartialContent)
			w.Write([]byte{1})
			return true
		}},
		{"Content-Range total 2^63", "Content-Range", func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
			if r.Method == nethttp.MethodHead {
				return false
			}
			w.Header().Set("Content-Range", "bytes 0-0/9223372036854775808")
			w.WriteHeader(nethttp.StatusPartialContent)
			w.Write([]byte{1})
			return true
		}},
		{"redirect to another host", "another origin", func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
			nethttp.Redirect(w, r, "http://127.0.0.2:1/disk.img", nethttp.StatusFound)
			return true
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, srv := newLiar(t, size, tc.lie)
			start := time.Now()
			f, err := open(t, srv.URL+"/disk.img", Options{}, 3*time.Second)
			if err == nil {
				t.Fatalf("opened (size %d)", f.Size())
			}
			if !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "\n") {
				t.Fatalf("err %q, want one line with %q", err, tc.want)
			}
			if tc.name != "Content-Length 2^63" && time.Since(start) > time.Second {
				t.Fatalf("a permanent refusal took %v (retried?)", time.Since(start))
			}
		})
	}
}

// A redirect within the origin is followed; to another origin only when
// allowed.
func TestRedirects(t *testing.T) {
	const size = 256 << 10
	target, tsrv := newLiar(t, size, nil)
	_, same := newLiar(t, size, func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
		if r.URL.Path == "/old.img" {
			nethttp.Redirect(w, r, "/disk.img", nethttp.StatusMovedPermanently)
			return true
		}
		return false
	})
	f, err := open(t, same.URL+"/old.img", Options{}, time.Second)
	if err != nil {
		t.Fatalf("same-origin redirect: %v", err)
	}
	f.Close()
	_, other := newLiar(t, size, func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
		nethttp.Redirect(w, r, tsrv.URL+"/disk.img", nethttp.StatusFound)
		return true
	})
	if _, err := open(t, other.URL+"/disk.img", Options{}, time.Second); err == nil || !strings.Contains(err.Error(), "allow-redirects") {
		t.Fatalf("cross-origin redirect: %v", err)
	}
	f, err = open(t, other.URL+"/disk.img", Options{AllowRedirects: true}, time.Second)
	if err != nil {
		t.Fatalf("allowed cross-origin redirect: %v", err)
	}
	got, err := readAll(f, size)
	if err != nil || !bytes.Equal(got, target.data) {
		t.Fatalf("read through an allowed redirect: %v", err)
	}
}

// Credentials in the URL authenticate and never show in errors or names.
func TestCredentialsNeverShown(t *testing.T) {
	l, srv := newLiar(t, 4096, func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
		if r.URL.Path == "/missing" {
			nethttp.NotFound(w, r)
			return true
		}
		return false
	})
	u := strings.Replace(srv.URL, "http://", "http://alice:s3cr3tpw@", 1)
	f, err := open(t, u+"/disk.img?X-Amz-Signature=deadbeefsig", Options{}, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if a, _ := l.auth.Load().(string); !strings.HasPrefix(a, "Basic ") {
		t.Fatalf("no basic auth from the URL's user: %q", a)
	}
	for _, s := range []string{f.Name()} {
		if strings.Contains(s, "s3cr3tpw") || strings.Contains(s, "deadbeefsig") || strings.Contains(s, "alice") {
			t.Fatalf("name shows credentials: %s", s)
		}
	}
	_, err = open(t, u+"/missing?X-Amz-Signature=deadbeefsig", Options{}, time.Second)
	if err == nil || strings.Contains(err.Error(), "s3cr3tpw") || strings.Contains(err.Error(), "deadbeefsig") {
		t.Fatalf("error shows credentials: %v", err)
	}
	// A connection refused: net/http's own error quotes the URL.
	_, err = open(t, "http://alice:s3cr3tpw@127.0.0.1:1/x?sig=deadbeefsig", Options{}, time.Second)
	if err == nil || strings.Contains(err.Error(), "s3cr3tpw") || strings.Contains(err.Error(), "deadbeefsig") {
		t.Fatalf("error shows credentials: %v", err)
	}
	if _, err := New("http://alice:s3cr3tpw@[::1/x", Options{}); err == nil || strings.Contains(err.Error(), "s3cr3tpw") {
		t.Fatalf("parse error shows credentials: %v", err)
	}
}

// https: the server's certificate is verified against --tls-ca (or the
// system's roots, which do not know the test's CA: refused at once).
func TestTLSVerified(t *testing.T) {
	l := &liar{data: make([]byte, 64<<10), etag: `"v1"`}
	srv := httptest.NewTLSServer(l)
	t.Cleanup(srv.Close)
	start := time.Now()
	if _, err := open(t, srv.URL+"/disk.img", Options{}, 5*time.Second); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("unknown CA: %v", err)
	}
	if time.Since(start) > 2*time.Second {
		t.Fatal("a certificate failure was retried")
	}
	ca := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := open(t, srv.URL+"/disk.img", Options{TLSCA: ca}, time.Second)
	if err != nil {
		t.Fatalf("with --tls-ca: %v", err)
	}
	if got, err := readAll(f, len(l.data)); err != nil || !bytes.Equal(got, l.data) {
		t.Fatal(err)
	}
}

// An empty object opens with size 0; a HEAD refused (a presigned GET URL)
// is skipped.
func TestEmptyObjectAndRefusedHead(t *testing.T) {
	_, srv := newLiar(t, 0, nil)
	f, err := open(t, srv.URL+"/empty", Options{}, time.Second)
	if err != nil || f.Size() != 0 {
		t.Fatalf("empty object: %v", err)
	}
	l, srv2 := newLiar(t, 8192, func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
		if r.Method == nethttp.MethodHead {
			w.WriteHeader(nethttp.StatusForbidden)
			return true
		}
		return false
	})
	f, err = open(t, srv2.URL+"/x", Options{}, time.Second)
	if err != nil {
		t.Fatalf("HEAD refused: %v", err)
	}
	if got, err := readAll(f, 8192); err != nil || !bytes.Equal(got, l.data) {
		t.Fatal(err)
	}
}

// A weak ETag cannot be matched with If-Match (RFC 9110 compares
// strongly): the GETs are conditional on Last-Modified instead, and the
// ETag each reply carries is compared, so a replacement with the same
// modification time is still caught.
func TestWeakETag(t *testing.T) {
	const size = 1 << 20
	var sawIfMatch atomic.Bool
	l, srv := newLiar(t, size, func(w nethttp.ResponseWriter, r *nethttp.Request, n int64, l *liar) bool {
		if r.Header.Get("If-Match") != "" {
			sawIfMatch.Store(true)
		}
		return false
	})
	l.replace(l.data, `W/"v1"`)
	f, err := open(t, srv.URL+"/disk.img", Options{}, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	p := make([]byte, 4096)
	if _, err := f.ReadAt(context.Background(), p, 0); err != nil || !bytes.Equal(p, l.data[:4096]) {
		t.Fatalf("read: %v", err)
	}
	if sawIfMatch.Load() {
		t.Fatal("If-Match sent with a weak ETag (every GET would fail 412)")
	}
	l.replace(bytes.Repeat([]byte{7}, size), `W/"v2"`)
	if _, err := f.ReadAt(context.Background(), p, 512<<10); !isEIO(err) || !errors.Is(err, remote.ErrChanged) {
		t.Fatalf("read after a replacement with the same Last-Modified: %v, want EIO (changed)", err)
	}
}
