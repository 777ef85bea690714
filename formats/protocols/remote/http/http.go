// Package http is the remote.Backend for http:// and https:// objects:
// range GETs over a pool of kept-alive connections (net/http), each
// conditional on the version pinned at open, each reply checked before a
// byte of it is used.
package http

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	nethttp "net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/blockexport/blockexport/formats/protocols/remote"
)

// Options say how to reach the object.
type Options struct {
	// Connections: the most connections kept to the server (the shared
	// layer's requests in flight, plus one).
	Connections int
	// TLSCA is a PEM file of the CAs that may sign an https server's
	// certificate; "": the system's roots.
	TLSCA string
	// SkipVerify accepts any certificate the server shows (QEMU's curl
	// sslverify=off): the daemon's blockdev key, never a default.
	SkipVerify bool
	// AllowRedirects lets a redirect lead to another origin (scheme, host
	// and port); by default only the URL's own origin is followed.
	AllowRedirects bool
	Logger         *slog.Logger
}

// Backend reads one http(s) object.
type Backend struct {
	u      *url.URL
	name   string
	client *nethttp.Client
	tr     *nethttp.Transport
	log    *slog.Logger
	// fast sends the range GETs (nil: net/http does, through a proxy);
	// slow: the URL redirected, net/http sends them from then on.
	fast *fastClient
	slow atomic.Bool
}

// IsURL says whether spec names an http or https object.
func IsURL(spec string) bool {
	return strings.HasPrefix(spec, "http://") || strings.HasPrefix(spec, "https://")
}

// ErrBadURL marks a URL that cannot be right whatever the server says.
var ErrBadURL = errors.New("bad URL")

// New makes the backend of rawURL. Nothing is sent until Stat.
func New(rawURL string, o Options) (*Backend, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		// url's errors quote the whole URL, credentials and all.
		return nil, fmt.Errorf("%s: %w: cannot parse it", remote.Redact(rawURL), ErrBadURL)
	}
	if u.Scheme != "http" && u.Scheme != "https" || u.Host == "" || u.Opaque != "" {
		return nil, fmt.Errorf("%s: %w: want http://HOST/PATH or https://HOST/PATH", remote.Redact(rawURL), ErrBadURL)
	}
	u.Fragment, u.RawFragment = "", ""
	if o.Connections <= 0 {
		o.Connections = remote.DefaultConnections
	}
	o.Logger = cmp.Or(o.Logger, slog.Default())
	tlsConf := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: o.SkipVerify}
	if o.TLSCA != "" {
		pem, err := os.ReadFile(o.TLSCA)
		if err != nil {
			return nil, fmt.Errorf("--tls-ca: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--tls-ca %s: no PEM certificate in it", o.TLSCA)
		}
		tlsConf.RootCAs = pool
	}
	tr := &nethttp.Transport{
		Proxy:       nethttp.ProxyFromEnvironment,
		DialContext: (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		// HTTP/1.1 over parallel connections: what range GETs in
		// parallel want, and what every server speaks.
		TLSClientConfig:     tlsConf,
		TLSHandshakeTimeout: 30 * time.Second,
		MaxIdleConnsPerHost: o.Connections + 1,
		MaxIdleConns:        o.Connections + 1,
		IdleConnTimeout:     90 * time.Second,
		// The bytes as stored: a range of a compressed encoding is not a
		// range of the object.
		DisableCompression: true,
	}
	b := &Backend{u: u, name: remote.Redact(rawURL), tr: tr, log: o.Logger, fast: newFastClient(u, tlsConf, o.Connections)}
	origin := u.Scheme + "://" + canonicalHost(u)
	b.client = &nethttp.Client{Transport: tr, CheckRedirect: func(req *nethttp.Request, via []*nethttp.Request) error {
		if len(via) >= 10 {
			return fmt.Errorf("%w: more than 10 redirects", errRefused)
		}
		if to := req.URL.Scheme + "://" + canonicalHost(req.URL); to != origin && !o.AllowRedirects {
			return fmt.Errorf("%w: redirect to another origin (%s; allow with --allow-redirects)", errRefused, to)
		}
		return nil
	}}
	return b, nil
}

var errRefused = errors.New("refused")

// canonicalHost is host:port with the scheme's default port spelled out.
func canonicalHost(u *url.URL) string {
	port := cmp.Or(u.Port(), map[string]string{"http": "80", "https": "443"}[u.Scheme])
	return net.JoinHostPort(strings.ToLower(u.Hostname()), port)
}

