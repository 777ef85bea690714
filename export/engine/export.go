package engine

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"time"

	fuseexport "github.com/blockexport/blockexport/export/fuse"
	"github.com/blockexport/blockexport/export/nbd"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/qcow2"
	"github.com/blockexport/blockexport/formats/filters/copyonread"
)

// ExportOptions are block-export-add's arguments (types fuse and nbd).
type ExportOptions struct {
	Type     string // "fuse" or "nbd"
	ID       string
	NodeName string
	Writable bool
	// Mountpoint, Growable and AllowOther are fuse's; AllowOther is
	// "on", "off" or "auto" (QEMU's default).
	Mountpoint string
	Growable   bool
	AllowOther string
	// Name (default: the node's name), Description and Bitmaps are
	// nbd's. Bitmaps name the node's persistent dirty bitmaps offered as
	// the meta contexts qemu:dirty-bitmap:NAME, in their order.
	Name        *string
	Description string
	Bitmaps     []string
	// FUSE are our own FUSE options, beyond QEMU's keys (oneshot.go);
	// nil: QEMU's behaviour.
	FUSE *FUSEExtras
	// NBD, our own, makes an nbd export the one export of a server of
	// its own (oneshot.go); nil: an export on nbd-server-start's server.
	NBD *NBDExtras
}

// ExportInfo is one row of query-block-exports.
type ExportInfo struct {
	ID           string `json:"id"`
	Type         string `json:"type"`
	NodeName     string `json:"node-name"`
	ShuttingDown bool   `json:"shutting-down"`
}

// export is one export of a node.
type export struct {
	o    ExportOptions
	node *node
	// mount is a FUSE export's; nbdName an NBD export's name on the
	// server.
	mount   *fuseexport.Mount
	nbdName string
	// unquiesce takes a FUSE export off its node's pivotImage's fronts.
	unquiesce func()
	// bitmaps are the bitmaps an NBD export holds busy.
	bitmaps []bitmapKey
	// server is the own server of an NBD export with NBDExtras.
	server *nbdServer
}

// exportTimeout bounds how long a hard removal waits for an NBD
// client's requests in flight.
const exportTimeout = time.Minute

// AddExport starts an export (block-export-add), checking what QEMU
// checks in its order. On failure nothing is left added.
func (e *Engine) AddExport(o ExportOptions) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if !nodeName.MatchString(o.ID) {
		return genericf("Invalid block export id")
	}
	if e.findExport(o.ID) != nil {
		return genericf("Block export id '%s' is already in use", o.ID)
	}
	n := e.node(o.NodeName)
	if n == nil {
		return genericf("Cannot find device='' nor node-name='%s'", o.NodeName)
	}
	if err := e.exportConflict(n, o); err != nil {
		return err
	}
	x := &export{o: o, node: n}
	var err error
	switch o.Type {
	case "fuse":
		err = e.startFUSE(x)
	case "nbd":
		err = e.startNBD(x)
	default:
		err = genericf("Parameter 'type' does not accept value '%s'", o.Type)
	}
	if err != nil {
		return err
	}
	e.exports = append(e.exports, x)
	e.log.Info("export added", "id", o.ID, "type", o.Type, "node-name", o.NodeName, "writable", o.Writable)
	return nil
}

// startFUSE mounts the node over Mountpoint, which QEMU 7.2 wants to be
// an existing regular file.
func (e *Engine) startFUSE(x *export) error {
	o := x.o
	if o.FUSE != nil {
		return e.startFUSEExtras(x)
	}
	// Before the stat, as QEMU: a stat of our own mount point would wait
	// on the export that answers it.
	for _, y := range e.exports {
		if y.mount != nil && y.o.Mountpoint == o.Mountpoint {
			return genericf("There already is a FUSE export on '%s'", o.Mountpoint)
		}
	}
	st, err := os.Stat(o.Mountpoint)
	if err != nil {
		return genericf("Failed to stat '%s': %s", o.Mountpoint, errnoText(err))
	}
	if !st.Mode().IsRegular() {
		return genericf("'%s' is not a regular file", o.Mountpoint)
	}
	allowOther, err := fuseexport.ParseAllowOther(cmp.Or(o.AllowOther, "auto"))
	if err != nil {
		return genericf("Parameter 'allow-other' does not accept value '%s'", o.AllowOther)
	}
	img, err := x.node.acquire(e, o.Writable)
	if err != nil {
		return err
	}
	// No kernel cache, as QEMU's FUSE export has none: the same node may
	// be written through NBD or another export meanwhile, which a cache
	// here would not see.
	// growable without writable is taken and means nothing, as in QEMU.
	exp := fuseexport.New(img, fuseexport.Options{Writable: o.Writable, Growable: o.Growable && o.Writable, Logger: e.log.With("export", o.ID)})
	// Its replies carry lent pages after the image's calls return: a
	// swap of the image waits for them.
	if p, ok := img.(*pivotImage); ok {
		x.unquiesce = p.addFront(exp)
	}
	m, err := exp.Mount(o.Mountpoint, fuseexport.MountOptions{AllowOther: allowOther, FsName: x.node.name, Queues: 1, ParkIdle: fuseParkIdle})
	if err != nil {
		if x.unquiesce != nil {
			x.unquiesce()
		}
		x.node.release()
		return genericf("Failed to mount FUSE export on '%s': %v", o.Mountpoint, err)
	}
	x.mount = m
	return nil
}

