package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/blockexport/blockexport/export/nbd"
)

func runNBD(args []string, stdout, _ io.Writer) error {
	fs := newFlagSet("nbd", "nbd [flags] IMAGE\n\nServe IMAGE (a raw or qcow2 file, or null:SIZE) over NBD.", stdout)
	var f serveFlags
	f.register(fs)
	listen := fs.String("listen", "tcp:127.0.0.1:10809", "where to listen: unix:PATH or tcp:HOST:PORT")
	name := fs.String("export-name", "", "the export's name")
	desc := fs.String("description", "", "the export's description (NBD_INFO_DESCRIPTION)")
	maxClients := fs.Int("max-clients", 0, "refuse connections beyond this many (0: no limit)")
	handshakeLimit := fs.Int("handshake-limit", int(nbd.DefaultHandshakeLimit/time.Second), "drop a client that has not finished the handshake in this many seconds, so idle sockets cannot hold --max-clients slots (0: no limit; qemu-nbd's flag)")
	pollUs := fs.Int("poll-us", 32, "busy-poll a client's socket for up to this many microseconds before sleeping, adapting to how fast requests come (as QEMU's iothread poll-max-ns); 0: never")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		return usagef("nbd: want one IMAGE, got %d argument(s) (see blockexport nbd --help)", fs.NArg())
	}
	logger, opts, err := f.check()
	if err != nil {
		return err
	}
	network, addr, err := parseListen(*listen)
	if err != nil {
		return usageError{err}
	}
	pollMax, err := pollDuration(*pollUs)
	if err != nil {
		return err
	}
	if *maxClients < 0 {
		return usagef("--max-clients %d: want 0 or more", *maxClients)
	}
	if *handshakeLimit < 0 {
		return usagef("--handshake-limit %d: want 0 or more seconds", *handshakeLimit)
	}
	if f.daemonize && !isDaemonChild() {
		return daemonize(os.Args)
	}
	img, err := f.open(fs.Arg(0), opts)
	if err != nil {
		return err
	}
	defer img.Image.Close()

	l, err := listenOn(network, addr)
	if err != nil {
		return err
	}
	if network == "unix" {
		defer os.Remove(addr)
	}
	stop, err := f.start()
	if err != nil {
		l.Close()
		return err
	}
	defer stop()
	srv := nbd.New(img.Image, nbd.Options{Name: *name, Description: *desc, Writable: f.writable, MaxClients: *maxClients,
		PollMax: pollMax, HandshakeLimit: time.Duration(*handshakeLimit) * time.Second, Logger: logger})
	sigs := stopSignals()
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	logger.Info("serving NBD", "image", fs.Arg(0), "format", img.Format, "size", img.Image.Size(), "listen", *listen, "export", *name, "writable", f.writable)
	notifyReady()
	select {
	case s := <-sigs:
		stopping(logger, s, sigs)
	case err := <-served:
		if err != nil {
			return fmt.Errorf("nbd: %w", err)
		}
	}
	l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := srv.Shutdown(ctx); err != nil {
		logger.Warn("connections did not finish in time", "err", err)
	}
	if err := img.Image.Flush(context.Background()); err != nil {
		return fmt.Errorf("final flush: %w", err)
	}
	return nil
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