func (b *Backend) String() string { return b.name }

func (b *Backend) Close() error {
	if b.fast != nil {
		b.fast.close()
	}
	b.tr.CloseIdleConnections()
	return nil
}

// request makes a request for the object; the URL's user and password
// become basic authentication (net/http does it).
func (b *Backend) request(ctx context.Context, method string) (*nethttp.Request, error) {
	req, err := nethttp.NewRequestWithContext(ctx, method, b.u.String(), nil)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", b.name, ErrBadURL)
	}
	req.Header.Set("Accept-Encoding", "identity")
	req.Header.Set("User-Agent", "blockexport")
	return req, nil
}

// do sends req; a failure to get a reply is classified by netError. The
// error names the object by its redacted name: url.Error's would show the URL.
func (b *Backend) do(req *nethttp.Request, what string) (*nethttp.Response, error) {
	resp, err := b.client.Do(req)
	if err == nil {
		return resp, nil
	}
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	return nil, b.netError(fmt.Errorf("%s: %s: %w", b.name, what, err))
}

// netError classifies a failure to get a reply: temporary (a reset, a
// timeout, a refused connection) except what no retry cures (a refused
// redirect, a certificate that does not verify).
func (b *Backend) netError(err error) error {
	var (
		unknownCA *x509.UnknownAuthorityError
		badCert   x509.CertificateInvalidError
		badHost   x509.HostnameError
		tlsRecord tls.RecordHeaderError
		verify    *tls.CertificateVerificationError
	)
	switch {
	case errors.Is(err, errRefused), errors.As(err, &unknownCA), errors.As(err, &badCert),
		errors.As(err, &badHost), errors.As(err, &tlsRecord), errors.As(err, &verify):
		return err
	}
	return remote.Temporary(err)
}

// statusError is a reply's status as an error: temporary for the ones a
// retry may cure.
func (b *Backend) statusError(resp *nethttp.Response, what string) error {
	err := fmt.Errorf("%s: %s: server says %s", b.name, what, resp.Status)
	if resp.StatusCode >= 500 || resp.StatusCode == nethttp.StatusTooManyRequests || resp.StatusCode == nethttp.StatusRequestTimeout {
		return remote.Temporary(err)
	}
	return err
}

