package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/blockexport/blockexport/export/engine"
	"github.com/blockexport/blockexport/export/nbd"
	"github.com/blockexport/blockexport/formats/registry"
)

type nbdFlags struct {
	serveFlags
	listen         string
	name, desc     string
	parts          partitionFlags
	maxClients     int
	handshakeLimit int
	pollUs         int
	tlsMode        string
	tlsCert        string
	tlsKey         string
	tlsCA          string
	bitmaps        []string
	allocDepth     bool
}

func nbdCommand() *cobra.Command {
	var f nbdFlags
	c := &cobra.Command{
		Use:   "nbd [flags] IMAGE",
		Short: "serve an image over NBD (unix socket or TCP)",
		Long: "Serve IMAGE over NBD. IMAGE is an image file (" + imageFormats() + "),\n" +
			"null:SIZE, an object in HTTP(S) or S3 storage (http://...,\n" +
			"https://..., s3://BUCKET/KEY, read-only), or an export on\n" +
			"another NBD server, named by its URI: nbd://HOST[:PORT]/EXPORT,\n" +
			"nbd+unix:///EXPORT?socket=PATH, and nbds://... or nbds+unix://... for TLS (the\n" +
			"client's files are --image-tls-ca/--image-tls-cert/--image-tls-key; --tls-* are\n" +
			"this server's own).",
		Example: "  blockexport nbd --listen unix:/tmp/nbd.sock -w disk.qcow2\n" +
			"  nbdinfo 'nbd+unix:///?socket=/tmp/nbd.sock'\n" +
			"  blockexport nbd --listen tcp:0.0.0.0:10809 'nbds://storage.example/disk' --image-tls-ca ca.pem",
		RunE: f.run,
	}
	fs := c.Flags()
	f.register(c)
	// IMAGE may be on a TLS server: its client files (--tls-* are ours
	// as a server).
	f.registerTLS(c, "image-")
	fs.StringVar(&f.listen, "listen", "tcp:127.0.0.1:10809", "where to listen: unix:PATH or tcp:HOST:PORT")
	fs.StringVar(&f.name, "export-name", "", "the export's name")
	fs.StringVar(&f.desc, "description", "", "the export's description (NBD_INFO_DESCRIPTION)")
	fs.IntVar(&f.maxClients, "max-clients", 0, "refuse connections beyond this many (0: no limit)")
	fs.IntVar(&f.handshakeLimit, "handshake-limit", int(nbd.DefaultHandshakeLimit/time.Second), "drop a client that has not finished the handshake in this many seconds, so idle sockets cannot hold --max-clients slots (0: no limit; qemu-nbd's flag)")
	fs.StringVar(&f.tlsMode, "tls", "require", "with --tls-cert: require (clients must use TLS; nothing else is answered before it), optional, or off")
	fs.StringVar(&f.tlsCert, "tls-cert", "", "the server's TLS certificate (PEM); turns TLS on")
	fs.StringVar(&f.tlsKey, "tls-key", "", "the server certificate's key (PEM)")
	fs.StringVar(&f.tlsCA, "tls-ca", "", "a CA certificate (PEM): clients must present a certificate it signed")
	fs.StringArrayVarP(&f.bitmaps, "bitmap", "B", nil, "offer the qcow2 persistent dirty bitmap NAME as the meta context qemu:dirty-bitmap:NAME (repeatable; qemu-nbd's -B)")
	fs.BoolVarP(&f.allocDepth, "allocation-depth", "A", false, "offer the meta context qemu:allocation-depth: 0 unallocated, 1 in the image, 2... in its backing chain (qemu-nbd's -A)")
	completeWords(c, "tls", "require", "optional", "off")
	f.parts.register(c, "serve each partition of the image's MBR or GPT too, as export NAME-p1, NAME-p2... (p1, p2... for the default export \"\"), numbered as Linux numbers them")
	fs.IntVar(&f.pollUs, "poll-us", 32, "busy-poll a client's socket for up to this many microseconds before sleeping, adapting to how fast requests come (as QEMU's iothread poll-max-ns); 0: never")
	return c
}