// fuseParkIdle is how long a daemon's FUSE export waits for its next
// request in poll(2), holding a thread, before it parks in the netpoller:
// a daemon of 200 idle exports held 200 threads, about 15 KiB resident
// each (their Go stacks), and kept them; a busy export never waits that
// long.
const fuseParkIdle = 10 * time.Millisecond

// startNBD adds the node to the running NBD server.
func (e *Engine) startNBD(x *export) error {
	if x.o.NBD != nil {
		return e.startNBDExtras(x)
	}
	if e.nbd == nil {
		return genericf("NBD server not running")
	}
	name := x.node.name
	if x.o.Name != nil {
		name = *x.o.Name
	}
	if len(name) > 4096 {
		return genericf("export name '%s' too long", name)
	}
	if len(x.o.Description) > 4096 {
		return genericf("description '%s' too long", x.o.Description)
	}
	if e.nbd.has(name) {
		return genericf("NBD server already has export named '%s'", name)
	}
	img, err := x.node.acquire(e, x.o.Writable)
	if err != nil {
		return err
	}
	metas, keys, err := e.exportBitmaps(x, img)
	if err != nil {
		x.node.release()
		return genericf("%v", err)
	}
	if err := e.nbd.srv.Add(nbd.Export{Name: name, Description: x.o.Description, Image: img, Writable: x.o.Writable, Meta: metas}); err != nil {
		x.node.release()
		return genericf("%v", err)
	}
	x.nbdName, x.bitmaps = name, keys
	for _, k := range keys {
		e.nbd.busy[k] = true
	}
	return nil
}

func (e *Engine) findExport(id string) *export {
	for _, x := range e.exports {
		if x.o.ID == id {
			return x
		}
	}
	return nil
}

// DelExport ends an export (block-export-del). Safe mode refuses while
// an NBD client is connected to it; hard mode disconnects them. A FUSE
// export whose file is held open is detached either way, its users
// getting ENOTCONN, as QEMU's unmount leaves them.
func (e *Engine) DelExport(id string, hard bool) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	x := e.findExport(id)
	if x == nil {
		return genericf("Export '%s' is not found", id)
	}
	return e.removeExport(context.Background(), x, hard)
}

// removeExport stops x, releases its node and sends
// BLOCK_EXPORT_DELETED (under mu).
func (e *Engine) removeExport(ctx context.Context, x *export, hard bool) error {
	stopErr, err := e.endExport(ctx, x, hard)
	if stopErr != nil {
		e.log.Warn("export ended with an error", "id", x.o.ID, "err", stopErr)
	}
	return err
}

// endExport is removeExport, returning how the export's stop went
// (stopErr) besides its refusal (err) instead of logging it.
func (e *Engine) endExport(ctx context.Context, x *export, hard bool) (stopErr, err error) {
	switch {
	case x.mount != nil:
		select {
		case <-x.mount.Done(): // unmounted from outside: nothing to unmount
		default:
			stopErr = x.mount.Unmount()
		}
		x.mount.Cleanup()
	case x.server != nil:
		stopErr = x.server.stop()
	case x.nbdName != "" && e.nbd != nil:
		ctx, cancel := context.WithTimeout(ctx, exportTimeout)
		stopErr = e.nbd.srv.Remove(ctx, x.nbdName, hard)
		cancel()
		if errors.Is(stopErr, nbd.ErrExportInUse) {
			return nil, &Error{Class: Generic, Desc: "export '" + x.o.ID + "' still in use"}
		}
		for _, k := range x.bitmaps {
			delete(e.nbd.busy, k)
		}
	}
	if x.unquiesce != nil {
		x.unquiesce()
	}
	e.exports = slices.DeleteFunc(e.exports, func(y *export) bool { return y == x })
	if rerr := x.node.release(); stopErr == nil {
		stopErr = rerr
	}
	e.log.Info("export deleted", "id", x.o.ID)
	e.event("BLOCK_EXPORT_DELETED", map[string]any{"id": x.o.ID})
	return stopErr, nil
}