// Stat pins the object with a range GET of its first byte, whose
// Content-Range gives the size (a HEAD's Content-Length is compared, not
// trusted: a HEAD that disagrees with the GET is an error; a HEAD that is
// refused is skipped, as a presigned GET URL refuses it).
func (b *Backend) Stat(ctx context.Context) (remote.Object, error) {
	headSize := int64(-1)
	var headTag string
	if req, err := b.request(ctx, nethttp.MethodHead); err == nil {
		resp, err := b.do(req, "HEAD")
		if err != nil {
			return remote.Object{}, err
		}
		resp.Body.Close()
		switch {
		case resp.StatusCode == nethttp.StatusOK:
			headSize, headTag = resp.ContentLength, resp.Header.Get("ETag")
		case resp.StatusCode == nethttp.StatusNotFound, resp.StatusCode == nethttp.StatusUnauthorized,
			resp.StatusCode >= 500, resp.StatusCode == nethttp.StatusTooManyRequests:
			return remote.Object{}, b.statusError(resp, "HEAD")
		}
	}
	req, err := b.request(ctx, nethttp.MethodGet)
	if err != nil {
		return remote.Object{}, err
	}
	req.Header.Set("Range", "bytes=0-0")
	resp, err := b.do(req, "GET bytes=0-0")
	if err != nil {
		return remote.Object{}, err
	}
	defer resp.Body.Close()
	obj := remote.Object{ETag: resp.Header.Get("ETag")}
	if t, err := nethttp.ParseTime(resp.Header.Get("Last-Modified")); err == nil {
		obj.LastModified = t
	}

	switch resp.StatusCode {
	case nethttp.StatusPartialContent:
		first, last, total, err := remote.ParseContentRange(resp.Header.Get("Content-Range"))
		if err != nil || first != 0 || last != 0 || total < 1 {
			return remote.Object{}, fmt.Errorf("%s: GET bytes=0-0: %w: Content-Range %q", b.name, remote.ErrBadReply, resp.Header.Get("Content-Range"))
		}
		if resp.ContentLength >= 0 && resp.ContentLength != 1 {
			return remote.Object{}, fmt.Errorf("%s: GET bytes=0-0: %w: the body is not one byte", b.name, remote.ErrBadReply)
		}
		// One byte and no more: a chunked body's end is not waited for
		// (a server may never send it; the connection is dropped at Close).
		var one [1]byte
		if _, err := io.ReadFull(resp.Body, one[:]); err != nil {
			return remote.Object{}, remote.Temporary(fmt.Errorf("%s: GET bytes=0-0: body cut short: %v", b.name, err))
		}
		obj.Size = total
	case nethttp.StatusRequestedRangeNotSatisfiable:
		// An empty object has no byte 0.
		if cr := resp.Header.Get("Content-Range"); cr != "bytes */0" {
			return remote.Object{}, fmt.Errorf("%s: GET bytes=0-0: %w: 416 with Content-Range %q", b.name, remote.ErrBadReply, cr)
		}
		obj.Size = 0
	case nethttp.StatusOK:
		if resp.ContentLength == 0 {
			// An empty object: no range to serve (Go's and others'
			// servers answer so rather than 416).
			obj.Size = 0
			break
		}
		return remote.Object{}, fmt.Errorf("%s: the server does not serve byte ranges (it answers a range request with the whole object)", b.name)
	default:
		return remote.Object{}, b.statusError(resp, "GET bytes=0-0")
	}
	if obj.Size > remote.MaxSize {
		return remote.Object{}, fmt.Errorf("%s: size %d: %w (over %d)", b.name, obj.Size, remote.ErrBadReply, int64(remote.MaxSize))
	}
	if headSize >= 0 && headSize != obj.Size {
		return remote.Object{}, fmt.Errorf("%s: %w: HEAD says %d bytes, a range GET says %d", b.name, remote.ErrBadReply, headSize, obj.Size)
	}
	if headTag != "" && obj.ETag != "" && headTag != obj.ETag {
		return remote.Object{}, remote.Temporary(fmt.Errorf("%s: changed while it was opened (ETag %s, then %s)", b.name, headTag, obj.ETag))
	}
	if obj.ETag == "" && obj.LastModified.IsZero() {
		b.log.Warn("the server sends no ETag and no Last-Modified: an object replaced while exported cannot be detected", "object", b.name)
	}
	return obj, nil
}

// chunkEndWait is how long a chunked range body's end (or a byte too
// many) is waited for once the range's bytes are in.
const chunkEndWait = 50 * time.Millisecond

// ReadRange GETs [off, off+len(p)) of the version obj names.
func (b *Backend) ReadRange(ctx context.Context, obj remote.Object, p []byte, off int64) error {
	return b.ReadRangev(ctx, obj, [][]byte{p}, off)
}

// ReadRangev is ReadRange of bufs' concatenation: one GET, its body read
// straight into each of bufs in turn.
func (b *Backend) ReadRangev(ctx context.Context, obj remote.Object, bufs [][]byte, off int64) error {
	n := int64(0)
	for _, d := range bufs {
		n += int64(len(d))
	}
	if n == 0 {
		return nil
	}
	if off < 0 || n > obj.Size || off > obj.Size-n {
		return fmt.Errorf("%s: range %d+%d past the end (%d)", b.name, off, n, obj.Size)
	}
	if b.fast != nil && !b.slow.Load() && validValue(obj.ETag) {
		if err := b.fast.readRange(ctx, b, obj, bufs, off, n); err != errUseStd {
			return err
		}
	}
	return b.readStd(ctx, obj, bufs, off, n)
}

// rangeWhat names a range GET in errors.
func rangeWhat(off, n int64) string {
	return "GET bytes=" + strconv.FormatInt(off, 10) + "-" + strconv.FormatInt(off+n-1, 10)
}

// readStd is ReadRangev through net/http's client: what follows
// redirects and goes through proxies.
func (b *Backend) readStd(ctx context.Context, obj remote.Object, bufs [][]byte, off, n int64) error {
	what := rangeWhat(off, n)
	ctx, cancel := context.WithCancel(ctx) // ends a chunked body's wait for its end
	defer cancel()
	req, err := b.request(ctx, nethttp.MethodGet)
	if err != nil {
		return err
	}
	req.Header.Set("Range", fmt.Sprintf("bytes=%d-%d", off, off+n-1))
	if k, v := condition(obj); k != "" {
		req.Header.Set(k, v)
	}
	resp, err := b.do(req, what)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, err = b.readReply(resp, obj, bufs, off, n, what, func() { time.AfterFunc(chunkEndWait, cancel) }, nil)
	return err
}

