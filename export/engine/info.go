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
	NodeName         string    `json:"node-name"`
	Drv              string    `json:"drv"`
	File             string    `json:"file"`
	RO               bool      `json:"ro"`
	Encrypted        bool      `json:"encrypted"`
	BackingFileDepth int       `json:"backing_file_depth"`
	DetectZeroes     string    `json:"detect_zeroes"`
	Image            ImageInfo `json:"image"`
	Cache            CacheInfo `json:"cache"`
	WriteThreshold   int64     `json:"write_threshold"`
	Bps              int64     `json:"bps"`
	BpsRd            int64     `json:"bps_rd"`
	BpsWr            int64     `json:"bps_wr"`
	Iops             int64     `json:"iops"`
	IopsRd           int64     `json:"iops_rd"`
	IopsWr           int64     `json:"iops_wr"`
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
}

// CacheInfo is a node's "cache" member.
type CacheInfo struct {
	Writeback bool `json:"writeback"`
	Direct    bool `json:"direct"`
	NoFlush   bool `json:"no-flush"`
}

// Nodes lists the nodes for query-named-block-nodes, newest first as
// QEMU lists them.
func (e *Engine) Nodes() []NodeInfo {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]NodeInfo, 0, len(e.nodes))
	for i := len(e.nodes) - 1; i >= 0; i-- {
		out = append(out, e.nodes[i].info())
	}
	return out
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
		if st, err := os.Stat(n.path); err == nil {
			img.VirtualSize = st.Size()
		}
	}
	depth := 0
	if n.opened != nil && n.driver != "file" {
		depth = backingDepth(n.img)
	}
	return NodeInfo{NodeName: n.name, Drv: n.driver, File: n.filename, RO: n.readOnly, DetectZeroes: "off",
		BackingFileDepth: depth, Image: img, Cache: CacheInfo{Writeback: true, Direct: n.cacheDirect}}
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
