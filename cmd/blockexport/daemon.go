package main

import (
	"fmt"
	"net"
	"os"
	"regexp"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/export/engine"
	"github.com/blockexport/blockexport/export/qmp"
)

// daemonCommand is qemu-storage-daemon's command line on our engine: the
// options are read in the order given, each acted on as QSD acts on it,
// so a script written for QSD runs with this binary in its place.
func daemonCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "daemon [--blockdev OPTS]... [--export OPTS]... [--nbd-server OPTS] [--object OPTS]... [--chardev OPTS --monitor OPTS]... [--pidfile PATH] [--daemonize]",
		Short: "serve many images and exports in one process, driven as qemu-storage-daemon is (its command line and QMP)",
		Long: "Run a daemon that takes qemu-storage-daemon's command line and speaks QMP on its\n" +
			"monitors. Options are acted on in the order given, as QSD does:\n" +
			"  --blockdev driver=file|null-co|raw|qcow2|vmdk|vhdx|vpc|vdi,node-name=NAME,...  (or JSON)\n" +
			"             file: filename=PATH[,aio=threads|io_uring|native (QEMU's default threads; native needs cache.direct=on)];\n" +
			"             any node: [,cache.direct=on (O_DIRECT, inherited by an inline file child)]\n" +
			"  --blockdev driver=nbd,node-name=NAME,server.type=unix,server.path=PATH | server.type=inet,server.host=HOST,server.port=PORT\n" +
			"             [,export=NAME][,tls-creds=ID][,tls-hostname=NAME][,reconnect-delay=SECONDS]\n" +
			"  --blockdev driver=http|https,node-name=NAME,url=URL,read-only=on[,timeout=SECONDS][,readahead=BYTES]\n" +
			"             [,sslverify=on|off][,tls-ca=FILE (ours: https's CA)]\n" +
			"  --blockdev driver=s3,node-name=NAME,url=s3://BUCKET/KEY,read-only=on[,s3-endpoint=URL][,s3-path-style=on]  (ours)\n" +
			"  --blockdev driver=copy-on-read,node-name=NAME,file=NODE  (reads copy what NODE's overlay lacks into it)\n" +
			"  --export [type=]fuse,id=ID,node-name=NAME,mountpoint=FILE[,writable=on][,growable=on][,allow-other=on|off|auto]\n" +
			"  --export [type=]nbd,id=ID,node-name=NAME[,name=NAME][,description=TEXT][,writable=on][,bitmaps.0=BITMAP,...]\n" +
			"  --nbd-server addr.type=unix,addr.path=PATH | addr.type=inet,addr.host=HOST,addr.port=PORT[,tls-creds=ID][,max-connections=N]\n" +
			"             (at max-connections further clients wait, unanswered, until one leaves)\n" +
			"  --object tls-creds-x509,id=ID,dir=DIR[,endpoint=server|client][,verify-peer=on|off]  (DIR: ca-cert.pem, server-cert.pem, server-key.pem;\n" +
			"             a client endpoint's, for driver=nbd's tls-creds: ca-cert.pem[, client-cert.pem, client-key.pem])\n" +
			"  --chardev socket,id=ID,path=PATH,server=on,wait=off | --chardev stdio,id=ID\n" +
			"  --monitor [chardev=]ID     QMP on that chardev (its unix socket is created 0600)\n" +
			"  --pidfile PATH, --daemonize\n" +
			"QMP commands: qmp_capabilities, query-version, query-commands, blockdev-add, blockdev-del,\n" +
			"block-export-add, block-export-del, query-block-exports, query-named-block-nodes,\n" +
			"block_resize, query-blockstats, nbd-server-start, nbd-server-stop, object-add, object-del (tls-creds-x509),\n" +
			"block-stream, block-commit (the active layer too: ready, then job-complete), query-jobs, job-cancel, job-complete, job-finalize,\n" +
			"job-dismiss, quit; any other is CommandNotFound.",
		Example: "  blockexport daemon --chardev socket,id=m,path=/tmp/qmp.sock,server=on,wait=off --monitor chardev=m \\\n" +
			"    --blockdev driver=file,node-name=f,filename=disk.qcow2 --blockdev driver=qcow2,node-name=q,file=f \\\n" +
			"    --export type=fuse,id=e,node-name=q,mountpoint=/tmp/disk.raw,writable=on",
		DisableFlagParsing: true, // QSD's own syntax, in order (parseDaemonArgs)
		RunE: func(c *cobra.Command, args []string) error {
			for _, a := range args {
				switch a {
				case "-h", "--help":
					return c.Help()
				case "-V", "--version":
					fmt.Fprintln(c.OutOrStdout(), version())
					return nil
				}
			}
			opts, err := parseDaemonArgs(args)
			if err != nil {
				return err
			}
			return runDaemon(opts)
		},
	}
}

