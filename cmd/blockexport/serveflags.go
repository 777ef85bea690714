package main

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/spf13/cobra"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats/filters/copyonread"
	"github.com/blockexport/blockexport/formats/protocols/nbd"
	"github.com/blockexport/blockexport/formats/registry"
)

// serveFlags are the flags the serving commands (fuse, nbd) share: which
// image and how to open it, and how the serving process runs. Declared
// once, checked once, so that both take the same values the same way.
type serveFlags struct {
	sourceFlags
	format         string
	writable       bool
	copyOnRead     bool
	nullReadZeroes bool
	aio            string
	cache          string
	l2CacheSize    string
	decodedCache   string
	daemonize      bool
	pidfile        string
	logLevel       string
	logFile        string
	cpuprofile     string
	snapshot       string
}

func (f *serveFlags) register(c *cobra.Command) {
	fs := c.Flags()
	formatFlag(c, &f.format, formatUsage+" (auto: probed as qemu-img probes; a format not read here, qed say, is refused by name)")
	fs.BoolVarP(&f.writable, "writable", "w", false, "allow writes (default: read-only)")
	fs.StringVarP(&f.snapshot, "snapshot", "l", "", "serve the qcow2 internal snapshot NAME or ID (the ID tried first; or snapshot.id=ID, snapshot.name=NAME), read-only, as qemu-nbd -l")
	fs.BoolVar(&f.copyOnRead, "copy-on-read", false, "reads of what a qcow2 overlay does not hold copy it, whole clusters, from the backing chain into the overlay (QEMU's copy-on-read filter): each block crosses from the backing file once; needs --writable and a backing file")
	fs.BoolVar(&f.nullReadZeroes, "null-read-zeroes", true, "null device reads return zeroes (false: buffers are left as they are)")
	fs.StringVar(&f.aio, "aio", "io_uring", "host I/O engine: io_uring or threads (io_uring falls back to threads when unavailable)")
	fs.StringVar(&f.cache, "cache", "writeback", "host cache mode: writeback (page cache) or none (O_DIRECT)")
	fs.StringVar(&f.l2CacheSize, "l2-cache-size", "8M", "qcow2 L2 table cache size (8M maps 64 GiB at 64 KiB clusters)")
	fs.StringVar(&f.decodedCache, "decompressed-cache-size", "", "memory for decompressed qcow2 clusters and vmdk streamOptimized grains, per image (default: qcow2 4M, vmdk 32M); a read of a compressed cluster or grain not held decompresses it whole")
	fs.BoolVar(&f.daemonize, "daemonize", false, "run in the background; return once the image is served")
	fs.StringVar(&f.pidfile, "pidfile", "", "write the serving process's PID to this file")
	fs.StringVar(&f.logLevel, "log-level", "info", "log level: debug, info, warn or error")
	fs.StringVar(&f.logFile, "log-file", "", "append the log to this file (created 0600 if missing) instead of stderr; without it a --daemonize'd process logs to syslog where /dev/log exists")
	fs.StringVar(&f.cpuprofile, "cpuprofile", "", "write a Go CPU profile of the serving process to this file (for go tool pprof)")
	f.sourceFlags.register(c)
	completeWords(c, "aio", "io_uring", "threads")
	completeWords(c, "cache", "writeback", "none")
	completeWords(c, "log-level", "debug", "info", "warn", "error")
}

// formatFlag declares -f/--format for a command that opens images.
func formatFlag(c *cobra.Command, p *string, usage string) {
	c.Flags().StringVarP(p, "format", "f", "auto", usage)
	completeWords(c, "format", registry.Formats()...)
}

// formatUsage is the --format flag's help: the formats read here, from
// the probe's registry.
var formatUsage = func() string {
	u := "image format: " + strings.Join(registry.Formats(), ", ")
	if ro := registry.ReadOnlyFormats(); len(ro) > 0 {
		u += " (" + registry.AndList(ro) + " read-only)"
	}
	return u
}()

