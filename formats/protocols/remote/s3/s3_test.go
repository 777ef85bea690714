package s3

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	nethttp "net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/s3"

	"github.com/blockexport/blockexport/formats/protocols/remote"
)

// fakeS3 is a small S3 endpoint that lies on demand: the real server's
// replies are tested end to end in ./tests/remote; these are the replies a real
// server should never send and the SDK lets through.
type fakeS3 struct {
	data   []byte
	etag   string
	mode   atomic.Value // string: how GET lies
	head   atomic.Value // string: how HEAD lies
	gets   atomic.Int64
	lastIf atomic.Value // string: the If-Match of the last GET
}

func (f *fakeS3) ServeHTTP(w nethttp.ResponseWriter, r *nethttp.Request) {
	if r.URL.Path != "/bucket/disk.img" {
		w.Header().Set("Content-Type", "application/xml")
		w.WriteHeader(nethttp.StatusNotFound)
		if r.Method == nethttp.MethodGet {
			fmt.Fprint(w, `<?xml version="1.0"?><Error><Code>NoSuchKey</Code><Message>gone</Message></Error>`)
		}
		return
	}
	if !strings.HasPrefix(r.Header.Get("Authorization"), "AWS4-HMAC-SHA256 ") {
		w.WriteHeader(nethttp.StatusForbidden)
		return
	}
	w.Header().Set("ETag", f.etag)
	if r.Method == nethttp.MethodHead {
		size := strconv.Itoa(len(f.data))
		switch h, _ := f.head.Load().(string); h {
		case "huge":
			size = "9223372036854775807"
		case "over":
			size = "9223372036854775808"
		case "negative":
			size = "-5"
		case "anonymous":
			w.Header().Del("ETag")
			w.Header().Set("Content-Length", size)
			return
		}
		w.Header().Set("Content-Length", size)
		w.Header().Set("Last-Modified", time.Unix(1e9, 0).UTC().Format(nethttp.TimeFormat))
		return
	}
	f.gets.Add(1)
	f.lastIf.Store(r.Header.Get("If-Match"))
	var a, z int64
	if _, err := fmt.Sscanf(r.Header.Get("Range"), "bytes=%d-%d", &a, &z); err != nil {
		w.WriteHeader(nethttp.StatusBadRequest)
		return
	}
	mode, _ := f.mode.Load().(string)
	body := f.data[a : z+1]
	cr := fmt.Sprintf("bytes %d-%d/%d", a, z, len(f.data))
	status := nethttp.StatusPartialContent
	switch mode {
	case "whole":
		// A server that ignores Range: 200 and the whole object.
		body, cr, status = f.data, "", nethttp.StatusOK
	case "other-range":
		// A 206 for the range after the one asked.
		b := a + 1
		body = f.data[b : z+2]
		cr = fmt.Sprintf("bytes %d-%d/%d", b, z+1, len(f.data))
	case "other-size":
		cr = fmt.Sprintf("bytes %d-%d/%d", a, z, len(f.data)*2)
	case "no-range":
		cr = ""
	case "short":
		// Content-Length says the truth about a body cut short: the
		// connection drops after half of it.
		w.Header().Set("Content-Range", cr)
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		w.WriteHeader(status)
		w.Write(body[:len(body)/2])
		if hj, ok := w.(nethttp.Hijacker); ok {
			c, _, _ := hj.Hijack()
			c.Close()
		}
		return
	case "long-length":
		// A Content-Length of 2^63-1 on a 206 for a small range.
		w.Header().Set("Content-Range", cr)
		w.Header().Set("Content-Length", "9223372036854775807")
		w.WriteHeader(status)
		w.Write(body)
		if hj, ok := w.(nethttp.Hijacker); ok {
			c, _, _ := hj.Hijack()
			c.Close()
		}
		return
	case "other-etag":
		// A server that ignores If-Match and serves a new version.
		w.Header().Set("ETag", `"another"`)
	case "412":
		w.Header().Set("Content-Type", "application/xml")
		w.WriteHeader(nethttp.StatusPreconditionFailed)
		fmt.Fprint(w, `<?xml version="1.0"?><Error><Code>PreconditionFailed</Code><Message>At least one of the pre-conditions you specified did not hold</Message></Error>`)
		return
	case "503", "429":
		n, _ := strconv.Atoi(mode)
		w.Header().Set("Content-Type", "application/xml")
		w.WriteHeader(n)
		fmt.Fprint(w, `<?xml version="1.0"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>`)
		return
	case "403":
		w.Header().Set("Content-Type", "application/xml")
		w.WriteHeader(nethttp.StatusForbidden)
		fmt.Fprint(w, `<?xml version="1.0"?><Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>`)
		return
	}
	if cr != "" {
		w.Header().Set("Content-Range", cr)
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	w.Write(body)
}

// cleanAWSEnv leaves the test no AWS configuration at all: every AWS_*
// variable unset, HOME an empty directory (no ~/.aws), and the EC2
// metadata service off (AWS_EC2_METADATA_DISABLED), as every S3 test has
// it, so that nothing can reach an address but loopback.
func cleanAWSEnv(t *testing.T) {
	t.Helper()
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); strings.HasPrefix(k, "AWS_") {
			t.Setenv(k, "") // restored after the test
			os.Unsetenv(k)
		}
	}
	t.Setenv("HOME", t.TempDir())
	t.Setenv("AWS_EC2_METADATA_DISABLED", "true")
}

