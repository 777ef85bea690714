package engine

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/null"
	"github.com/blockexport/blockexport/formats/drivers/qcow2"
	"github.com/blockexport/blockexport/formats/filters/copyonread"
	"github.com/blockexport/blockexport/formats/jobs/commit"
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
	// File is a format driver's file child, and copy-on-read's: a node
	// by name, or inline.
	File *BlockdevRef
	// Server, Export, TLSCreds, TLSHostname and ReconnectDelay (seconds)
	// are nbd's: the server's address, the export's name ("" is the
	// default export), the tls-creds-x509 client object.
	Server         *NBDAddress
	Export         string
	TLSCreds       string
	TLSHostname    string
	ReconnectDelay int64
	// URL is the object of http, https and s3. Timeout (seconds, QEMU's
	// default 5) bounds how long a read retries the server. SSLVerify is
	// https's (QEMU's default: on); TLSCA, our own key, is the CA file
	// that signs the server's certificate ("": the system's roots).
	URL       string
	Timeout   int64
	SSLVerify bool
	TLSCA     string
	// S3Endpoint and S3PathStyle are s3's, as the one-shot commands'
	// --s3-endpoint and --s3-path-style.
	S3Endpoint  string
	S3PathStyle bool
	// AutoReadOnly opens read-only a node that cannot be written (an
	// http object) instead of refusing it, as QEMU's auto-read-only.
	AutoReadOnly bool
	// AIO is the file driver's aio: threads (QEMU's default, also for
	// ""), io_uring, or native, which needs CacheDirect and runs on
	// io_uring here (the kernel's asynchronous I/O either way).
	// CacheDirect is cache.direct (O_DIRECT), which children inherit.
	AIO         string
	CacheDirect bool
	// NoBacking (backing: null) opens a format node's image without its
	// backing file, unallocated clusters reading as zeroes, as QEMU's.
	// Backing names a node that stands as the image's backing file
	// (backing: "NODE"); see takeBacking for what is taken.
	NoBacking bool
	Backing   string
}

// BlockdevRef names a child: an existing node (Name) or one made for it
// (Inline).
type BlockdevRef struct {
	Name   string
	Inline *BlockdevOptions
}

// Drivers are the block drivers blockdev-add takes, by QEMU's names (s3
// is our own): the protocols, the copy-on-read filter, and as format
// drivers the registry's formats of image files.
func Drivers() []string {
	return append([]string{"file", "null-co", "nbd", "http", "https", "s3", "copy-on-read"}, registry.FileFormats()...)
}

// isRemote says whether driver reads a server's export or object: the
// node holds a connection from blockdev-add on, as QEMU's does.
func isRemote(driver string) bool {
	return driver == "nbd" || driver == "http" || driver == "https" || driver == "s3"
}

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
	// spec is a remote node's URI, with the options it was opened with
	// (ropts): what a format node over it opens.
	spec  string
	ropts registry.Options
	// borrowed: img is the child's (raw over a remote node, a
	// copy-on-read filter), closed with the child, not here; childHeld:
	// the child is a file node whose image this node acquired.
	borrowed  bool
	childHeld bool
	// filename is what query-named-block-nodes shows as the file.
	filename string
	// backend and direct are a file node's aio and cache.direct: how it
	// and a format node over it open the host file. cacheDirect is the
	// node's own cache.direct, as query-named-block-nodes shows it.
	backend     aio.Backend
	direct      bool
	cacheDirect bool
	// img is the node's image. A file node opens it only while exported
	// (opens: how many exports hold it): a format node over the same file
	// opens the file itself, and two opens with QEMU's locks would
	// refuse each other.
	img     formats.Image
	opened  *registry.Opened
	opens   int
	parents int // nodes whose child this is
	users   int // exports of this node
	// layers name the layers of a format node's backing chain, which
	// QEMU opens as nodes of their own, each over a file node, with
	// automatic names: layers[i] is the layer i+1 below the image. They
	// are names only: the node's image holds the chain, and the jobs
	// take a layer by its name.
	layers []layerNames
	// backingRef is the node given as this one's backing file
	// (blockdev-add's backing: "NODE"), held as a parent holds its
	// child; noBacking: the node was opened with backing: null.
	backingRef *node
	noBacking  bool
	// options is the node's options as QEMU's filename shows them once
	// they differ from the image's own ("json:{...}"); nil: not shown.
	options map[string]any
}

