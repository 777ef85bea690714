package nbd

import (
	"context"
	"slices"
	"strings"

	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
)

// MetaContext is a meta context an export offers beside base:allocation:
// qemu:allocation-depth and qemu:dirty-bitmap:NAME, as qemu-nbd -A and -B
// offer them.
type MetaContext struct {
	// Name is the context's full name ("qemu:dirty-bitmap:bm0").
	Name string
	// Extent describes the run that starts at off, cut at off+n, sharing
	// one status: its length (above 0) and its flags.
	Extent func(ctx context.Context, off, n int64) (length int64, flags uint32, err error)
}

// Meta context ids: base:allocation is baseAllocID; Options.Meta[i] is
// firstMetaID+i.
const firstMetaID = baseAllocID + 1

// maxQueryLen is NBD_MAX_STRING_SIZE: qemu-nbd skips longer queries
// without matching them.
const maxQueryLen = 4096

// metaSelection is what LIST/SET_META_CONTEXT matched: base:allocation,
// and which of Options.Meta.
type metaSelection struct {
	base  bool
	extra []bool
}

func (m metaSelection) any() bool { return m.base || slices.Contains(m.extra, true) }

// matchQuery marks what query q selects, as qemu-nbd's
// nbd_negotiate_meta_query does: within the base: and qemu: namespaces,
// an exact name selects its context; for LIST, an empty leaf ("base:",
// "qemu:", "qemu:dirty-bitmap:") selects every context under it. Unknown
// namespaces and names select nothing and are no error.
func matchQuery(q string, list bool, metas []MetaContext, sel *metaSelection) {
	if len(q) > maxQueryLen {
		return
	}
	if rest, ok := strings.CutPrefix(q, "base:"); ok {
		if rest == "allocation" || (rest == "" && list) {
			sel.base = true
		}
		return
	}
	if !strings.HasPrefix(q, "qemu:") {
		return
	}
	for i, m := range metas {
		switch {
		case m.Name == q:
			sel.extra[i] = true
		case list && (q == "qemu:" || (q == "qemu:dirty-bitmap:" && strings.HasPrefix(m.Name, q))):
			sel.extra[i] = true
		}
	}
}

// metaNames are the replies for sel in qemu-nbd's order (base, then the
// export's contexts in their order), with their ids.
func metaNames(sel metaSelection, metas []MetaContext) (ids []uint32, names []string) {
	if sel.base {
		ids, names = append(ids, baseAllocID), append(names, wire.BaseAllocation)
	}
	for i, on := range sel.extra {
		if on {
			ids, names = append(ids, firstMetaID+uint32(i)), append(names, metas[i].Name)
		}
	}
	return ids, names
}
