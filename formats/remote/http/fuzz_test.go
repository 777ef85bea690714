package http

import (
	"bytes"
	"context"
	"io"
	nethttp "net/http"
	"strconv"
	"testing"

	"github.com/blockexport/blockexport/formats/remote"
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
		{"bytes 0-0/9223372036854775808", 1, 0, 1, MaxSize},
		{"bytes 4611686018427387903-4611686018427387903/4611686018427387904", 1, MaxSize - 1, 1, MaxSize},
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
		err := CheckPartial(cr, cl, off, n, size)
		if err != nil {
			return
		}
		first, last, total, perr := ParseContentRange(cr)
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
	start := f.bodyOff
	if first, _, _, err := ParseContentRange(f.cr); err == nil && first < int64(len(f.data)) {
		start = int(first)
	}
	body := make([]byte, 0, max(f.bodyLen, 0))
	for i := 0; i < f.bodyLen; i++ {
		body = append(body, f.data[(start+i)%len(f.data)])
	}
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

// FuzzReadRange: whatever the reply, ReadRange either fills p with exactly
// the object's bytes at off or fails; it never panics.
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
	f.Fuzz(func(t *testing.T, status int, cr, etag string, contentLength int64, bodyLen, bodyOff int, off int64, n int) {
		const size = 4096
		if n <= 0 || n > size || off < 0 || off > size-int64(n) || bodyLen > 3*size || bodyOff < 0 {
			return
		}
		if status < 100 || status > 999 {
			return
		}
		data := make([]byte, size)
		for i := range data {
			data[i] = byte(i*7 + i/256)
		}
		b, err := New("http://example.invalid/disk.img", Options{})
		if err != nil {
			t.Fatal(err)
		}
		b.client.Transport = &fakeReply{data: data, status: status, cr: cr, etag: etag, contentLength: contentLength,
			bodyLen: bodyLen, bodyOff: bodyOff % size}
		p := make([]byte, n)
		err = b.ReadRange(context.Background(), remote.Object{Size: size, ETag: `"v1"`}, p, off)
		if err == nil && !bytes.Equal(p, data[off:off+int64(n)]) {
			t.Fatalf("accepted wrong bytes: status %d Content-Range %q Content-Length %d body %d", status, cr, contentLength, bodyLen)
		}
	})
}