// layerNames are the automatic names of one backing layer's format node
// and its file node, and the layer's file, by which a layer keeps its
// names when a job changes the chain around it.
type layerNames struct {
	filename, format, file string
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
	n := &node{name: o.NodeName, driver: o.Driver, implicit: implicit, readOnly: o.ReadOnly, cacheDirect: o.CacheDirect}
	var err error
	switch {
	case o.Driver == "file":
		err = n.openFile(o)
	case o.Driver == "null-co":
		err = n.openNull(o)
	case isRemote(o.Driver):
		err = e.openRemote(n, o)
	case o.Driver == "copy-on-read":
		err = e.openCopyOnRead(n, o)
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
	n.backend, n.direct = aio.Threads, o.CacheDirect
	switch o.AIO {
	case "io_uring":
		n.backend = aio.IOUring
	case "native":
		if !o.CacheDirect {
			return genericf("aio=native was specified, but it requires cache.direct=on, which was not specified.")
		}
		n.backend = aio.IOUring
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
	child, made, err := e.childNode(*o.File, o)
	if err != nil {
		return err
	}
	switch {
	case child.path == "" && (o.NoBacking || o.Backing != ""):
		// A remote image's chain is the registry's to open, whole.
		err = genericf("Parameter 'backing' is taken here only for an image in a host file, not over node '%s' (driver %s)", child.name, child.driver)
	case child.path != "" && o.Backing != "":
		err = e.openOverBackingNode(n, child, o)
	case child.path != "":
		err = n.openImage(e, child, o)
	case child.spec != "":
		err = n.openOverRemote(e, child, o)
	default:
		err = genericf("Node '%s' (driver %s) is not a file: a %s node sits on a file or remote node here", child.name, child.driver, o.Driver)
	}
	if err != nil {
		if made {
			e.dropNode(child)
		}
		return err
	}
	child.parents++
	n.child, n.path, n.filename = child, child.path, cmp.Or(child.path, child.filename)
	n.backend, n.direct = child.backend, child.direct || o.CacheDirect
	if n.backingRef != nil || o.NoBacking {
		n.noBacking = o.NoBacking
		n.options = map[string]any{"driver": o.Driver, "file": child.shownOptions(), "backing": nil}
		if ref := n.backingRef; ref != nil {
			ref.parents++
			n.options["backing"] = ref.shownOptions()
		}
		n.filename = "json:" + qemuJSON(n.options)
	}
	if n.opened != nil && n.path != "" {
		e.nameLayers(n)
	}
	return nil
}

// openOverBackingNode opens a format node whose backing file is given
// as a node. QEMU reads the given node under the image whatever its
// header names; here the node is taken where it is the image's own
// backing file (the same file, in the same format, with its own chain)
// and read-only, so that the image's chain, opened as it always is, reads
// what the node reads. Another node would need the format driver to
// read through a node it did not open, which it does not.
func (e *Engine) openOverBackingNode(n, child *node, o BlockdevOptions) error {
	ref := e.node(o.Backing)
	switch {
	case ref == nil:
		return genericf("Could not open backing file: Cannot find device='%s' nor node-name='%s'", o.Backing, o.Backing)
	case !ref.readOnly:
		return genericf("Backing node '%s' is writable: only a read-only node is taken as a backing file here", ref.name)
	}
	if err := n.openImage(e, child, o); err != nil {
		return err
	}
	b, ok := findBacking(n.core())
	if !ok || ref.opened == nil || ref.path == "" || ref.noBacking || ref.backingRef != nil ||
		!commit.SameFile(ref.path, b.Info().Filename) || ref.driver != b.Info().Format {
		own := "none"
		if ok {
			own = b.Info().Filename + " (" + b.Info().Format + ")"
		}
		n.img.Close()
		n.img, n.opened = nil, nil
		return genericf("Node '%s' is not the image's own backing file (%s): only that node is taken as its backing here", ref.name, own)
	}
	n.backingRef = ref
	return nil
}

// shownOptions are the options QEMU's json: filename shows for n as a
// child: a file node's driver and file name, a format node's driver and
// file child (with its own backing where that is not the image's).
func (n *node) shownOptions() map[string]any {
	if n.options != nil {
		return n.options
	}
	if n.driver == "file" {
		return map[string]any{"driver": "file", "filename": n.path}
	}
	o := map[string]any{"driver": n.driver}
	if n.child != nil {
		o["file"] = n.child.shownOptions()
	}
	return o
}

// qemuJSON writes v as QEMU writes a json: filename: keys sorted, ", "
// and ": " between members.
func qemuJSON(v any) string {
	m, ok := v.(map[string]any)
	if !ok {
		b, _ := json.Marshal(v)
		return string(b)
	}
	keys := slices.Sorted(maps.Keys(m))
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = qemuJSON(k) + ": " + qemuJSON(m[k])
	}
	return "{" + strings.Join(parts, ", ") + "}"
}

// nameLayers names the layers of n's backing chain as QEMU names the
// nodes it opens for them, after the node's own: from the top down, each
// layer's file node, then its format node. A layer that had names before
// (the chain changed under a job) keeps them; the names of layers no
// longer in the chain go (under mu).
func (e *Engine) nameLayers(n *node) {
	if ref := n.backingRef; ref != nil {
		if b, ok := findBacking(n.core()); ok && commit.SameFile(ref.path, b.Info().Filename) {
			n.layers = nil // the given node's, listed as its own
			return
		}
		// A job took the given node out of the chain: it is let go.
		ref.parents--
		n.backingRef = nil
	}
	var layers []layerNames
	for layer, ok := findBacking(n.core()); ok; layer, ok = findBacking(layer) {
		filename := layer.Info().Filename
		if i := slices.IndexFunc(n.layers, func(l layerNames) bool { return l.filename == filename }); i >= 0 {
			layers = append(layers, n.layers[i])
			continue
		}
		l := layerNames{filename: filename}
		l.file = e.autoNodeName()
		l.format = e.autoNodeName()
		layers = append(layers, l)
	}
	n.layers = layers
}

// backingUser is a node that n stands under as its given backing node
// (under mu; nil: none).
func (e *Engine) backingUser(n *node) *node {
	for _, m := range e.nodes {
		if m.backingRef == n {
			return m
		}
	}
	return nil
}

// layerOwner is the node whose backing chain has a layer (or a layer's
// file node) named name (under mu; nil: none).
func (e *Engine) layerOwner(name string) *node {
	for _, n := range e.nodes {
		if slices.ContainsFunc(n.layers, func(l layerNames) bool { return l.format == name || l.file == name }) {
			return n
		}
	}
	return nil
}

// childNode finds or makes a child; one made inline inherits its
// parent's read-only and auto-read-only, as QEMU's children do.
func (e *Engine) childNode(ref BlockdevRef, parent BlockdevOptions) (child *node, made bool, err error) {
	if ref.Inline == nil {
		child = e.node(ref.Name)
		if child == nil {
			return nil, false, genericf("Cannot find device='%s' nor node-name='%s'", ref.Name, ref.Name)
		}
		return child, false, nil
	}
	inline := *ref.Inline
	inline.ReadOnly = inline.ReadOnly || parent.ReadOnly
	inline.AutoReadOnly = inline.AutoReadOnly || parent.AutoReadOnly
	inline.CacheDirect = inline.CacheDirect || parent.CacheDirect
	child, err = e.addNode(inline, true)
	return child, err == nil, err
}

// openImage opens the file node child's host file in the node's format,
// with the child's aio and cache.direct. A format read here and not
// written is opened read-only, where QEMU would open it read-write: a
// writable export of it is then refused by name.
func (n *node) openImage(e *Engine, child *node, o BlockdevOptions) error {
	path := child.path
	writable := !o.ReadOnly && slices.Contains(registry.WritableFormats(), o.Driver)
	opened, err := registry.Open(path, registry.Options{Format: o.Driver, Writable: writable, Lock: true,
		Backend: cmp.Or(child.backend, e.o.Backend), Direct: child.direct || o.CacheDirect, Logger: e.log,
		NoBacking: o.NoBacking})
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
	case e.backingUser(n) != nil:
		return genericf("Node '%s' is busy: node is used as backing hd of '%s'", name, e.backingUser(n).name)
	case n.parents > 0:
		return genericf("Block device %s is in use", name)
	}
	err := e.dropNode(n)
	if ref := n.backingRef; ref != nil { // the given backing node is free again
		ref.parents--
		n.backingRef = nil
	}
	if err != nil {
		return genericf("Closing node '%s': %v", name, err)
	}
	e.log.Info("block node deleted", "node-name", name)
	e.nodeFreed()
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
	if n.childHeld {
		n.childHeld = false
		if err := n.child.release(); err != nil {
			n.img = nil
			return err
		}
	}
	if n.borrowed {
		n.img = nil
		return nil
	}
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
			Backend: cmp.Or(n.backend, e.o.Backend), Direct: n.direct, Logger: e.log})
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

