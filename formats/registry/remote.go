package registry

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"strings"
	"time"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/driver"
	"github.com/blockexport/blockexport/formats/protocols/nbd"
	"github.com/blockexport/blockexport/formats/protocols/remote"
	remotehttp "github.com/blockexport/blockexport/formats/protocols/remote/http"
	remotes3 "github.com/blockexport/blockexport/formats/protocols/remote/s3"
)

// RemoteOptions say how to read images in remote storage (http://,
// https://), the image itself or a backing file. One cache of CacheSize
// per remote object of the chain.
type RemoteOptions struct {
	// Connections: range requests in flight at once per object (0: the
	// default, remote.DefaultConnections).
	Connections int
	// CacheSize: bytes of fetched blocks kept per object (0: default).
	CacheSize int64
	// ReconnectTimeout: how long a read retries resets, timeouts, 5xx
	// and 429 before it fails with EIO (at least a second).
	ReconnectTimeout time.Duration
	// TLSCA: the CA file that signs https servers' certificates ("": the
	// system's roots). The command line's: a backing string names none.
	TLSCA string
	// TLSSkipVerify: accept any https server certificate (the daemon's
	// sslverify=off), for the image named alone: a backing file an image
	// names is verified, as QEMU opens it with its own defaults.
	TLSSkipVerify bool
	// AllowRedirects: follow redirects to another origin.
	AllowRedirects bool
	// S3Endpoint (--s3-endpoint) overrides the endpoint the AWS
	// configuration gives s3:// objects; S3PathStyle asks for path-style
	// addressing (chosen by itself for an IP or localhost endpoint).
	// Region and credentials come from the AWS environment and shared
	// files only: an s3:// backing string names a bucket and a key.
	S3Endpoint  string
	S3PathStyle bool
}

// IsRemote says whether spec names an object in remote storage.
func IsRemote(spec string) bool {
	return remotehttp.IsURL(spec) || remotes3.IsURL(spec)
}

// Shown is spec as logs, mount tables and messages may show it: a remote
// URL without its user, password or query (a signature).
func Shown(spec string) string {
	if IsRemote(spec) {
		return remote.Redact(spec)
	}
	return spec
}

// ErrBackingRefused: a remote image's backing string names something it
// may not (a local file, an NBD export, another origin).
var ErrBackingRefused = errors.New("backing file refused")

// backingAllowed says whether the remote image parent may name backing
// as its backing file. Its author is not the user: what it names is read
// with the user's network position, so it may name only objects of its
// own origin (scheme, host and port for http(s), the bucket for s3://;
// a relative backing string resolves to one), and another origin only
// when the user allowed leaving the origin (--allow-redirects). A local
// file and an NBD export (a unix socket, a loopback or any TCP server)
// are never its to name: an export would show what they hold.
func (o RemoteOptions) backingAllowed(parent, backing string) error {
	switch {
	case nbd.IsURI(backing):
		return fmt.Errorf("%s: backing file %s: %w: a remote image may not name an NBD export", Shown(parent), Shown(backing), ErrBackingRefused)
	case !IsRemote(backing):
		return fmt.Errorf("%s: backing file %s: %w: a remote image may not name a local file", Shown(parent), Shown(backing), ErrBackingRefused)
	case sameOrigin(parent, backing) || o.AllowRedirects:
		return nil
	}
	return fmt.Errorf("%s: backing file %s: %w: a remote image may name only objects of its own origin (allow others with --allow-redirects)", Shown(parent), Shown(backing), ErrBackingRefused)
}

// sameOrigin: a and b are URLs of the same scheme, host and port (an
// s3:// URL's host is its bucket).
func sameOrigin(a, b string) bool {
	ua, err1 := url.Parse(a)
	ub, err2 := url.Parse(b)
	if err1 != nil || err2 != nil {
		return false
	}
	port := func(u *url.URL) string {
		if p := u.Port(); p != "" {
			return p
		}
		switch strings.ToLower(u.Scheme) {
		case "http":
			return "80"
		case "https":
			return "443"
		}
		return ""
	}
	return strings.EqualFold(ua.Scheme, ub.Scheme) && strings.EqualFold(ua.Hostname(), ub.Hostname()) && port(ua) == port(ub)
}

// remoteOpenTimeout bounds what opening one remote object may take
// beyond its retries (a server that accepts and never answers).
const remoteOpenTimeout = time.Minute

// openRemote opens the object spec names as a read-only file, by URL
// scheme. fromImage: spec is a backing string an image gave: untrusted,
// it chooses nothing but the object (no certificates, no credentials of
// ours); its faults are the image's, not the command line's.
func openRemote(ctx context.Context, spec string, o Options, fromImage bool) (aio.File, error) {
	var b remote.Backend
	switch {
	case remotehttp.IsURL(spec):
		hb, err := remotehttp.New(spec, remotehttp.Options{Connections: o.Remote.Connections, TLSCA: o.Remote.TLSCA,
			SkipVerify: o.Remote.TLSSkipVerify && !fromImage, AllowRedirects: o.Remote.AllowRedirects, Logger: o.Logger})
		if err != nil {
			if errors.Is(err, remotehttp.ErrBadURL) && !fromImage {
				return nil, badSpec("%v", err)
			}
			return nil, err
		}
		b = hb
	case remotes3.IsURL(spec):
		sb, err := remotes3.New(ctx, spec, remotes3.Options{Endpoint: o.Remote.S3Endpoint, PathStyle: o.Remote.S3PathStyle,
			Connections: cmp.Or(o.Remote.Connections, remote.DefaultConnections), CAFile: o.Remote.TLSCA})
		if err != nil {
			if errors.Is(err, remotes3.ErrBadURL) && !fromImage {
				return nil, badSpec("%v", err)
			}
			return nil, err
		}
		b = sb
	default:
		return nil, fmt.Errorf("%s: %w: not a remote URL", spec, ErrBadSpec)
	}
	f, err := remote.Open(ctx, b, remote.Options{Connections: o.Remote.Connections, CacheSize: o.Remote.CacheSize,
		ReconnectTimeout: o.Remote.ReconnectTimeout, Logger: o.Logger})
	if err != nil {
		return nil, err
	}
	return f, nil
}

