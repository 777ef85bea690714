package vmdk

import (
	"bytes"
	"context"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/driver"
)

// Driver is vmdk's registry entry: read, checked, created and written.
func Driver() driver.Format {
	return driver.Format{Name: "vmdk", Probe: Probe, Lock: Lock, Check: Check, Create: Create, CreateBacking: true, Writable: true, Compress: true,
		CreateKeys: []string{"subformat=monolithicSparse|monolithicFlat|twoGbMaxExtentSparse|twoGbMaxExtentFlat|streamOptimized", "adapter_type", "hwversion", "toolsversion", "compat6", "zeroed_grain"},
		Open: func(ctx context.Context, f aio.File, o driver.Options) (formats.Image, error) {
			return driver.Image(New(ctx, f, Options{Name: o.Name, Direct: o.Direct, GTCacheSize: o.CacheSize,
				DecodedCacheSize: o.DecodedCacheSize, OpenExtent: o.OpenFile, OpenParent: o.OpenParent, Writable: o.Writable}))
		}}
}

// Probe: a sparse extent ("KDMV", VMDK4), a VMware 3 COW disk ("COWD"),
// or a descriptor file: comment lines and blank lines, then "version=1",
// "=2" or "=3" (QEMU's vmdk_probe).
func Probe(head []byte, _ string) int {
	if bytes.HasPrefix(head, []byte("KDMV")) || bytes.HasPrefix(head, []byte("COWD")) {
		return 100
	}
	p := head
	for len(p) > 0 {
		switch p[0] {
		case '#': // a comment line
			i := bytes.IndexByte(p, '\n')
			if i < 0 {
				return 0
			}
			p = p[i+1:]
			continue
		case ' ': // a blank line: spaces, an optional \r, then \n
			p = bytes.TrimLeft(p, " ")
			p = bytes.TrimPrefix(p, []byte("\r"))
			if len(p) == 0 || p[0] != '\n' {
				return 0
			}
			p = p[1:]
			continue
		}
		for _, v := range []string{"version=1", "version=2", "version=3"} {
			if bytes.HasPrefix(p, []byte(v+"\n")) || bytes.HasPrefix(p, []byte(v+"\r\n")) {
				return 100
			}
		}
		return 0
	}
	return 0
}
