package http

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	nethttp "net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/blockexport/blockexport/formats/protocols/remote"
)

// FuzzCheckPartial: whatever a server puts in Content-Range and
// Content-Length, a reply passes only when it is exactly the range asked
// of an object of the size opened (or ErrChanged says the size moved); no
// panic, no overflow.
func FuzzCheckPartial(f *testing.F) {
	const top = int64(1<<63 - 1)
	for _, s := range []struct {
		cr         string
		cl, off, n int64
		size       int64
	}{
		{"bytes 0-0/1", 1, 0, 1, 1},
		{"bytes 0-9/10", 10, 0, 10, 10},
		{"bytes 9223372036854775806-9223372036854775806/9223372036854775807", 1, top - 1, 1, top},
		{"bytes 0-0/9223372036854775808", 1, 0, 1, remote.MaxSize},
		{"bytes 4611686018427387903-4611686018427387903/4611686018427387904", 1, remote.MaxSize - 1, 1, remote.MaxSize},
		{"bytes -1-0/5", 2, -1, 2, 5},
		{"bytes 0-18446744073709551615/*", -1, 0, 1, 1},
		{"bytes 00000000000000000001-2/3", 2, 1, 2, 3},
		{"bytes 1-2/*", -1, 1, 2, 3},
		{"bytes 5-4/10", 0, 5, 0, 10},
		{"bytes +1-2/3", 2, 1, 2, 3},
	} {
		f.Add(s.cr, s.cl, s.off, s.n, s.size)
	}
	f.Fuzz(func(t *testing.T, cr string, cl, off, n, size int64) {
		if n <= 0 || off < 0 || size < 0 || off > size-n {
			return // the caller never asks such a range
		}
		err := remote.CheckPartial(cr, cl, off, n, size)
		if err != nil {
			return
		}
		first, last, total, perr := remote.ParseContentRange(cr)
		if perr != nil || first != off || last != off+n-1 || total >= 0 && total != size || cl >= 0 && cl != n {
			t.Fatalf("accepted %q (Content-Length %d) for %d+%d of %d", cr, cl, off, n, size)
		}
	})
}

// fakeReply answers every request with what the fuzzer chose: a status,
// a Content-Range, a Content-Length, an ETag and a body of the object's
// bytes from where the Content-Range claims (so a claim accepted for the
// wrong range would show as wrong bytes), cut or padded to bodyLen.
type fakeReply struct {
	data             []byte
	status           int
	cr, etag         string
	contentLength    int64
	bodyLen, bodyOff int
}

func (f *fakeReply) RoundTrip(r *nethttp.Request) (*nethttp.Response, error) {
	body := f.body()
	h := nethttp.Header{}
	if f.cr != "" {
		h.Set("Content-Range", f.cr)
	}
	if f.etag != "" {
		h.Set("ETag", f.etag)
	}
	return &nethttp.Response{StatusCode: f.status, Status: strconv.Itoa(f.status), Header: h, ContentLength: f.contentLength,
		Body: io.NopCloser(bytes.NewReader(body)), Request: r}, nil
}

// body is the reply's body: the object's bytes from where the
// Content-Range claims, cut or padded to bodyLen. The claim is what a
// reader of the wire sees: the value up to its first CR or LF, the rest
// being another header line.
func (f *fakeReply) body() []byte {
	start := f.bodyOff
	claim, _, _ := strings.Cut(strings.ReplaceAll(f.cr, "\r", "\n"), "\n")
	if first, _, _, err := remote.ParseContentRange(claim); err == nil && first < int64(len(f.data)) {
		start = int(first)
	}
	body := make([]byte, 0, max(f.bodyLen, 0))
	for i := 0; i < f.bodyLen; i++ {
		body = append(body, f.data[(start+i)%len(f.data)])
	}
	return body
}

// wire is the reply as bytes on the connection, for the fast client: no
// Content-Length header when contentLength is negative (the body then
// ends with the connection), header values as the fuzzer made them, CR
// and LF included.
func (f *fakeReply) wire() []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "HTTP/1.1 %d Fuzzed\r\n", f.status)
	if f.cr != "" {
		fmt.Fprintf(&b, "Content-Range: %s\r\n", f.cr)
	}
	if f.etag != "" {
		fmt.Fprintf(&b, "ETag: %s\r\n", f.etag)
	}
	if f.contentLength >= 0 {
		fmt.Fprintf(&b, "Content-Length: %d\r\n", f.contentLength)
	}
	b.WriteString("Connection: close\r\n\r\n")
	b.Write(f.body())
	return b.Bytes()
}