func (f *nbdFlags) run(c *cobra.Command, args []string) error {
	if len(args) != 1 {
		return usagef("nbd: want one IMAGE, got %d argument(s) (see blockexport nbd --help)", len(args))
	}
	logger, opts, err := f.check()
	if err != nil {
		return err
	}
	if err := f.parts.check(c); err != nil {
		return err
	}
	network, addr, err := parseListen(f.listen)
	if err != nil {
		return usageError{err}
	}
	pollMax, err := pollDuration(f.pollUs)
	if err != nil {
		return err
	}
	if f.maxClients < 0 {
		return usagef("--max-clients %d: want 0 or more", f.maxClients)
	}
	if f.handshakeLimit < 0 {
		return usagef("--handshake-limit %d: want 0 or more seconds", f.handshakeLimit)
	}
	tlsConf, tlsMode, err := f.tlsConfig(c)
	if err != nil {
		return err
	}
	if tlsMode == nbd.TLSOff && network == "tcp" && !loopback(addr) {
		logger.Warn("listening on a non-loopback address without TLS: anyone who can reach it can read (and with --writable, write) the image; see --tls-cert", "listen", f.listen)
	}
	if f.daemonize && !isDaemonChild() {
		return daemonize(os.Args)
	}
	img, err := f.open(args[0], opts)
	if err != nil {
		return err
	}
	defer img.Image.Close()
	prefix := ""
	if f.name != "" {
		prefix = f.name + "-"
	}
	disk, parts, err := f.parts.apply(context.Background(), img.Image, args[0], prefix, logger)
	if err != nil {
		return err
	}
	metas, err := nbdMetaContexts(context.Background(), img.Image, f.allocDepth, f.bitmaps)
	if err != nil {
		return err
	}
	extra := make([]nbd.Export, len(parts))
	for i, p := range parts {
		extra[i] = nbd.Export{Name: p.name, Image: p.img}
	}
	sigs, jobs, stop, err := f.begin()
	if err != nil {
		return err
	}
	defer stop()

	l, err := listenOn(network, addr)
	if err != nil {
		return err
	}
	if network == "unix" {
		defer os.Remove(addr)
		jobs.add(func() { os.Remove(addr) })
	}
	// One engine, one node, one export with a server of its own: the
	// daemon's add and delete path serves and stops it. The engine
	// borrows the image: it is flushed and closed here.
	eng := engine.NewOneShot(logger)
	defer eng.Close()
	served := make(chan error, 1)
	if err := eng.AddImageNode(disk, engine.ImageNode{NodeName: oneShotNode, Driver: img.Format,
		Filename: registry.Shown(args[0]), ReadOnly: !f.writable}); err != nil {
		l.Close()
		return err
	}
	if err := eng.AddExport(engine.ExportOptions{Type: "nbd", ID: oneShotExport, NodeName: oneShotNode, Writable: f.writable,
		NBD: &engine.NBDExtras{Listener: l, Ended: served, Server: nbd.Options{Extra: extra, Name: f.name, Description: f.desc,
			MaxClients: f.maxClients, PollMax: pollMax, HandshakeLimit: time.Duration(f.handshakeLimit) * time.Second,
			Logger: logger, TLS: tlsConf, TLSMode: tlsMode, Meta: metas}}}); err != nil {
		l.Close()
		return err
	}
	logger.Info("serving NBD", "image", registry.Shown(args[0]), "format", img.Format, "size", img.Image.Size(), "listen", f.listen, "export", f.name, "writable", f.writable, "tls", tlsMode)
	notifyReady()
	select {
	case s := <-sigs:
		stopping(logger, s, sigs, jobs)
	case err := <-served:
		if err != nil {
			return fmt.Errorf("nbd: %w", err)
		}
	}
	// Closes the listener and waits up to a minute for the connections.
	if err := eng.EndExport(oneShotExport); err != nil {
		logger.Warn("connections did not finish in time", "err", err)
	}
	if err := img.Image.Flush(context.Background()); err != nil {
		return fmt.Errorf("final flush: %w", err)
	}
	return nil
}

// tlsConfig checks the TLS flags: TLS is on with a certificate, and
// --tls says how strictly (require unless given).
func (f *nbdFlags) tlsConfig(c *cobra.Command) (*tls.Config, nbd.TLSMode, error) {
	mode, err := nbd.ParseTLSMode(f.tlsMode)
	if err != nil {
		return nil, "", usageError{err}
	}
	if f.tlsCert == "" {
		if f.tlsKey != "" || f.tlsCA != "" || (c.Flags().Changed("tls") && mode != nbd.TLSOff) {
			return nil, "", usagef("--tls %s, --tls-key and --tls-ca need --tls-cert", mode)
		}
		return nil, nbd.TLSOff, nil
	}
	if f.tlsKey == "" {
		return nil, "", usagef("--tls-cert needs --tls-key")
	}
	if mode == nbd.TLSOff {
		return nil, nbd.TLSOff, nil
	}
	conf, err := nbd.ServerTLSConfig(f.tlsCert, f.tlsKey, f.tlsCA)
	if err != nil {
		return nil, "", err
	}
	return conf, mode, nil
}

// loopback says whether a listen address only takes local connections.
func loopback(hostport string) bool {
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// parseListen splits unix:PATH and tcp:HOST:PORT.
func parseListen(s string) (network, addr string, err error) {
	network, addr, ok := strings.Cut(s, ":")
	if !ok || addr == "" || (network != "unix" && network != "tcp") {
		return "", "", fmt.Errorf("--listen %q: want unix:PATH or tcp:HOST:PORT", s)
	}
	if network == "tcp" {
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return "", "", fmt.Errorf("--listen %q: %v", s, err)
		}
	}
	return network, addr, nil
}

// listenOn listens, replacing a stale unix socket (one nobody answers on).
func listenOn(network, addr string) (net.Listener, error) {
	l, err := net.Listen(network, addr)
	if err == nil || network != "unix" || !errors.Is(err, syscall.EADDRINUSE) {
		if err != nil {
			return nil, fmt.Errorf("listen on %s:%s: %w", network, addr, err)
		}
		return l, nil
	}
	if c, derr := net.DialTimeout("unix", addr, time.Second); derr == nil {
		c.Close()
		return nil, fmt.Errorf("listen on unix:%s: a server is already listening there", addr)
	}
	if st, serr := os.Lstat(addr); serr != nil || st.Mode()&os.ModeSocket == 0 {
		return nil, fmt.Errorf("listen on unix:%s: %w (and it is not a stale socket)", addr, err)
	}
	os.Remove(addr)
	l, err = net.Listen(network, addr)
	if err != nil {
		return nil, fmt.Errorf("listen on unix:%s: %w", addr, err)
	}
	return l, nil
}