// openRemote opens an nbd, http, https or s3 node through the registry's
// opener, as the one-shot commands open a URI: the connection is made
// here, so that a server that is not there fails blockdev-add as it
// fails QEMU's.
func (e *Engine) openRemote(n *node, o BlockdevOptions) error {
	spec, ro, err := e.remoteSpec(o)
	if err != nil {
		return err
	}
	ro.Writable = !o.ReadOnly && o.Driver == "nbd"
	ro.Backend, ro.Logger, ro.Format = e.o.Backend, e.log, registry.Raw
	opened, err := registry.Open(spec, ro)
	if err != nil && ro.Writable && o.AutoReadOnly && errors.Is(err, formats.ErrReadOnly) {
		ro.Writable = false // a read-only export, taken read-only as auto-read-only allows
		opened, err = registry.Open(spec, ro)
	}
	if err != nil {
		return remoteError(o, spec, err)
	}
	n.opened, n.img, n.readOnly = opened, opened.Image, !ro.Writable
	n.spec, n.ropts, n.filename = spec, ro, registry.Shown(spec)
	return nil
}

// remoteSpec is the URI the registry opens for a remote node's options,
// and how to reach it; it refuses, in QEMU's words where QEMU has them,
// what cannot be opened.
func (e *Engine) remoteSpec(o BlockdevOptions) (string, registry.Options, error) {
	var ro registry.Options
	if o.Driver != "nbd" && !o.ReadOnly && !o.AutoReadOnly {
		// QEMU's curl driver reads only; so do our http and s3.
		if o.Driver == "s3" {
			return "", ro, genericf("s3 driver does not support writes")
		}
		return "", ro, genericf("curl driver does not support writes")
	}
	switch o.Driver {
	case "nbd":
		return e.nbdSpec(o)
	case "http", "https":
		if o.Timeout < 0 || o.Timeout > 10000 { // CURL_TIMEOUT_MAX
			return "", ro, genericf("timeout parameter is too large or negative")
		}
		if !strings.HasPrefix(o.URL, o.Driver+"://") {
			return "", ro, genericf("%s curl driver cannot handle the URL '%s' (does not start with '%s://')", o.Driver, o.URL, o.Driver)
		}
		ro.Remote = registry.RemoteOptions{ReconnectTimeout: time.Duration(cmp.Or(o.Timeout, 5)) * time.Second, TLSCA: o.TLSCA,
			TLSSkipVerify: !o.SSLVerify}
		return o.URL, ro, nil
	case "s3":
		if !strings.HasPrefix(o.URL, "s3://") {
			return "", ro, genericf("s3 driver cannot handle the URL '%s' (does not start with 's3://')", o.URL)
		}
		ro.Remote = registry.RemoteOptions{S3Endpoint: o.S3Endpoint, S3PathStyle: o.S3PathStyle, TLSCA: o.TLSCA,
			ReconnectTimeout: time.Duration(cmp.Or(o.Timeout, 5)) * time.Second}
		return o.URL, ro, nil
	}
	return "", ro, genericf("Parameter 'driver' does not accept value '%s'", o.Driver)
}