// check validates the shared flags and returns the logger and how to open
// the image (with QEMU's image locks: a served image is in use).
func (f *serveFlags) check() (*slog.Logger, registry.Options, error) {
	logger, err := serveLogger(f.logLevel, f.logFile, f.daemonize && isDaemonChild())
	if err != nil {
		return nil, registry.Options{}, err
	}
	format, err := registry.ParseFormat(f.format)
	if err != nil {
		return nil, registry.Options{}, usageError{err}
	}
	if f.copyOnRead && !f.writable {
		return nil, registry.Options{}, usagef("--copy-on-read writes what it reads into the image: it needs --writable")
	}
	backend, err := aio.ParseBackend(f.aio)
	if err != nil {
		return nil, registry.Options{}, usageError{err}
	}
	var direct bool
	switch f.cache {
	case "writeback":
	case "none":
		direct = true
	default:
		return nil, registry.Options{}, usagef("unknown --cache mode %q (want writeback or none)", f.cache)
	}
	l2Cache, err := registry.ParseSize(f.l2CacheSize)
	if err != nil {
		return nil, registry.Options{}, usagef("--l2-cache-size: %v", err)
	}
	var decoded int64
	if f.decodedCache != "" {
		if decoded, err = registry.ParseSize(f.decodedCache); err != nil {
			return nil, registry.Options{}, usagef("--decompressed-cache-size: %v", err)
		}
	}
	o, err := f.sourceFlags.options()
	if err != nil {
		return nil, registry.Options{}, err
	}
	o.Lock, o.Format, o.Writable, o.NullReadZeroes, o.Direct, o.Backend = true, format, f.writable, f.nullReadZeroes, direct, backend
	o.Logger, o.L2CacheSize, o.DecodedCacheSize = logger, l2Cache, decoded
	return logger, o, nil
}

// sourceFlags say how to reach an image (or a backing file) on an NBD
// server, named by an NBD URI.
type sourceFlags struct {
	connections      int
	reconnectTimeout time.Duration
	tls              nbd.TLSFiles
	// allowDirs: directories besides an image's own where files it names
	// (VMDK extents and parents) may lie.
	allowDirs []string
	// cacheSize and allowRedirects are for http(s) sources.
	cacheSize      string
	allowRedirects bool
	// s3Endpoint and s3PathStyle are for s3:// sources.
	s3Endpoint  string
	s3PathStyle bool
}

func (f *sourceFlags) register(c *cobra.Command) {
	fs := c.Flags()
	fs.IntVar(&f.connections, "connections", 0, "connections to the server of an NBD source, where it allows several (CAN_MULTI_CONN; default 1), or range requests in flight at once per http(s) or s3 object (default 16)")
	fs.DurationVar(&f.reconnectTimeout, "reconnect-timeout", 5*time.Second, "NBD sources: how long requests wait for a lost connection to come back before they fail (0: at once); http(s) sources: how long a read retries resets, timeouts, 5xx and 429 (and what one request may take) before it fails with EIO (at least 1s)")
	fs.StringVar(&f.cacheSize, "cache-size", "64M", "http(s) sources: memory for the blocks fetched, per remote object")
	fs.BoolVar(&f.allowRedirects, "allow-redirects", false, "http(s) sources: follow redirects to another origin (scheme, host, port); by default only within the URL's own")
	fs.StringVar(&f.s3Endpoint, "s3-endpoint", "", "s3:// sources: the S3-compatible endpoint (e.g. http://127.0.0.1:7070), instead of AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL or the shared config's; region and credentials come from the AWS environment variables and shared files")
	fs.BoolVar(&f.s3PathStyle, "s3-path-style", false, "s3:// sources: path-style addressing (ENDPOINT/BUCKET/KEY) instead of BUCKET.ENDPOINT/KEY; automatic for an IP address or localhost endpoint")
	fs.StringArrayVar(&f.allowDirs, "allow-dir", nil, "a directory, besides the image's own, where files the image names (VMDK extents and parents) may lie (repeatable; default: only the image's directory)")
}

