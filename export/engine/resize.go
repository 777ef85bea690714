package engine

import (
	"context"
	"os"

	"github.com/blockexport/blockexport/formats"
)

// resizeChecker is a qcow2 image that may refuse any resize (internal
// snapshots, an external data file).
type resizeChecker interface{ ResizeAllowed() error }

// Resize changes a node's virtual size (block_resize). QSD finds the
// node by node-name only: device names a BlockBackend, and a daemon has
// none with a name. Its permission checks are QEMU's as far as they
// apply here: an NBD export unshares resize on its node, and a format
// node unshares it on its file child.
func (e *Engine) Resize(ctx context.Context, device, nodeName string, size int64) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	var n *node
	if nodeName != "" {
		n = e.node(nodeName)
	}
	if n == nil {
		return genericf("Cannot find device='%s' nor node-name='%s'", device, nodeName)
	}
	if size < 0 {
		return genericf("Parameter 'size' expects a >0 size")
	}
	if e.jobOn(n) != nil {
		// QEMU 7.2 words it so: the device name it prints is unset
		// when the node was named by node-name.
		return genericf("Device '(null)' is in use")
	}
	if err := e.resizeConflict(n); err != nil {
		return err
	}
	if n.readOnly {
		return genericf("Image is read-only")
	}
	if err := n.resize(ctx, size); err != nil {
		return err
	}
	e.log.Info("block node resized", "node-name", n.name, "size", size)
	return nil
}

// resizeConflict is QEMU's permission conflict on taking resize.
func (e *Engine) resizeConflict(n *node) error {
	const head = "Permission conflict on node '%s': permissions 'resize' are both required by an unnamed block device (uses node '%s' as 'root' child) and unshared by "
	for _, x := range e.exports {
		if x.node == n && x.nbdName != "" {
			return genericf(head+"an unnamed block device (uses node '%s' as 'root' child).", n.name, n.name, n.name)
		}
	}
	for _, p := range e.nodes {
		if p.child == n {
			return genericf(head+"node '%s' (uses node '%s' as 'file' child).", n.name, n.name, p.name, n.name)
		}
	}
	return nil
}

// resize applies the new size: raw and qcow2 through their image, a
// file node through its host file; QEMU's other drivers here cannot.
func (n *node) resize(ctx context.Context, size int64) error {
	switch n.driver {
	case "file":
		if n.img != nil {
			return n.resizeImage(ctx, n.img, size)
		}
		if err := os.Truncate(n.path, size); err != nil {
			return genericf("Failed to resize file: %s", errnoText(err))
		}
		return nil
	case "raw":
		return n.resizeImage(ctx, n.img, size)
	case "qcow2":
		if size%512 != 0 {
			return genericf("The new size must be a multiple of 512")
		}
		if c, ok := n.core().(resizeChecker); ok {
			if err := c.ResizeAllowed(); err != nil {
				return genericf("%v", err)
			}
		}
		return n.resizeImage(ctx, n.img, size)
	}
	return genericf("Image format driver does not support resize")
}

func (n *node) resizeImage(ctx context.Context, img formats.Image, size int64) error {
	if err := img.Resize(ctx, size); err != nil {
		return genericf("Could not resize node '%s': %v", n.name, err)
	}
	if err := img.Flush(ctx); err != nil {
		return genericf("Could not resize node '%s': %v", n.name, err)
	}
	return nil
}