// daemonGCPercent is the daemon's GOGC. Its live heap is mostly the
// images' tables (a qcow2 node's L2 and refcount tables: 128 KiB at 64 KiB
// clusters, pointer-free, cheap to mark), and its requests allocate little:
// letting the heap grow 25% between collections rather than Go's 100%
// keeps the resident set near what is in use (200 qcow2 exports: about 56
// MB against 65) for a few more short collections. The one-shot commands
// keep Go's default.
const daemonGCPercent = 25

// daemonOption is one option of the command line, in order.
type daemonOption struct{ name, value string }

// daemonArgs is the parsed command line.
type daemonArgs struct {
	opts      []daemonOption
	pidfile   string
	daemonize bool
}

// daemonOptions take a value; QSD's -T and the like are refused
// by name, not taken for something else.
var daemonOptions = map[string]bool{"blockdev": true, "export": true, "nbd-server": true, "object": true, "chardev": true, "monitor": true, "pidfile": true}

func parseDaemonArgs(args []string) (daemonArgs, error) {
	var d daemonArgs
	for i := 0; i < len(args); i++ {
		name, value, hasValue := strings.Cut(strings.TrimLeft(args[i], "-"), "=")
		if !strings.HasPrefix(args[i], "-") {
			return d, usagef("daemon: unexpected argument %q", args[i])
		}
		if name == "daemonize" && !hasValue {
			d.daemonize = true
			continue
		}
		if !daemonOptions[name] {
			return d, usagef("daemon: option --%s is not supported here (see blockexport daemon --help)", name)
		}
		if !hasValue {
			if i+1 >= len(args) {
				return d, usagef("daemon: --%s needs a value", name)
			}
			i++
			value = args[i]
		}
		if name == "pidfile" {
			d.pidfile = value
			continue
		}
		d.opts = append(d.opts, daemonOption{name, value})
	}
	return d, nil
}

// chardev is a --chardev: a unix socket server or stdio.
type chardev struct {
	backend, path string
}

// runDaemon sets up what the options say, in their order, then serves
// until quit or a signal.
func runDaemon(d daemonArgs) error {
	if d.daemonize && !isDaemonChild() {
		return daemonize(os.Args)
	}
	logger, err := serveLogger("warn", "", d.daemonize)
	if err != nil {
		return err
	}
	if os.Getenv("GOGC") == "" { // the user's GOGC wins
		debug.SetGCPercent(daemonGCPercent)
	}
	srv := qmp.New(nil, qmpVersion(), logger)
	eng := engine.New(engine.Options{Logger: logger, Backend: aio.IOUring, Event: srv.Event, ReturnMemory: true})
	srv.SetEngine(eng)
	sigs, jobs, stop, err := (&serveFlags{pidfile: d.pidfile}).begin()
	if err != nil {
		return err
	}
	defer stop()
	var listeners []net.Listener
	cleanup := func() {
		for _, l := range listeners {
			l.Close()
		}
		eng.Close()
	}
	jobs.add(cleanup)
	chardevs := map[string]chardev{}
	var monitors []func()
	for _, o := range d.opts {
		l, serve, err := applyDaemonOption(o, eng, srv, chardevs)
		if err != nil {
			cleanup()
			return err
		}
		if l != nil {
			listeners = append(listeners, l)
		}
		if serve != nil {
			monitors = append(monitors, serve)
		}
	}
	// Monitors answer only once every option is acted on, as QSD's main
	// loop starts after them: a client that connected early waits, and
	// then sees every node and export the command line made.
	for _, serve := range monitors {
		serve()
	}
	notifyReady()
	select {
	case s := <-sigs:
		stopping(logger, s, sigs, jobs)
	case <-srv.Quit():
	}
	cleanup()
	return nil
}