// openRemoteImage opens the remote object spec as an image of format
// (Auto: probed from its first bytes, and a fixed VHD from its last, as a
// local file is): read-only, a link of the chain like any other (depth
// bounded; a loop through servers cannot be seen by identity).
func (c *chain) openRemoteImage(spec, format string, writable, backing bool) (formats.Image, string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), remoteOpenTimeout)
	defer cancel()
	f, ff, err := c.openRemoteFile(ctx, spec, format, backing)
	if err != nil {
		return nil, "", err
	}
	if writable {
		f.Close()
		return nil, "", needsOverlay(Shown(spec), ff.Name, "objects in remote storage are read here, not written")
	}
	return c.openFormat(f, ff, false, spec)
}

// openRemoteFile opens the remote object spec and finds its format
// (Auto: probed; raw: a warning where it looks like another).
func (c *chain) openRemoteFile(ctx context.Context, spec, format string, backing bool) (aio.File, driver.Format, error) {
	if err := c.deeper(); err != nil {
		return nil, driver.Format{}, err
	}
	f, err := openRemote(ctx, spec, c.o, backing)
	if err != nil {
		return nil, driver.Format{}, err
	}
	if format == Auto || format == Raw {
		head := make([]byte, probeHead)
		if _, err := f.ReadAt(ctx, head, 0); err != nil && !errors.Is(err, io.EOF) {
			f.Close()
			return nil, driver.Format{}, fmt.Errorf("%s: read header: %w", f.Name(), err)
		}
		name := spec
		if u, err := url.Parse(spec); err == nil {
			name = u.Path // dmg goes by its suffix
		}
		ff := probeFormat(head, name)
		if ff.Name == Raw {
			// A fixed VHD has its only footer at the end: found there as
			// a local file's is (detect), by one more ranged read.
			tf, ok, err := remoteTailFormat(ctx, f)
			if err != nil {
				f.Close()
				return nil, driver.Format{}, err
			}
			if ok {
				ff = tf
				if format == Auto && !backing {
					c.probedByTail = tf.Name
				}
			}
		}
		switch {
		case format == Auto && ff.Open == nil:
			f.Close()
			return nil, driver.Format{}, unsupported(f.Name(), ff.Name)
		case format == Auto:
			format = ff.Name
		case ff.Name != Raw && c.o.Logger != nil:
			c.o.Logger.Warn(fmt.Sprintf("%s looks like a %s image, but its format is given as raw: its %s metadata is exported as disk bytes", f.Name(), ff.Name, ff.Name))
		}
	}
	ff, ok := lookupFormat(format)
	if !ok {
		f.Close()
		return nil, driver.Format{}, fmt.Errorf("%s: %w %q", f.Name(), formats.ErrUnknownFormat, format)
	}
	if ff.Open == nil {
		f.Close()
		return nil, driver.Format{}, unsupported(f.Name(), ff.Name)
	}
	return f, ff, nil
}

// checkRemote checks a remote image (read-only: no repair) as Check
// checks a local one.
func checkRemote(ctx context.Context, spec string, o Options, repair int) (formats.CheckResult, error) {
	if repair != driver.RepairNone {
		return formats.CheckResult{}, badSpec("%s is remote and read-only: it cannot be repaired", Shown(spec))
	}
	format := cmp.Or(o.Format, Auto)
	o.NoBacking = true
	c := newChain(o)
	octx, cancel := context.WithTimeout(ctx, remoteOpenTimeout)
	defer cancel()
	f, ff, err := c.openRemoteFile(octx, spec, format, false)
	if err != nil {
		return formats.CheckResult{}, err
	}
	if ff.Check != nil {
		return ff.Check(ctx, f, c.driverOptions(f, ff.Name, false), repair)
	}
	img, _, err := c.openFormat(f, ff, false, spec)
	if err != nil {
		return formats.CheckResult{}, err
	}
	img.Close()
	return formats.CheckResult{}, fmt.Errorf("%s: %w", Shown(spec), ErrNoChecks)
}

// shownName is a name an image holds (a backing string) as a message may
// show it: a URL without its user, password or query (a signature); an
// NBD URI names no secret and is shown whole.
func shownName(name string) string {
	if strings.Contains(name, "://") && !strings.HasPrefix(name, "nbd") {
		return remote.Redact(name)
	}
	return name
}

// remoteTailFormat is the format whose ProbeTail recognises the end of
// the remote object f (its size is known from the open), as probeTail
// finds it in a local file.
func remoteTailFormat(ctx context.Context, f aio.File) (driver.Format, bool, error) {
	sized, ok := f.(aio.Sized)
	if !ok || sized.Size() < driver.ProbeTailSize {
		return driver.Format{}, false, nil
	}
	tail := make([]byte, driver.ProbeTailSize)
	if _, err := f.ReadAt(ctx, tail, sized.Size()-driver.ProbeTailSize); err != nil && !errors.Is(err, io.EOF) {
		return driver.Format{}, false, fmt.Errorf("%s: read the last %d bytes: %w", f.Name(), driver.ProbeTailSize, err)
	}
	ff, ok := tailFormat(tail, sized.Size())
	return ff, ok, nil
}