// nbdSpec is the NBD URI of an nbd node's server and export, with the
// client files of its tls-creds object; reconnect-delay is how long
// requests wait for a lost server, as QEMU's.
func (e *Engine) nbdSpec(o BlockdevOptions) (string, registry.Options, error) {
	var ro registry.Options
	if o.Server == nil {
		return "", ro, genericf("Parameter 'server' is missing")
	}
	if o.ReconnectDelay < 0 {
		return "", ro, genericf("Parameter 'reconnect-delay' expects uint32_t")
	}
	u := url.URL{Scheme: "nbd", Path: "/" + o.Export}
	q := url.Values{}
	switch o.Server.Type {
	case "unix":
		u.Scheme = "nbd+unix"
		q.Set("socket", o.Server.Path)
	case "inet":
		u.Host = net.JoinHostPort(o.Server.Host, o.Server.Port)
	default:
		return "", ro, genericf("Parameter 'server.type' does not accept value '%s'", o.Server.Type)
	}
	if o.TLSCreds != "" {
		c, ok := e.objects[o.TLSCreds]
		if !ok {
			return "", ro, genericf("No TLS credentials with id '%s'", o.TLSCreds)
		}
		if c.o.Endpoint != "client" {
			return "", ro, genericf("Expected TLS credentials for a client endpoint")
		}
		u.Scheme = strings.Replace(u.Scheme, "nbd", "nbds", 1)
		q.Set("tls-certificates", c.o.Dir)
		if o.TLSHostname != "" {
			q.Set("tls-hostname", o.TLSHostname)
		}
	}
	// A socket path's slashes stay as they are, readable in messages and
	// query-named-block-nodes; what would end the query is escaped.
	u.RawQuery = strings.ReplaceAll(q.Encode(), "%2F", "/")
	ro.NBD = registry.NBDOptions{Connections: 1, ReconnectTimeout: time.Duration(o.ReconnectDelay) * time.Second}
	return u.String(), ro, nil
}