// registerTLS adds the client's TLS files (for nbds:// URIs) as
// --PREFIXtls-ca, --PREFIXtls-cert and --PREFIXtls-key: `nbd` has its own
// --tls-* flags for the server it is, so there they are --image-tls-*.
func (f *sourceFlags) registerTLS(c *cobra.Command, prefix string) {
	fs := c.Flags()
	fs.StringVar(&f.tls.CA, prefix+"tls-ca", "", "nbds and https sources: the CA certificate (PEM) that signed the server's (default: IMAGE's URI's tls-certificates directory for nbds, else the system's; a backing file's URI may not name one)")
	fs.StringVar(&f.tls.Cert, prefix+"tls-cert", "", "nbds sources: the client certificate (PEM) to present, when the server asks for one")
	fs.StringVar(&f.tls.Key, prefix+"tls-key", "", "nbds sources: the client certificate's key (PEM)")
}

// options are how to reach NBD, http(s) and s3 sources (0 connections
// to a remote object: the remote layer's default) and where files an
// image names may lie; the caller sets the rest.
func (f *sourceFlags) options() (registry.Options, error) {
	if f.connections < 0 || f.connections > 64 {
		return registry.Options{}, usagef("--connections %d: want 1 to 64", f.connections)
	}
	if f.reconnectTimeout < 0 {
		return registry.Options{}, usagef("--reconnect-timeout %v: want 0 or more", f.reconnectTimeout)
	}
	cache, err := registry.ParseSize(f.cacheSize)
	if err != nil || cache < 1<<20 {
		return registry.Options{}, usagef("--cache-size %q: want a size of 1M or more", f.cacheSize)
	}
	return registry.Options{RelatedDirs: f.allowDirs,
		NBD: registry.NBDOptions{Connections: max(f.connections, 1), ReconnectTimeout: f.reconnectTimeout, TLS: f.tls},
		Remote: registry.RemoteOptions{Connections: f.connections, CacheSize: cache, ReconnectTimeout: f.reconnectTimeout,
			TLSCA: f.tls.CA, AllowRedirects: f.allowRedirects, S3Endpoint: f.s3Endpoint, S3PathStyle: f.s3PathStyle}}, nil
}

// openImage opens spec; a spec that cannot be right is a usage error.
func openImage(spec string, o registry.Options) (*registry.Opened, error) {
	img, err := registry.Open(spec, o)
	if err != nil {
		if errors.Is(err, registry.ErrBadSpec) {
			return nil, usageError{err}
		}
		return nil, err
	}
	return img, nil
}

// open opens the image to serve, behind the copy-on-read filter if asked.
func (f *serveFlags) open(spec string, o registry.Options) (*registry.Opened, error) {
	var snap snapshotSpec
	if f.snapshot != "" {
		if f.writable {
			return nil, usagef("--snapshot serves a snapshot read-only: drop --writable")
		}
		var err error
		if snap, err = parseSnapshotSpec(f.snapshot); err != nil {
			return nil, usageError{err}
		}
	}
	img, err := openImage(spec, o)
	if err == nil && f.snapshot != "" {
		if err = loadSnapshot(context.Background(), img.Image, snap); err != nil {
			img.Image.Close()
			return nil, err
		}
	}
	if err != nil || !f.copyOnRead {
		return img, err
	}
	cor, err := copyonread.New(img.Image, img.Format)
	if err != nil {
		img.Image.Close()
		return nil, usageError{err}
	}
	img.Image = cor
	return img, nil
}

// begin starts serving: the stop signals first, then the pidfile and the
// CPU profile (a signal from here on is handled, so the pidfile is never
// left behind), before the mount or the socket (a second instance given
// the same pidfile is refused before either). The caller defers stop.
func (f *serveFlags) begin() (chan stopSignal, *exitJobs, func(), error) {
	sigs := stopSignals()
	stop, err := f.start()
	if err != nil {
		return nil, nil, nil, err
	}
	jobs := &exitJobs{}
	jobs.add(stop)
	return sigs, jobs, stop, nil
}

// start runs what the serving process needs once the image is served:
// the pidfile and the CPU profile. stop undoes them at exit.
func (f *serveFlags) start() (stop func(), err error) {
	removePidfile, err := writePidfile(f.pidfile)
	if err != nil {
		return nil, err
	}
	stopProfile, err := startCPUProfile(f.cpuprofile)
	if err != nil {
		removePidfile()
		return nil, err
	}
	// Once: the orderly exit and a second signal's fast exit may both run it.
	return sync.OnceFunc(func() { stopProfile(); removePidfile() }), nil
}