// wireServer answers every connection with the reply in next, then
// hangs up.
type wireServer struct {
	ln   net.Listener
	next atomic.Pointer[[]byte]
}

func newWireServer(f *testing.F) *wireServer {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		f.Fatal(err)
	}
	s := &wireServer{ln: ln}
	f.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				c.SetDeadline(time.Now().Add(5 * time.Second))
				r := bufio.NewReader(c)
				for { // the request's head
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					if line == "\r\n" {
						break
					}
				}
				if p := s.next.Load(); p != nil {
					c.Write(*p)
				}
			}()
		}
	}()
	return s
}

// FuzzReadRange: whatever the reply, ReadRange either fills p with exactly
// the object's bytes at off or fails; it never panics. Both clients get
// the same reply: net/http's (through a fake transport) and the fast
// HTTP/1.1 client (from a local server that writes it on the wire).
func FuzzReadRange(f *testing.F) {
	f.Add(206, "bytes 100-199/4096", `"v1"`, int64(100), 100, 0, int64(100), 100)
	f.Add(206, "bytes 101-200/4096", `"v1"`, int64(100), 100, 0, int64(100), 100)
	f.Add(206, "bytes 100-199/4096", `"v1"`, int64(100), 99, 0, int64(100), 100)
	f.Add(206, "bytes 100-199/4096", `"v1"`, int64(100), 101, 0, int64(100), 100)
	f.Add(206, "bytes 100-199/*", "", int64(-1), 100, 0, int64(100), 100)
	f.Add(200, "", `"v1"`, int64(4096), 4096, 0, int64(0), 4096)
	f.Add(206, "bytes 0-4095/9223372036854775807", `"v1"`, int64(4096), 4096, 0, int64(0), 4096)
	f.Add(206, "bytes 4000-4095/4096", `"v2"`, int64(96), 96, 0, int64(4000), 96)
	f.Add(412, "", "", int64(0), 0, 0, int64(0), 10)
	f.Add(206, "bytes 0-9/4096\r\nContent-Length: 10", `"v1"`, int64(-1), 10, 0, int64(0), 10)
	srv := newWireServer(f)
	url := "http://" + srv.ln.Addr().String() + "/disk.img"
	data := make([]byte, 4096)
	for i := range data {
		data[i] = byte(i*7 + i/256)
	}
	f.Fuzz(func(t *testing.T, status int, cr, etag string, contentLength int64, bodyLen, bodyOff int, off int64, n int) {
		const size = 4096
		if n <= 0 || n > size || off < 0 || off > size-int64(n) || bodyLen > 3*size || bodyOff < 0 {
			return
		}
		if status < 100 || status > 999 {
			return
		}
		reply := &fakeReply{data: data, status: status, cr: cr, etag: etag, contentLength: contentLength,
			bodyLen: bodyLen, bodyOff: bodyOff % size}
		wire := reply.wire()
		srv.next.Store(&wire)
		for _, fast := range []bool{false, true} {
			b, err := New(url, Options{})
			if err != nil {
				t.Fatal(err)
			}
			if fast != (b.fast != nil) {
				if fast {
					t.Fatal("no fast client for a plain http URL on loopback")
				}
				b.slow.Store(true) // net/http's client from the start
			}
			b.client.Transport = reply
			p := make([]byte, n)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			err = b.ReadRange(ctx, remote.Object{Size: size, ETag: `"v1"`}, p, off)
			cancel()
			b.Close()
			if err == nil && !bytes.Equal(p, data[off:off+int64(n)]) {
				t.Fatalf("fast client %v accepted wrong bytes: status %d Content-Range %q Content-Length %d body %d", fast, status, cr, contentLength, bodyLen)
			}
			// And a true reply is taken.
			exact := fmt.Sprintf("bytes %d-%d/%d", off, off+int64(n)-1, size)
			if err != nil && status == 206 && cr == exact && (contentLength == int64(n) || contentLength == -1) &&
				bodyLen == n && (etag == "" || etag == `"v1"`) {
				t.Fatalf("fast client %v refused a true reply (%s, Content-Length %d): %v", fast, cr, contentLength, err)
			}
		}
	})
}
