package engine

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/null"
	"github.com/blockexport/blockexport/formats/drivers/qcow2"
	"github.com/blockexport/blockexport/formats/registry"
)

// BlockdevOptions are blockdev-add's arguments, for the drivers read here.
type BlockdevOptions struct {
	Driver   string
	NodeName string
	ReadOnly bool
	// Filename is the file driver's host file.
	Filename string
	// Size and ReadZeroes are null-co's (QEMU's defaults: 1 GiB, false).
	Size       int64
	ReadZeroes bool
	// File is a format driver's file child: a node by name, or inline.
	File *BlockdevRef
}

// BlockdevRef names a child: an existing node (Name) or one made for it
// (Inline).
type BlockdevRef struct {
	Name   string
	Inline *BlockdevOptions
}

// Drivers are the block drivers blockdev-add takes, by QEMU's names.
// The format drivers are the registry's formats of image files.
func Drivers() []string { return append([]string{"file", "null-co"}, registry.FileFormats()...) }

// TakesBacking says whether driver's images name a backing file (QEMU's
// "backing" option applies to it).
func TakesBacking(driver string) bool { return registry.CreatesBacking(driver) }

// IsFormatDriver says whether driver reads a format from a file child.
func IsFormatDriver(driver string) bool { return slices.Contains(registry.FileFormats(), driver) }

// node is one block node.
type node struct {
	name     string
	driver   string
	implicit bool // made for an inline child: deleted with its parent
	readOnly bool
	// path is the host file: a file node's own, a format node's child's.
	path  string
	child *node
	// filename is what query-named-block-nodes shows as the file.
	filename string
	// img is the node's image. A file node opens it only while exported
	// (opens: how many exports hold it): a format node over the same file
	// opens the file itself, and two opens with QEMU's locks would
	// refuse each other.
	img     formats.Image
	opened  *registry.Opened
	opens   int
	parents int // nodes whose child this is
	users   int // exports of this node
}