// testCredentials is cleanAWSEnv with a key pair and a region.
func testCredentials(t *testing.T) {
	t.Helper()
	cleanAWSEnv(t)
	t.Setenv("AWS_ACCESS_KEY_ID", "AKIDTESTTESTTEST")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "secret-never-shown-1234")
	t.Setenv("AWS_REGION", "us-east-1")
}

func newFake(t *testing.T) (*fakeS3, *Backend, remote.Object) {
	t.Helper()
	testCredentials(t)
	data := make([]byte, 1<<20)
	for i := range data {
		data[i] = byte(i*7 + i>>9)
	}
	f := &fakeS3{data: data, etag: `"abc"`}
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	ctx := context.Background()
	b, err := New(ctx, "s3://bucket/disk.img", Options{Endpoint: srv.URL, Connections: 4})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	obj, err := b.Stat(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if obj.Size != int64(len(data)) || obj.ETag != `"abc"` {
		t.Fatalf("Stat = %+v", obj)
	}
	return f, b, obj
}

func TestReadRangeChecksEveryClaimOfTheReply(t *testing.T) {
	f, b, obj := newFake(t)
	ctx := context.Background()
	p := make([]byte, 4096)
	if err := b.ReadRange(ctx, obj, p, 12345); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(p, f.data[12345:12345+4096]) {
		t.Fatal("honest reply read wrong")
	}
	if got, _ := f.lastIf.Load().(string); got != `"abc"` {
		t.Fatalf("GET sent If-Match %q, want the ETag pinned at open", got)
	}
	for _, c := range []struct {
		mode      string
		changed   bool
		temporary bool
	}{
		{"whole", false, false},
		{"other-range", false, false},
		{"no-range", false, false},
		{"other-size", true, false},
		{"other-etag", true, false},
		{"412", true, false},
		{"short", false, true},
		{"long-length", false, false},
		{"503", false, true},
		{"429", false, true},
		{"403", false, false},
	} {
		t.Run(c.mode, func(t *testing.T) {
			f.mode.Store(c.mode)
			p := bytes.Repeat([]byte{0xee}, 4096)
			err := b.ReadRange(ctx, obj, p, 12345)
			if err == nil {
				t.Fatal("a lying reply was taken")
			}
			if errors.Is(err, remote.ErrChanged) != c.changed {
				t.Errorf("ErrChanged = %v, want %v: %v", !c.changed, c.changed, err)
			}
			if errors.Is(err, remote.ErrTemporary) != c.temporary {
				t.Errorf("ErrTemporary = %v, want %v: %v", !c.temporary, c.temporary, err)
			}
			if strings.Contains(err.Error(), "secret-never-shown") {
				t.Errorf("error shows the secret: %v", err)
			}
			if !strings.Contains(err.Error(), "s3://bucket/disk.img") {
				t.Errorf("error does not name the object: %v", err)
			}
		})
	}
	// One attempt per read: the SDK's retryer is off, the shared layer
	// owns the deadline.
	f.mode.Store("503")
	before := f.gets.Load()
	if err := b.ReadRange(ctx, obj, p, 0); !errors.Is(err, remote.ErrTemporary) {
		t.Fatalf("503: %v", err)
	}
	if n := f.gets.Load() - before; n != 1 {
		t.Fatalf("a 503 was sent %d times, want once (the SDK retried)", n)
	}
}

func TestReadRangeRefusesRangesOutsideTheObject(t *testing.T) {
	f, b, obj := newFake(t)
	ctx := context.Background()
	before := f.gets.Load()
	for _, off := range []int64{-1, obj.Size - 10, obj.Size, 1<<63 - 5} {
		if err := b.ReadRange(ctx, obj, make([]byte, 4096), off); err == nil {
			t.Errorf("offset %d: no error", off)
		}
	}
	if f.gets.Load() != before {
		t.Fatal("a range outside the object was asked of the server")
	}
}

func TestOpenErrorsAreOneClearLine(t *testing.T) {
	testCredentials(t)
	f := &fakeS3{data: []byte("x"), etag: `"e"`}
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	b, err := New(context.Background(), "s3://bucket/missing", Options{Endpoint: srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	_, err = b.Stat(context.Background())
	if err == nil || err.Error() != "s3://bucket/missing: no such object" {
		t.Fatalf("missing key: %v", err)
	}
}

func TestStatRefusesALyingHead(t *testing.T) {
	f, b, _ := newFake(t)
	for _, mode := range []string{"huge", "over", "negative", "anonymous"} {
		f.head.Store(mode)
		obj, err := b.Stat(context.Background())
		if err == nil {
			t.Errorf("HEAD %s: taken as %+v", mode, obj)
		} else if !strings.HasPrefix(err.Error(), "s3://bucket/disk.img: ") {
			t.Errorf("HEAD %s: %v", mode, err)
		} else {
			t.Logf("HEAD %s: %v", mode, err)
		}
	}
}

// noDial is a dialer that refuses, and counts, every connection.
type noDial struct{ addrs []string }

func (d *noDial) dial(_ context.Context, _, addr string) (net.Conn, error) {
	d.addrs = append(d.addrs, addr)
	return nil, errors.New("the test allows no connection")
}

// TestNoCredentialsSaysWhereItLooked: with no AWS configuration at all,
// Stat says in one line that there are no credentials and where they were
// looked for, before a byte is sent: no request to the store, no
// connection anywhere (the EC2 metadata service above all, even where
// AWS_EC2_METADATA_DISABLED does not turn it off), no SDK log line.
func TestNoCredentialsSaysWhereItLooked(t *testing.T) {
	for _, metadataOff := range []bool{true, false} {
		t.Run(fmt.Sprintf("AWS_EC2_METADATA_DISABLED=%v", metadataOff), func(t *testing.T) {
			cleanAWSEnv(t)
			home := os.Getenv("HOME")
			// Were the metadata service asked, it would be this loopback
			// listener, not 169.254.169.254.
			imds, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer imds.Close()
			var asked atomic.Int64
			go func() {
				for {
					c, err := imds.Accept()
					if err != nil {
						return
					}
					asked.Add(1)
					c.Close()
				}
			}()
			t.Setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://"+imds.Addr().String())
			if !metadataOff {
				os.Unsetenv("AWS_EC2_METADATA_DISABLED")
			}
			f := &fakeS3{data: []byte("x"), etag: `"e"`}
			var requests atomic.Int64
			srv := httptest.NewServer(nethttp.HandlerFunc(func(w nethttp.ResponseWriter, r *nethttp.Request) {
				requests.Add(1)
				f.ServeHTTP(w, r)
			}))
			t.Cleanup(srv.Close)
			d := &noDial{}
			logged := captureStderr(t, func() {
				b, err := New(context.Background(), "s3://bucket/disk.img", Options{Endpoint: srv.URL, dial: d.dial})
				if err != nil {
					t.Fatal(err)
				}
				_, err = b.Stat(context.Background())
				want := "s3://bucket/disk.img: no credentials found (looked in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, then profile \"default\" (AWS_PROFILE) in " +
					filepath.Join(home, ".aws", "credentials") + " and " + filepath.Join(home, ".aws", "config") + "; the EC2 instance metadata service is never asked)"
				if err == nil || err.Error() != want || errors.Is(err, remote.ErrTemporary) {
					t.Fatalf("no credentials:\n got %v\nwant %s", err, want)
				}
			})
			if n := requests.Load() + asked.Load(); n != 0 || len(d.addrs) != 0 {
				t.Fatalf("%d requests, %d metadata connections, dials %v: want none", requests.Load(), asked.Load(), d.addrs)
			}
			if logged != "" {
				t.Fatalf("the SDK logged: %s", logged)
			}
		})
	}
}

// captureStderr runs f with os.Stderr a pipe (the SDK's default logger
// writes there) and returns what was written.
func captureStderr(t *testing.T, f func()) string {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	saved := os.Stderr
	os.Stderr = w
	out := make(chan []byte)
	go func() { b, _ := io.ReadAll(r); out <- b }()
	defer func() {
		os.Stderr = saved
		w.Close()
		r.Close()
	}()
	f()
	os.Stderr = saved
	w.Close()
	return string(<-out)
}

// TestNoEndpointNamesTheFlag: with credentials but no endpoint anywhere,
// the SDK picks AWS's; where that name does not resolve (here the dialer
// says so, no DNS lookup is made), Stat says to pass --s3-endpoint, at
// once (not retried).
func TestNoEndpointNamesTheFlag(t *testing.T) {
	testCredentials(t)
	var addrs []string
	dial := func(_ context.Context, _, addr string) (net.Conn, error) {
		addrs = append(addrs, addr)
		host, _, _ := net.SplitHostPort(addr)
		return nil, &net.OpError{Op: "dial", Net: "tcp", Err: &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}}
	}
	b, err := New(context.Background(), "s3://bucket/disk.img", Options{dial: dial})
	if err != nil {
		t.Fatal(err)
	}
	_, err = b.Stat(context.Background())
	if err == nil || errors.Is(err, remote.ErrTemporary) || !strings.HasPrefix(err.Error(), "s3://bucket/disk.img: no endpoint given") ||
		!strings.Contains(err.Error(), "pass --s3-endpoint URL") || strings.Contains(err.Error(), "secret-never-shown") {
		t.Fatalf("no endpoint: %v", err)
	}
	if len(addrs) != 1 || !strings.HasSuffix(addrs[0], ".amazonaws.com:443") {
		t.Fatalf("dialed %v, want AWS's endpoint once", addrs)
	}
	t.Log(err)
	// An endpoint that was given and does not resolve is the network's
	// failure, retried like any other: no hint to give.
	b, err = New(context.Background(), "s3://bucket/disk.img", Options{Endpoint: "http://s3.invalid:9000", dial: dial})
	if err != nil {
		t.Fatal(err)
	}
	if _, err = b.Stat(context.Background()); err == nil || strings.Contains(err.Error(), "--s3-endpoint") || !errors.Is(err, remote.ErrTemporary) {
		t.Fatalf("a given endpoint that does not resolve: %v", err)
	}
}

func TestParseURL(t *testing.T) {
	for _, c := range []struct {
		in, bucket, key string
		ok              bool
	}{
		{"s3://bkt/a/b/c.qcow2", "bkt", "a/b/c.qcow2", true},
		{"s3://bkt/a b?c#d", "bkt", "a b?c#d", true},
		{"s3://bkt/", "", "", false},
		{"s3://bkt", "", "", false},
		{"s3:///key", "", "", false},
		{"s3://user:pass@host/key", "", "", false},
		{"s3://host:9000/key", "", "", false},
		{"s3://ab/key", "", "", false},
		{"s3://" + strings.Repeat("a", 64) + "/key", "", "", false},
		{"s3://bkt/a\nb", "", "", false},
		{"http://bkt/key", "", "", false},
	} {
		b, k, err := ParseURL(c.in)
		if (err == nil) != c.ok || b != c.bucket || k != c.key {
			t.Errorf("ParseURL(%q) = %q, %q, %v", c.in, b, k, err)
		}
		if err != nil && (!errors.Is(err, ErrBadURL) || strings.Contains(err.Error(), "pass")) {
			t.Errorf("ParseURL(%q): %v", c.in, err)
		}
	}
}

func TestEndpointChecks(t *testing.T) {
	testCredentials(t)
	ctx := context.Background()
	if _, err := New(ctx, "s3://bkt/k", Options{Endpoint: "http://AKID:topsecret@127.0.0.1:1"}); err == nil || strings.Contains(err.Error(), "topsecret") {
		t.Fatalf("endpoint with user information: %v", err)
	}
	if _, err := New(ctx, "s3://bkt/k", Options{Endpoint: "ftp://127.0.0.1"}); err == nil {
		t.Fatal("ftp endpoint taken")
	}
	for ep, local := range map[string]bool{
		"http://127.0.0.1:7070": true, "http://[::1]:1": true, "http://localhost:9000": true,
		"https://s3.example.com": false,
	} {
		got, err := localEndpoint(ep)
		if err != nil || got != local {
			t.Errorf("localEndpoint(%q) = %v, %v", ep, got, err)
		}
	}
}

// replyWith is a GetObject reply as checkReply sees it: a Content-Range
// and a Content-Length, no status (a reply built in memory has no raw
// response) and the ETag of an object pinned as "e".
func replyWith(contentRange string, contentLength int64) *s3.GetObjectOutput {
	etag := `"e"`
	return &s3.GetObjectOutput{ContentRange: &contentRange, ContentLength: &contentLength, ETag: &etag}
}

// TestCheckReplyContentRange: a 206 for bytes 0-8 of a 9-byte object is
// taken; a Content-Range that is malformed, lacks a total (the size was
// pinned: "*" is refused) or overflows is refused.
func TestCheckReplyContentRange(t *testing.T) {
	b := &Backend{name: "s3://b/k"}
	obj := remote.Object{Size: 9, ETag: `"e"`}
	for _, s := range []string{"", "bytes 1-2", "bytes 2-1/9", "bytes 0-8/*", "bytes 0-9/9", "items 0-8/9",
		"bytes -1-2/9", "bytes 0-9223372036854775807/9223372036854775807", "bytes 0-8/99999999999999999999"} {
		if err := b.checkReply(replyWith(s, 9), obj, 0, 9); err == nil {
			t.Errorf("%q taken", s)
		}
	}
	if err := b.checkReply(replyWith("bytes 0-8/9", 9), obj, 0, 9); err != nil {
		t.Fatalf("good range: %v", err)
	}
}

// FuzzCheckReplyContentRange: no panic, and whatever Content-Range is
// taken names exactly the range asked, with the pinned size as its total.
func FuzzCheckReplyContentRange(f *testing.F) {
	for _, s := range []string{"bytes 0-8/9", "bytes 9223372036854775806-9223372036854775806/9223372036854775807", "bytes 1-2/*", "bytes 1-2/9"} {
		f.Add(s)
	}
	b := &Backend{name: "s3://b/k"}
	obj := remote.Object{Size: 9, ETag: `"e"`}
	f.Fuzz(func(t *testing.T, s string) {
		if b.checkReply(replyWith(s, 2), obj, 1, 2) == nil && s != "bytes 1-2/9" {
			a, z, n, err := remote.ParseContentRange(s)
			if err != nil || a != 1 || z != 2 || n != 9 {
				t.Fatalf("%q taken for bytes 1-2 of 9", s)
			}
		}
	})
}

// FuzzParseURL: no panic; what is taken round-trips and has a bucket that
// cannot pass for a host, a port or user information.
func FuzzParseURL(f *testing.F) {
	for _, s := range []string{"s3://bkt/key", "s3://u:p@h/k", "s3://bkt/a/../b?c", "s3://a.b-c_d/\x00", "s3:///"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		b, k, err := ParseURL(s)
		if err != nil {
			return
		}
		if "s3://"+b+"/"+k != s || strings.ContainsAny(b, ":@/?#[]") || k == "" {
			t.Fatalf("%q taken as bucket %q key %q", s, b, k)
		}
	})
}
