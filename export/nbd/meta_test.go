package nbd

import (
	"slices"
	"strings"
	"testing"
)

// TestMetaQueriesSelectAsQemuNbd: the matching rules of qemu-nbd's
// nbd_negotiate_meta_query (the end-to-end test in tests/nbd compares the
// replies of both servers).
func TestMetaQueriesSelectAsQemuNbd(t *testing.T) {
	metas := []MetaContext{{Name: "qemu:allocation-depth"}, {Name: "qemu:dirty-bitmap:b"}, {Name: "qemu:dirty-bitmap:a"}}
	for _, c := range []struct {
		q    string
		list bool
		want []string
	}{
		{"base:allocation", false, []string{"base:allocation"}},
		{"base:", true, []string{"base:allocation"}},
		{"base:", false, nil},
		{"base", true, nil},
		{"qemu:", true, []string{"qemu:allocation-depth", "qemu:dirty-bitmap:b", "qemu:dirty-bitmap:a"}},
		{"qemu:", false, nil},
		{"qemu:dirty-bitmap:", true, []string{"qemu:dirty-bitmap:b", "qemu:dirty-bitmap:a"}},
		{"qemu:dirty-bitmap", true, nil},
		{"qemu:dirty-bitmap:a", false, []string{"qemu:dirty-bitmap:a"}},
		{"qemu:dirty-bitmap:" + strings.Repeat("a", maxQueryLen), true, nil},
		{"other:thing", true, nil},
	} {
		sel := metaSelection{extra: make([]bool, len(metas))}
		matchQuery(c.q, c.list, metas, &sel)
		_, got := metaNames(sel, metas)
		if !slices.Equal(got, c.want) {
			t.Errorf("query %.40q (list %v) selects %q, want %q", c.q, c.list, got, c.want)
		}
	}
}