// nodeName is QEMU's id_wellformed: a letter, then letters, digits, '-',
// '.' and '_'.
var nodeName = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9._-]*$`)

// AddNode opens a node (blockdev-add). On failure nothing is left added.
func (e *Engine) AddNode(o BlockdevOptions) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if o.NodeName == "" {
		return genericf("'node-name' must be specified for the root node")
	}
	n, err := e.addNode(o, false)
	if err != nil {
		return err
	}
	e.log.Info("block node added", "node-name", n.name, "driver", n.driver, "file", n.filename)
	return nil
}

func (e *Engine) addNode(o BlockdevOptions, implicit bool) (*node, error) {
	if implicit && o.NodeName == "" {
		e.implicit++
		o.NodeName = fmt.Sprintf("#block%03d", e.implicit)
	} else if !nodeName.MatchString(o.NodeName) {
		return nil, genericf("Invalid node-name: '%s'", o.NodeName)
	}
	if e.node(o.NodeName) != nil {
		return nil, genericf("Duplicate nodes with node-name='%s'", o.NodeName)
	}
	n := &node{name: o.NodeName, driver: o.Driver, implicit: implicit, readOnly: o.ReadOnly}
	var err error
	switch {
	case o.Driver == "file":
		err = n.openFile(o)
	case o.Driver == "null-co":
		err = n.openNull(o)
	case IsFormatDriver(o.Driver):
		err = e.openFormat(n, o)
	default:
		err = genericf("Parameter 'driver' does not accept value '%s'", o.Driver)
	}
	if err != nil {
		return nil, err
	}
	e.nodes = append(e.nodes, n)
	return n, nil
}

// openFile checks that the host file opens as QEMU's file driver would
// open it; its image is opened when it is exported (see node.img).
func (n *node) openFile(o BlockdevOptions) error {
	flag := os.O_RDWR
	if o.ReadOnly {
		flag = os.O_RDONLY
	}
	f, err := os.OpenFile(o.Filename, flag, 0)
	if err != nil {
		return genericf("Could not open '%s': %s", o.Filename, errnoText(err))
	}
	f.Close()
	n.path, n.filename = o.Filename, o.Filename
	return nil
}

func (n *node) openNull(o BlockdevOptions) error {
	size := o.Size
	if size == 0 {
		size = 1 << 30
	}
	img, err := null.New("null-co", size, o.ReadZeroes)
	if err != nil {
		return genericf("%v", err)
	}
	n.img = img
	n.filename = fmt.Sprintf(`json:{"driver": "null-co", "size": %d}`, size)
	return nil
}

// openFormat opens a format node on its file child, made first when it
// is inline; a failure takes the inline child away again.
func (e *Engine) openFormat(n *node, o BlockdevOptions) error {
	if o.File == nil {
		return genericf("Parameter 'file' is missing")
	}
	child, made, err := e.childNode(*o.File)
	if err != nil {
		return err
	}
	if child.path == "" {
		err = genericf("Node '%s' (driver %s) is not a file: a %s node sits on a file node here", child.name, child.driver, o.Driver)
	} else {
		err = n.openImage(e, child.path, o)
	}
	if err != nil {
		if made {
			e.dropNode(child)
		}
		return err
	}
	child.parents++
	n.child, n.path, n.filename = child, child.path, child.path
	return nil
}

func (e *Engine) childNode(ref BlockdevRef) (child *node, made bool, err error) {
	if ref.Inline == nil {
		child = e.node(ref.Name)
		if child == nil {
			return nil, false, genericf("Cannot find device='%s' nor node-name='%s'", ref.Name, ref.Name)
		}
		return child, false, nil
	}
	child, err = e.addNode(*ref.Inline, true)
	return child, err == nil, err
}

// openImage opens path in the node's format. A format read here and
// not written is opened read-only, where QEMU would open it read-write:
// a writable export of it is then refused by name.
func (n *node) openImage(e *Engine, path string, o BlockdevOptions) error {
	writable := !o.ReadOnly && slices.Contains(registry.WritableFormats(), o.Driver)
	opened, err := registry.Open(path, registry.Options{Format: o.Driver, Writable: writable, Lock: true,
		Backend: e.o.Backend, Logger: e.log})
	if err != nil {
		return openError(path, err)
	}
	// Its exports hold it through a pivotImage: a job's graph change
	// replaces the image under them.
	n.opened, n.img, n.readOnly = opened, newPivotImage(opened.Image), !writable
	return nil
}

// openError words a failed open as QEMU does where a script may match
// it: a file that is no qcow2 image, an image another process holds.
func openError(path string, err error) error {
	switch {
	case errors.Is(err, qcow2.ErrNotQCOW2):
		return genericf("Image is not in qcow2 format")
	case errors.Is(err, aio.ErrInUse):
		return genericf("Failed to get \"write\" lock: %v", err)
	}
	return genericf("Could not open '%s': %v", path, err)
}

// node finds a node by name (under mu).
func (e *Engine) node(name string) *node {
	for _, n := range e.nodes {
		if n.name == name {
			return n
		}
	}
	return nil
}

// DelNode closes a node (blockdev-del): only one nothing uses, and not
// one made for an inline child (it goes with its parent).
func (e *Engine) DelNode(name string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	n := e.node(name)
	switch {
	case n == nil:
		return genericf("Failed to find node with node-name='%s'", name)
	case n.implicit:
		return genericf("Node %s is not owned by the monitor", name)
	case e.busy(n) != nil:
		return e.busy(n)
	case n.users > 0: // QEMU: the node has a BlockBackend (an export's)
		return genericf("Node %s is in use", name)
	case n.parents > 0:
		return genericf("Block device %s is in use", name)
	}
	err := e.dropNode(n)
	if err != nil {
		return genericf("Closing node '%s': %v", name, err)
	}
	e.log.Info("block node deleted", "node-name", name)
	return nil
}

// dropNode flushes and closes n and takes it out, with its child when
// that was made for it.
func (e *Engine) dropNode(n *node) error {
	err := n.close()
	e.nodes = slices.DeleteFunc(e.nodes, func(m *node) bool { return m == n })
	if c := n.child; c != nil {
		c.parents--
		if c.implicit && c.parents == 0 {
			e.dropNode(c)
		}
	}
	return err
}

func (n *node) close() error {
	if n.img == nil || (n.driver == "file" && n.opens == 0) {
		return nil
	}
	ferr := n.img.Flush(context.Background())
	cerr := n.img.Close()
	n.img = nil
	if ferr != nil {
		return ferr
	}
	return cerr
}

// acquire gives an export the node's image, opening a file node's.
func (n *node) acquire(e *Engine, writable bool) (formats.Image, error) {
	if writable && n.readOnly {
		return nil, genericf("Cannot export read-only node '%s' as writable", n.name)
	}
	if n.driver == "file" && n.opens == 0 {
		opened, err := registry.Open(n.path, registry.Options{Format: registry.Raw, Writable: !n.readOnly, Lock: true,
			Backend: e.o.Backend, Logger: e.log})
		if err != nil {
			return nil, openError(n.path, err)
		}
		n.opened, n.img = opened, opened.Image
	}
	if n.driver == "file" {
		n.opens++
	}
	n.users++
	return n.img, nil
}

// release is acquire's undo: a file node's image closes with its last
// export.
func (n *node) release() error {
	n.users--
	if n.driver != "file" {
		return nil
	}
	n.opens--
	if n.opens > 0 {
		return nil
	}
	ferr := n.img.Flush(context.Background())
	cerr := n.img.Close()
	n.img, n.opened = nil, nil
	if ferr != nil {
		return ferr
	}
	return cerr
}