// applyDaemonOption acts on one option; a monitor returns its listener
// (nil for stdio) and what starts serving it.
func applyDaemonOption(o daemonOption, eng *engine.Engine, srv *qmp.Server, chardevs map[string]chardev) (net.Listener, func(), error) {
	implied := map[string]string{"export": "type", "object": "qom-type", "chardev": "backend", "monitor": "chardev"}[o.name]
	m, keyval, err := qmp.ParseOption(o.value, implied)
	if err != nil {
		return nil, nil, fmt.Errorf("--%s: %w", o.name, err)
	}
	switch o.name {
	case "blockdev":
		bo, err := qmp.BlockdevOptions(m, keyval)
		if err == nil {
			err = eng.AddNode(bo)
		}
		return nil, nil, err
	case "export":
		eo, err := qmp.ExportOptions(m, keyval)
		if err == nil {
			err = eng.AddExport(eo)
		}
		return nil, nil, err
	case "nbd-server":
		no, err := qmp.NBDServerFlat(m)
		if err == nil {
			err = eng.StartNBD(no)
		}
		return nil, nil, err
	case "object":
		to, err := qmp.TLSCredsOptions(m, keyval)
		if err == nil {
			err = eng.AddTLSCreds(to)
		}
		return nil, nil, err
	case "chardev":
		return nil, nil, addChardev(m, chardevs)
	case "monitor":
		return listenMonitor(m, srv, chardevs)
	}
	return nil, nil, fmt.Errorf("--%s: not supported", o.name)
}

// addChardev records a chardev; only what a QMP monitor uses is taken.
func addChardev(m map[string]any, chardevs map[string]chardev) error {
	id, _ := m["id"].(string)
	backend, _ := m["backend"].(string)
	if id == "" {
		return fmt.Errorf("--chardev: Parameter 'id' is missing")
	}
	if _, ok := chardevs[id]; ok {
		return fmt.Errorf("--chardev: attempt to add duplicate property '%s' to object (type 'container')", id)
	}
	switch backend {
	case "stdio":
		chardevs[id] = chardev{backend: backend}
		return nil
	case "socket":
		path, _ := m["path"].(string)
		if path == "" {
			return fmt.Errorf("--chardev %s: only unix socket servers (path=PATH,server=on) are supported here", id)
		}
		if s, _ := m["server"].(string); s != "on" && s != "yes" && s != "true" {
			return fmt.Errorf("--chardev %s: only server=on is supported here", id)
		}
		chardevs[id] = chardev{backend: backend, path: path}
		return nil
	}
	return fmt.Errorf("--chardev: backend %q is not supported here (socket or stdio)", backend)
}

// listenMonitor makes a monitor's chardev: stdio, or a unix socket
// made 0600 (the monitor can add and remove any file's export: only its
// owner may connect); serve starts answering on it.
func listenMonitor(m map[string]any, srv *qmp.Server, chardevs map[string]chardev) (l net.Listener, serve func(), err error) {
	id, _ := m["chardev"].(string)
	if mode, ok := m["mode"].(string); ok && mode != "control" {
		return nil, nil, fmt.Errorf("--monitor: Only QMP is supported")
	}
	cd, ok := chardevs[id]
	if !ok {
		return nil, nil, fmt.Errorf("--monitor: chardev \"%s\" not found", id)
	}
	if cd.backend == "stdio" {
		return nil, func() { go srv.ServeConn(stdio{}) }, nil
	}
	if st, err := os.Lstat(cd.path); err == nil && st.Mode()&os.ModeSocket != 0 {
		os.Remove(cd.path) // QEMU unlinks a socket left behind before binding
	}
	old := syscall.Umask(0o177)
	l, err = net.Listen("unix", cd.path)
	syscall.Umask(old)
	if err != nil {
		return nil, nil, fmt.Errorf("--chardev %s: Failed to bind socket to %s: %w", id, cd.path, err)
	}
	if err := os.Chmod(cd.path, 0o600); err != nil {
		l.Close()
		return nil, nil, fmt.Errorf("--chardev %s: %w", id, err)
	}
	return l, func() { go srv.Serve(l) }, nil
}

// stdio is the process's stdin and stdout as one stream.
type stdio struct{}

func (stdio) Read(p []byte) (int, error)  { return os.Stdin.Read(p) }
func (stdio) Write(p []byte) (int, error) { return os.Stdout.Write(p) }
func (stdio) Close() error                { return nil }

// qmpVersion is our own version in QMP's fields: the module version's
// numbers (0.0.0 for a development build) and the full version line as
// the package.
func qmpVersion() qmp.Version {
	v := qmp.Version{Package: version()}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return v
	}
	if m := regexp.MustCompile(`^v(\d+)\.(\d+)\.(\d+)`).FindStringSubmatch(bi.Main.Version); m != nil {
		v.Major, _ = strconv.Atoi(m[1])
		v.Minor, _ = strconv.Atoi(m[2])
		v.Micro, _ = strconv.Atoi(m[3])
	}
	return v
}