// remoteError words a failed remote open: a server that is not there as
// QEMU's nbd driver says it.
func remoteError(o BlockdevOptions, spec string, err error) error {
	var en syscall.Errno
	if o.Driver == "nbd" && errors.As(err, &en) {
		where := o.Server.Path
		if o.Server.Type == "inet" {
			where = net.JoinHostPort(o.Server.Host, o.Server.Port)
		}
		return genericf("Failed to connect to '%s': %s", where, errnoText(en))
	}
	if o.Driver == "nbd" && errors.Is(err, formats.ErrReadOnly) {
		// A read-only export opened for writing: QEMU's words.
		return genericf("Could not open image: Permission denied")
	}
	return genericf("Could not open '%s': %v", registry.Shown(spec), err)
}

// openOverRemote opens a format node over a remote node: raw is the
// remote node's own bytes (the same connection); another format opens
// the object again in that format through the registry, which reads
// formats over http(s) and s3, and refuses them over NBD (an export is
// raw bytes: let its server open the format).
func (n *node) openOverRemote(e *Engine, child *node, o BlockdevOptions) error {
	if o.Driver == registry.Raw {
		if !o.ReadOnly && child.readOnly {
			return genericf("Block node is read-only")
		}
		n.img, n.borrowed, n.readOnly = child.img, true, o.ReadOnly || child.readOnly
		return nil
	}
	ro := child.ropts
	ro.Format, ro.Writable = o.Driver, false
	if !o.ReadOnly && !o.AutoReadOnly {
		return genericf("Block node is read-only")
	}
	opened, err := registry.Open(child.spec, ro)
	if err != nil {
		return genericf("Could not open '%s': %v", child.filename, err)
	}
	n.opened, n.img, n.readOnly = opened, opened.Image, true
	return nil
}

// openCopyOnRead puts QEMU's copy-on-read filter over its file child:
// reads of what the child's top layer lacks copy it up from the backing
// chain (formats/filters/copyonread). Over a node with nothing below it
// (no backing file, not a layered format) there is nothing to copy, and
// the filter passes everything through, as QEMU's does.
func (e *Engine) openCopyOnRead(n *node, o BlockdevOptions) error {
	if o.File == nil {
		return genericf("Parameter 'file' is missing")
	}
	child, made, err := e.childNode(*o.File, o)
	if err != nil {
		return err
	}
	writable := !o.ReadOnly && !child.readOnly
	var img formats.Image
	if child.driver == "file" {
		img, err = child.acquire(e, writable)
		n.childHeld = err == nil
	} else {
		img = child.img
		if img == nil {
			err = genericf("Node '%s' (driver %s) has no image to filter", child.name, child.driver)
		}
	}
	if err == nil {
		img, err = copyOnReadImage(img, child)
	}
	if err != nil {
		if n.childHeld {
			child.release()
			n.childHeld = false
		}
		if made {
			e.dropNode(child)
		}
		return err
	}
	child.parents++
	n.img, n.borrowed, n.readOnly = img, true, !writable
	n.child, n.filename = child, child.filename
	return nil
}

// copyOnReadImage wraps img, child's image, in the copy-on-read filter
// when there is a backing chain to copy from.
func copyOnReadImage(img formats.Image, child *node) (formats.Image, error) {
	if p, ok := img.(*pivotImage); ok {
		// The filter copies into the format node's image itself, which
		// the pivotImage hides.
		img = p.Wrapped()
	}
	c, ok := img.(copyonread.Copier)
	if !ok || c.Backing() == nil {
		return img, nil
	}
	if child.readOnly {
		// QEMU's filter takes the right to write its child, which a
		// read-only node does not give.
		return nil, genericf("Block node is read-only")
	}
	cor, err := copyonread.New(img, child.driver)
	if err != nil {
		return nil, genericf("%v", err)
	}
	return cor, nil
}
