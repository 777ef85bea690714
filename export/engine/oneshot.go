package engine

import (
	"context"
	"log/slog"
	"net"

	fuseexport "github.com/blockexport/blockexport/export/fuse"
	"github.com/blockexport/blockexport/export/nbd"
	"github.com/blockexport/blockexport/formats"
)

// The one-shot commands (blockexport fuse IMAGE MOUNTPOINT) are an engine
// with one node and one export: the image the command line names, opened
// by the command as it always was (format probing, partitions, remote
// sources, TLS, backing confinement), is added as a node, and served
// through the same export add and delete path as the daemon's exports.
// What such a command has beyond QEMU's export keys (kernel cache,
// read-ahead, queues, polling, --file-name and partitions, stats, page
// lending) are the extra options here.

// ImageNode describes an image opened outside the engine, added as a
// node by AddImageNode.
type ImageNode struct {
	// NodeName names the node, as blockdev-add's node-name.
	NodeName string
	// Driver is the node's driver as query-named-block-nodes shows it
	// (the image's format), and Filename its file.
	Driver   string
	Filename string
	// ReadOnly refuses writable exports of the node.
	ReadOnly bool
}

// AddImageNode adds img, opened by the caller, as a node. The caller
// keeps it: the engine neither flushes nor closes it (the node is
// borrowed, as a copy-on-read filter's child image is), so that the
// caller flushes and closes it once the engine is closed, and reports
// those errors as it always has.
func (e *Engine) AddImageNode(img formats.Image, o ImageNode) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if !nodeName.MatchString(o.NodeName) {
		return genericf("Invalid node-name: '%s'", o.NodeName)
	}
	if e.node(o.NodeName) != nil {
		return genericf("Duplicate nodes with node-name='%s'", o.NodeName)
	}
	e.nodes = append(e.nodes, &node{name: o.NodeName, driver: o.Driver, readOnly: o.ReadOnly, img: img,
		borrowed: true, filename: o.Filename})
	return nil
}

// FUSEExtras are a FUSE export's options beyond QEMU's keys: those of the
// one-shot fuse command. With them, the export follows that command's
// rules instead of QEMU 7.2's: the mountpoint is created when missing,
// may be the image file itself, or is an existing directory holding the
// export as Mount.FileName (and its partitions as Mount.Extra); a mount
// that fails returns fuseexport's error as it is, not in QEMU's words.
type FUSEExtras struct {
	// Export is how the export serves (fuseexport.Tune's result: kernel
	// cache, read-ahead, page lending, its logger). Its Writable and
	// Growable are the ExportOptions' own.
	Export fuseexport.Options
	// Mount is how it is mounted and served: allow-other (this, not
	// ExportOptions.AllowOther), queues, polling, stats, the file name
	// and extra files. FsName "" is the node's name.
	Mount fuseexport.MountOptions
}

// startFUSEExtras is startFUSE for an export with FUSEExtras.
func (e *Engine) startFUSEExtras(x *export) error {
	o := x.o
	for _, y := range e.exports {
		if y.mount != nil && y.o.Mountpoint == o.Mountpoint {
			return genericf("There already is a FUSE export on '%s'", o.Mountpoint)
		}
	}
	img, err := x.node.acquire(e, o.Writable)
	if err != nil {
		return err
	}
	eo := o.FUSE.Export
	eo.Writable, eo.Growable = o.Writable, o.Growable && o.Writable
	if eo.Logger == nil {
		eo.Logger = e.log.With("export", o.ID)
	}
	mo := o.FUSE.Mount
	if mo.FsName == "" {
		mo.FsName = x.node.name
	}
	m, err := fuseexport.New(img, eo).Mount(o.Mountpoint, mo)
	if err != nil {
		x.node.release()
		return err
	}
	x.mount = m
	return nil
}

// FUSEMount is the mount of the FUSE export id, nil if there is none:
// for a caller that waits on it (Done: unmounted from outside), reports
// its file, or abandons it at a fast exit.
func (e *Engine) FUSEMount(id string) *fuseexport.Mount {
	e.mu.Lock()
	defer e.mu.Unlock()
	if x := e.findExport(id); x != nil {
		return x.mount
	}
	return nil
}

// EndExport is DelExport (safe mode) for a caller that must know how the
// export's end went: the unmount's error, which DelExport only logs, is
// returned. A FUSE export unmounted from outside ends without a second
// unmount.
func (e *Engine) EndExport(id string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	x := e.findExport(id)
	if x == nil {
		return genericf("Export '%s' is not found", id)
	}
	stopErr, err := e.endExport(context.Background(), x, false)
	if err != nil {
		return err
	}
	return stopErr
}

// quietHandler passes on only records at Warn and above: the one-shot
// commands' engine keeps its own bookkeeping lines (export added,
// deleted) out of a log whose lines are the command's.
type quietHandler struct{ slog.Handler }

func (h quietHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= slog.LevelWarn && h.Handler.Enabled(ctx, l)
}

func (h quietHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return quietHandler{h.Handler.WithAttrs(as)}
}

func (h quietHandler) WithGroup(name string) slog.Handler {
	return quietHandler{h.Handler.WithGroup(name)}
}

// NewOneShot makes the engine of a one-shot command, logging to logger
// only what goes wrong: the command logs its own lines.
func NewOneShot(logger *slog.Logger) *Engine {
	return New(Options{Logger: slog.New(quietHandler{logger.Handler()})})
}

// NBDExtras make an NBD export the one export of a server of its own, as
// the one-shot nbd command (and qemu-nbd) serves one image: on the
// caller's listener, with the caller's server options (TLS, max-clients,
// handshake limit, polling, its logger), the export's name, description
// and meta contexts (Server.Name, Description, Meta: -B bitmaps,
// allocation depth) and the partitions as extra exports (Server.Extra).
// Its writability is ExportOptions.Writable. Ending the export closes the
// listener (a unix socket's file is the caller's to remove) and ends the
// server's connections, waiting up to a minute for them.
type NBDExtras struct {
	Listener net.Listener
	Server   nbd.Options
	// Ended, when set, receives Serve's end, once: an error of the
	// listener, or nil once the export ended. It needs room for it.
	Ended chan<- error
}

// startNBDExtras is startNBD for an export with NBDExtras.
func (e *Engine) startNBDExtras(x *export) error {
	o := x.o.NBD
	img, err := x.node.acquire(e, x.o.Writable)
	if err != nil {
		return err
	}
	so := o.Server
	so.Writable = x.o.Writable
	if so.Logger == nil {
		so.Logger = e.log.With("export", x.o.ID)
	}
	srv := nbd.New(img, so)
	s := &nbdServer{srv: srv, l: o.Listener, served: make(chan error, 1), busy: map[bitmapKey]bool{}}
	go func() {
		err := srv.Serve(o.Listener)
		s.served <- err
		if o.Ended != nil {
			o.Ended <- err
		}
	}()
	x.server = s
	return nil
}
