package engine

// BlockStats is one row of query-blockstats with query-nodes: a node's
// statistics in QEMU's field names and shape ("parent" its file child's
// row, "driver-specific" a file node's).
type BlockStats struct {
	Stats          IOStats         `json:"stats"`
	NodeName       string          `json:"node-name"`
	Parent         *BlockStats     `json:"parent,omitempty"`
	DriverSpecific *FileStatsExtra `json:"driver-specific,omitempty"`
}

// IOStats are QEMU's BlockDeviceStats. QEMU accounts requests on the
// BlockBackend that issues them, and an export's is unnamed: a node's
// row in QSD 7.2 reads zero in every counter whatever its exports did
// (checked with I/O through a FUSE export), and so does ours.
type IOStats struct {
	RdBytes                int64 `json:"rd_bytes"`
	WrBytes                int64 `json:"wr_bytes"`
	UnmapBytes             int64 `json:"unmap_bytes"`
	RdOperations           int64 `json:"rd_operations"`
	WrOperations           int64 `json:"wr_operations"`
	FlushOperations        int64 `json:"flush_operations"`
	UnmapOperations        int64 `json:"unmap_operations"`
	RdTotalTimeNs          int64 `json:"rd_total_time_ns"`
	WrTotalTimeNs          int64 `json:"wr_total_time_ns"`
	FlushTotalTimeNs       int64 `json:"flush_total_time_ns"`
	UnmapTotalTimeNs       int64 `json:"unmap_total_time_ns"`
	WrHighestOffset        int64 `json:"wr_highest_offset"`
	RdMerged               int64 `json:"rd_merged"`
	WrMerged               int64 `json:"wr_merged"`
	UnmapMerged            int64 `json:"unmap_merged"`
	FailedRdOperations     int64 `json:"failed_rd_operations"`
	FailedWrOperations     int64 `json:"failed_wr_operations"`
	FailedFlushOperations  int64 `json:"failed_flush_operations"`
	FailedUnmapOperations  int64 `json:"failed_unmap_operations"`
	InvalidRdOperations    int64 `json:"invalid_rd_operations"`
	InvalidWrOperations    int64 `json:"invalid_wr_operations"`
	InvalidFlushOperations int64 `json:"invalid_flush_operations"`
	InvalidUnmapOperations int64 `json:"invalid_unmap_operations"`
	AccountInvalid         bool  `json:"account_invalid"`
	AccountFailed          bool  `json:"account_failed"`
	TimedStats             []any `json:"timed_stats"`
}

// FileStatsExtra is the file driver's "driver-specific" member.
type FileStatsExtra struct {
	Driver          string `json:"driver"`
	DiscardNbOK     int64  `json:"discard-nb-ok"`
	DiscardNbFailed int64  `json:"discard-nb-failed"`
	DiscardBytesOK  int64  `json:"discard-bytes-ok"`
}

// BlockStats lists query-blockstats's rows. Without query-nodes QEMU
// lists named BlockBackends, of which a daemon has none; with it, every
// node, oldest first as QSD lists them.
func (e *Engine) BlockStats(queryNodes bool) []BlockStats {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := []BlockStats{}
	if !queryNodes {
		return out
	}
	for _, n := range e.nodes {
		out = append(out, n.stats())
	}
	return out
}

func (n *node) stats() BlockStats {
	s := BlockStats{Stats: IOStats{TimedStats: []any{}}, NodeName: n.name}
	if n.driver == "file" {
		s.DriverSpecific = &FileStatsExtra{Driver: "file"}
	}
	if n.child != nil {
		p := n.child.stats()
		s.Parent = &p
	}
	return s
}
