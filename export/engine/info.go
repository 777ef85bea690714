package engine

import (
	"os"
	"syscall"

	"github.com/blockexport/blockexport/formats"
)

// NodeInfo is one row of query-named-block-nodes: the fields QSD gives
// that mean something here, with QEMU's names; throttling and the
// statistics QEMU keeps per node are zero, as on a QEMU node without
// them.
type NodeInfo struct {
	NodeName         string `json:"node-name"`
	Drv              string `json:"drv"`
	File             string `json:"file"`
	RO               bool   `json:"ro"`
	Encrypted        bool   `json:"encrypted"`
	BackingFileDepth int    `json:"backing_file_depth"`
	// BackingFile is the backing file's name as resolved (QEMU's
	// full-backing-filename), on a node that has one.
	BackingFile    string    `json:"backing_file,omitempty"`
	DetectZeroes   string    `json:"detect_zeroes"`
	Image          ImageInfo `json:"image"`
	Cache          CacheInfo `json:"cache"`
	WriteThreshold int64     `json:"write_threshold"`
	Bps            int64     `json:"bps"`
	BpsRd          int64     `json:"bps_rd"`
	BpsWr          int64     `json:"bps_wr"`
	Iops           int64     `json:"iops"`
	IopsRd         int64     `json:"iops_rd"`
	IopsWr         int64     `json:"iops_wr"`
}

// ImageInfo is a node's "image" member.
type ImageInfo struct {
	Filename    string `json:"filename"`
	Format      string `json:"format"`
	VirtualSize int64  `json:"virtual-size"`
	ActualSize  int64  `json:"actual-size,omitempty"`
	ClusterSize int64  `json:"cluster-size,omitempty"`
	// FormatSpecific is the format's own object, as qemu-img info
	// gives it (qcow2: compat, refcount-bits, ...).
	FormatSpecific *formats.FormatSpecific `json:"format-specific,omitempty"`
	DirtyFlag      *bool                   `json:"dirty-flag,omitempty"`
	// The backing file, as the image's header names it, resolved, and
	// its format; BackingImage is its own member, down the chain.
	BackingFilename       string     `json:"backing-filename,omitempty"`
	FullBackingFilename   string     `json:"full-backing-filename,omitempty"`
	BackingFilenameFormat string     `json:"backing-filename-format,omitempty"`
	BackingImage          *ImageInfo `json:"backing-image,omitempty"`
}

// CacheInfo is a node's "cache" member.
type CacheInfo struct {
	Writeback bool `json:"writeback"`
	Direct    bool `json:"direct"`
	NoFlush   bool `json:"no-flush"`
}

// Nodes lists the nodes for query-named-block-nodes, newest first as
// QEMU lists them: a format node's backing layers, opened with it after
// its file child, come before it, the deepest first, each before its
// file node.
func (e *Engine) Nodes() []NodeInfo {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]NodeInfo, 0, len(e.nodes))
	for i := len(e.nodes) - 1; i >= 0; i-- {
		n := e.nodes[i]
		out = append(out, n.layerInfos()...)
		out = append(out, n.info())
	}
	return out
}

// layerInfos are the rows of n's backing layers, deepest first: each
// layer's format node, then its file node, read-only as QEMU opens a
// backing file, with the node's cache.direct, which they inherit.
func (n *node) layerInfos() []NodeInfo {
	if len(n.layers) == 0 {
		return nil
	}
	var imgs []formats.Image
	for layer, ok := findBacking(n.core()); ok && len(imgs) < len(n.layers); layer, ok = findBacking(layer) {
		imgs = append(imgs, layer)
	}
	var out []NodeInfo
	for i := len(imgs) - 1; i >= 0; i-- {
		img := layerImageInfo(imgs[i])
		clean := false
		file := ImageInfo{Filename: img.Filename, Format: "file", VirtualSize: fileLength(img.Filename), ActualSize: img.ActualSize,
			DirtyFlag: &clean}
		cache := CacheInfo{Writeback: true, Direct: n.cacheDirect}
		out = append(out,
			NodeInfo{NodeName: n.layers[i].format, Drv: img.Format, File: img.Filename, RO: true, DetectZeroes: "off",
				BackingFileDepth: backingDepth(imgs[i]), BackingFile: img.FullBackingFilename, Image: img, Cache: cache},
			NodeInfo{NodeName: n.layers[i].file, Drv: "file", File: img.Filename, RO: true, DetectZeroes: "off",
				Image: file, Cache: cache})
	}
	return out
}

// layerImageInfo is the "image" member of a layer of a chain, with the
// layers below it.
func layerImageInfo(img formats.Image) ImageInfo {
	info := img.Info()
	clean := info.DirtyFlag
	out := ImageInfo{Filename: info.Filename, Format: info.Format, VirtualSize: img.Size(), ClusterSize: info.ClusterSize,
		FormatSpecific: info.FormatSpecific, DirtyFlag: &clean}
	if info.ActualSize > 0 {
		out.ActualSize = info.ActualSize
	}
	out.withBacking(img)
	return out
}

// withBacking adds img's backing file and its image, if it has one.
// The names are the header's even where the backing file was not
// opened (backing: null), as QEMU shows them.
func (i *ImageInfo) withBacking(img formats.Image) {
	info := img.Info()
	if info.BackingFilename == "" {
		return
	}
	i.BackingFilename, i.FullBackingFilename = info.BackingFilename, info.FullBackingFilename
	i.BackingFilenameFormat = info.BackingFilenameFormat
	if b, ok := findBacking(img); ok {
		bi := layerImageInfo(b)
		i.BackingImage = &bi
	}
}

// fileLength is a host file's length as QEMU's file driver gives it: in
// whole 512-byte sectors, the last one rounded up.
func fileLength(path string) int64 {
	st, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return (st.Size() + 511) &^ 511
}

func (n *node) info() NodeInfo {
	img := ImageInfo{Filename: n.filename, Format: n.driver}
	if n.path != "" {
		var st syscall.Stat_t
		if syscall.Stat(n.path, &st) == nil {
			img.ActualSize = st.Blocks * 512
		}
		clean := false
		img.DirtyFlag = &clean
	}
	switch {
	case n.img != nil && n.driver != "file":
		info := n.img.Info()
		img.VirtualSize, img.ClusterSize, img.FormatSpecific = n.img.Size(), info.ClusterSize, info.FormatSpecific
	case n.path != "":
		img.VirtualSize = fileLength(n.path)
	}
	depth, backing := 0, ""
	if n.opened != nil && n.driver != "file" {
		depth = backingDepth(n.img)
		if core := n.core(); core != nil {
			img.withBacking(core)
		}
		if depth > 0 {
			backing = img.FullBackingFilename
		}
	}
	return NodeInfo{NodeName: n.name, Drv: n.driver, File: n.filename, RO: n.readOnly, DetectZeroes: "off",
		BackingFileDepth: depth, BackingFile: backing, Image: img, Cache: CacheInfo{Writeback: true, Direct: n.cacheDirect}}
}

// backingDepth counts the images under img in its backing chain.
func backingDepth(img formats.Image) int {
	d := 0
	for {
		l, ok := formats.As[formats.Layered](img)
		if !ok {
			return d
		}
		b := l.Backing()
		if b == nil {
			return d
		}
		d++
		img = b
	}
}