// condition is the header that makes a range GET conditional on obj's
// version: If-Match on a strong ETag, else If-Unmodified-Since.
func condition(obj remote.Object) (key, value string) {
	switch {
	case obj.ETag != "" && !strings.HasPrefix(obj.ETag, "W/"):
		return "If-Match", obj.ETag
	case !obj.LastModified.IsZero():
		// A second past the pinned time: HTTP dates have a second's
		// resolution and some servers refuse a time equal to the object's
		// (versitygw 1.8.0 compares strictly); the reply's Last-Modified is
		// compared with the pinned one (readReply).
		return "If-Unmodified-Since", obj.LastModified.Add(time.Second).UTC().Format(nethttp.TimeFormat)
	}
	return "", ""
}

// readReply checks a range GET's reply against the request and obj and
// reads its body into bufs. waitEnd bounds the wait for a chunked body's
// end; fill, when not nil, reads a body of n bytes by Content-Length from
// the connection itself. clean: the body was read to its end and no more
// (the connection may serve another request).
func (b *Backend) readReply(resp *nethttp.Response, obj remote.Object, bufs [][]byte, off, n int64, what string,
	waitEnd func(), fill func([][]byte) (int, error)) (clean bool, err error) {
	switch resp.StatusCode {
	case nethttp.StatusPartialContent:
	case nethttp.StatusPreconditionFailed, nethttp.StatusRequestedRangeNotSatisfiable:
		return false, fmt.Errorf("%s: %s: %s: %w", b.name, what, resp.Status, remote.ErrChanged)
	case nethttp.StatusOK:
		return false, fmt.Errorf("%s: %s: %w: 200 with the whole object to a range request", b.name, what, remote.ErrBadReply)
	default:
		return false, b.statusError(resp, what)
	}
	if err := remote.CheckPartial(resp.Header.Get("Content-Range"), resp.ContentLength, off, n, obj.Size); err != nil {
		return false, fmt.Errorf("%s: %s: %w", b.name, what, err)
	}
	weak := strings.HasPrefix(obj.ETag, "W/")
	if tag := resp.Header.Get("ETag"); tag != "" && obj.ETag != "" && strings.TrimPrefix(tag, "W/") != strings.TrimPrefix(obj.ETag, "W/") {
		return false, fmt.Errorf("%s: %s: ETag %s, opened as %s: %w", b.name, what, tag, obj.ETag, remote.ErrChanged)
	}
	if (obj.ETag == "" || weak) && !obj.LastModified.IsZero() {
		if lm, err := nethttp.ParseTime(resp.Header.Get("Last-Modified")); err == nil && !lm.Equal(obj.LastModified) {
			return false, fmt.Errorf("%s: %s: Last-Modified %s, opened as %s: %w", b.name, what, lm.UTC().Format(nethttp.TimeFormat),
				obj.LastModified.UTC().Format(nethttp.TimeFormat), remote.ErrChanged)
		}
	}
	if ce := resp.Header.Get("Content-Encoding"); ce != "" && ce != "identity" {
		return false, fmt.Errorf("%s: %s: %w: Content-Encoding %q", b.name, what, remote.ErrBadReply, ce)
	}
	if fill != nil && resp.ContentLength == n {
		// The body is exactly the range: read by fill, to its end.
		if got, err := fill(bufs); err != nil {
			return false, remote.Temporary(fmt.Errorf("%s: %s: body cut short after %d bytes: %v", b.name, what, got, err))
		}
		return true, nil
	}
	got := 0
	for _, d := range bufs {
		k, err := io.ReadFull(resp.Body, d)
		got += k
		if err != nil {
			// Cut short: a reset or a truncating proxy; a retry may get it all.
			return false, remote.Temporary(fmt.Errorf("%s: %s: body cut short after %d bytes: %v", b.name, what, got, err))
		}
	}
	if resp.ContentLength < 0 {
		// Chunked: the range is complete with its bytes. A byte more or
		// the end is looked for a moment only (a server that never sends
		// the last chunk would hold every read for the whole timeout); past
		// it the request is cut and its connection dropped.
		waitEnd()
	}
	var extra [1]byte
	k, err := resp.Body.Read(extra[:])
	if k != 0 {
		return false, fmt.Errorf("%s: %s: %w: the body is longer than the range", b.name, what, remote.ErrBadReply)
	}
	return err == io.EOF, nil
}

var _ remote.VectorBackend = (*Backend)(nil)