// Exports lists the exports for query-block-exports, newest first as
// QEMU lists them.
func (e *Engine) Exports() []ExportInfo {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]ExportInfo, 0, len(e.exports))
	for i := len(e.exports) - 1; i >= 0; i-- {
		x := e.exports[i]
		out = append(out, ExportInfo{ID: x.o.ID, Type: x.o.Type, NodeName: x.node.name})
	}
	return out
}

// DirtyBitmapContexts are the meta contexts qemu:dirty-bitmap:NAME of
// img's persistent bitmaps names, in that order, each once, as an NBD
// export offers them (block-export-add's bitmaps, qemu-nbd's -B). A
// bitmap the image lacks, or one in use, is refused in QEMU's words. A
// copy-on-read node's bitmaps are its overlay's.
func DirtyBitmapContexts(ctx context.Context, img formats.Image, names []string) ([]nbd.MetaContext, error) {
	img = bitmapOwner(img)
	var metas []nbd.MetaContext
	seen := map[string]bool{}
	for _, name := range names {
		if seen[name] {
			continue
		}
		seen[name] = true
		q, ok := img.(*qcow2.Image)
		if !ok {
			return nil, fmt.Errorf("Bitmap '%s' is not found", name)
		}
		bm, err := q.DirtyBitmap(ctx, name)
		if err != nil {
			return nil, err
		}
		metas = append(metas, nbd.MetaContext{Name: "qemu:dirty-bitmap:" + name, Extent: func(_ context.Context, off, n int64) (int64, uint32, error) {
			l, dirty := bm.Extent(off, n)
			if dirty {
				return l, 1, nil // NBD_STATE_DIRTY
			}
			return l, 0, nil
		}})
	}
	return metas, nil
}

// exportBitmaps are the meta contexts of x's bitmaps and the bitmaps
// they hold busy, each checked as QEMU checks it, in their order: found,
// not enabled under a read-only export of a writable node, not offered
// by another export.
func (e *Engine) exportBitmaps(x *export, img formats.Image) ([]nbd.MetaContext, []bitmapKey, error) {
	ctx := context.Background()
	var metas []nbd.MetaContext
	var keys []bitmapKey
	for _, name := range x.o.Bitmaps {
		m, err := DirtyBitmapContexts(ctx, img, []string{name})
		if err == nil && !x.o.Writable && !x.node.readOnly {
			err = enabledBitmap(ctx, img, name)
		}
		k := bitmapKey{bitmapOwner(img), name}
		if err == nil && e.nbd.busy[k] {
			err = fmt.Errorf("Bitmap '%s' is currently in use by another operation and cannot be used", name)
		}
		if err != nil {
			return nil, nil, err
		}
		if !slices.Contains(keys, k) {
			metas, keys = append(metas, m...), append(keys, k)
		}
	}
	return metas, keys, nil
}

// bitmapOwner is the image whose bitmaps img offers: a copy-on-read
// node's are its overlay's.
func bitmapOwner(img formats.Image) formats.Image {
	for {
		switch w := img.(type) {
		case *pivotImage: // a format node's image as its exports hold it
			img = w.Wrapped()
		case *copyonread.Image:
			img = w.Image
		default:
			return img
		}
	}
}

// enabledBitmap refuses, as QEMU does, a read-only export of a writable
// node with an enabled bitmap: the node's other writers would change the
// bitmap under a client that takes the export for a fixed view.
func enabledBitmap(ctx context.Context, img formats.Image, name string) error {
	q, ok := bitmapOwner(img).(*qcow2.Image)
	if !ok {
		return nil
	}
	infos, _, err := q.PersistentBitmaps(ctx)
	if err != nil {
		return err
	}
	for _, b := range infos {
		if b.Name == name && slices.Contains(b.Flags, "auto") {
			return fmt.Errorf("Enabled bitmap '%s' incompatible with readonly export", name)
		}
	}
	return nil
}
