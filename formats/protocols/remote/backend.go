// Package remote serves an object in HTTP(S) or S3-compatible storage as a
// read-only byte range that any format can be opened on, as on a local
// file. A Backend speaks one protocol: it pins the object's size and
// identity once (Stat) and fetches byte ranges of exactly that version
// (ReadRange); backends live in packages of their own (remote/http,
// remote/s3), so that one protocol's client library never leaks into the
// other. Above them the File keeps the connections busy, reads ahead,
// caches blocks within a bound, shares one request among the readers of a
// block, and retries temporary failures up to the reconnect timeout.
package remote

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// MaxSize is the largest object a backend serves: offsets and lengths are
// computed in int64 with room to spare (a server that says 2^63 - 1 is
// refused, not overflowed), whatever a format adds to them.
const MaxSize = 1 << 62

// Object is what a Backend pins at open: every later ReadRange is asked to
// be of this version, and an object replaced since then is an error
// (ErrChanged), never a mix of two versions.
type Object struct {
	Size int64
	// ETag is the entity tag as the server sent it (with its quotes);
	// empty when the server sends none.
	ETag string
	// LastModified is the server's Last-Modified; zero when it sends none.
	// A backend uses it (If-Unmodified-Since) only where there is no ETag.
	LastModified time.Time
}

// Backend is one protocol's access to one object. Its methods are safe for
// concurrent use; the shared layer calls ReadRange from many goroutines at
// once, up to the connection count it was given.
type Backend interface {
	// Stat fetches the object's size and identity. Called once, at open.
	Stat(ctx context.Context) (Object, error)
	// ReadRange fills all of p with the object's bytes at off, of the
	// version obj names (off+len(p) <= obj.Size; the caller checks), checking
	// what the server says (status, range, length) before it trusts it, and
	// never returning a partly filled p as success. Errors: ErrChanged when
	// the object is no longer obj; wrapping ErrTemporary where a retry may
	// cure it (a reset, a timeout, a 5xx, a 429); any other where it cannot.
	ReadRange(ctx context.Context, obj Object, p []byte, off int64) error
	// String names the object for logs and errors: never credentials, a
	// signed query or a password in a URL.
	String() string
	// Close releases the backend's connections.
	Close() error
}

// VectorBackend is a Backend that fills several buffers, in order, from
// one range request: the shared layer then reads a GET straight into its
// cache's blocks, with no copy through a buffer of the GET's size.
// ReadRangev is ReadRange of the concatenation of bufs, with the same
// checks and errors.
type VectorBackend interface {
	Backend
	ReadRangev(ctx context.Context, obj Object, bufs [][]byte, off int64) error
}

var (
	// ErrChanged: the object was replaced or modified after it was opened.
	ErrChanged = errors.New("remote object changed since it was opened")
	// ErrTemporary marks a failure that a retry may cure.
	ErrTemporary = errors.New("temporary failure")
	// ErrBadReply marks a reply that contradicts itself or the request.
	ErrBadReply = errors.New("the server's reply does not match the request")
)

// Temporary wraps err so that errors.Is(err, ErrTemporary) holds, keeping
// err's own message and chain.
func Temporary(err error) error {
	if err == nil || errors.Is(err, ErrTemporary) {
		return err
	}
	return temporaryError{err}
}

type temporaryError struct{ err error }

func (e temporaryError) Error() string { return e.err.Error() }
func (e temporaryError) Unwrap() []error {
	return []error{e.err, ErrTemporary}
}

// ParseContentRange parses a 206 reply's "bytes FIRST-LAST/TOTAL" (TOTAL
// may be "*": -1), for a backend to check the reply against its request.
// Every number is a plain decimal within int64, FIRST <= LAST, and LAST <
// TOTAL when TOTAL is known.
func ParseContentRange(s string) (first, last, total int64, err error) {
	rest, ok := strings.CutPrefix(s, "bytes ")
	if !ok {
		return 0, 0, 0, fmt.Errorf("Content-Range %q: not bytes", s)
	}
	span, tot, ok := strings.Cut(rest, "/")
	if !ok {
		return 0, 0, 0, fmt.Errorf("Content-Range %q: no total", s)
	}
	a, z, ok := strings.Cut(span, "-")
	if !ok {
		return 0, 0, 0, fmt.Errorf("Content-Range %q: no range", s)
	}
	num := func(d string) (int64, bool) {
		if d == "" || len(d) > 19 || strings.TrimLeft(d, "0123456789") != "" {
			return 0, false
		}
		v, err := strconv.ParseInt(d, 10, 64)
		return v, err == nil
	}
	if first, ok = num(a); !ok {
		return 0, 0, 0, fmt.Errorf("Content-Range %q: bad first byte", s)
	}
	if last, ok = num(z); !ok || last < first {
		return 0, 0, 0, fmt.Errorf("Content-Range %q: bad last byte", s)
	}
	if tot == "*" {
		return first, last, -1, nil
	}
	if total, ok = num(tot); !ok || last >= total {
		return 0, 0, 0, fmt.Errorf("Content-Range %q: bad total", s)
	}
	return first, last, total, nil
}

// CheckPartial checks a 206's Content-Range and Content-Length (-1:
// absent) against a backend's request for n bytes at off of an object of
// size bytes: ErrBadReply, or ErrChanged where the size moved.
func CheckPartial(contentRange string, contentLength, off, n, size int64) error {
	first, last, total, err := ParseContentRange(contentRange)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrBadReply, err)
	}
	if first != off || last != off+n-1 {
		return fmt.Errorf("%w: asked bytes %d-%d, Content-Range says %d-%d", ErrBadReply, off, off+n-1, first, last)
	}
	if total >= 0 && total != size {
		// The object's length changed: another version.
		return fmt.Errorf("Content-Range says the object has %d bytes, opened with %d: %w", total, size, ErrChanged)
	}
	if contentLength >= 0 && contentLength != n {
		return fmt.Errorf("%w: %d bytes asked, Content-Length %d", ErrBadReply, n, contentLength)
	}
	return nil
}

// Redact is rawURL as logs and errors show it: no user or password, no
// query (it may hold a signature), no fragment. A backend's String and
// errors use it.
func Redact(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		// Cut what could be credentials: anything up to an '@' after the
		// scheme, and any query.
		s := rawURL
		if i := strings.IndexAny(s, "?#"); i >= 0 {
			s = s[:i]
		}
		if i := strings.Index(s, "://"); i >= 0 {
			if j := strings.LastIndexByte(s[i+3:], '@'); j >= 0 {
				s = s[:i+3] + s[i+3+j+1:]
			}
		}
		return s
	}
	r := url.URL{Scheme: u.Scheme, Host: u.Host, Path: u.Path, RawPath: u.RawPath}
	s := r.String()
	if u.RawQuery != "" || u.ForceQuery {
		s += "?…"
	}
	return s
}
