package qcow2

import (
	"bytes"
	"context"
	"encoding/binary"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/driver"
)

// Driver is qcow2's registry entry: read, written, created, checked and
// repaired.
func Driver() driver.Format {
	return driver.Format{Name: "qcow2", Probe: Probe, Lock: driver.MetadataLock, Check: Check, RepairWrites: true,
		Writable: true, Create: Create, CreateKeys: []string{"cluster_size", "compression_type=zlib|zstd", "lazy_refcounts=on|off"}, CreateBacking: true, Compress: true,
		Open: func(ctx context.Context, f aio.File, o driver.Options) (formats.Image, error) {
			return driver.Image(New(ctx, f, Options{L2CacheSize: o.CacheSize, DecodedCacheSize: o.DecodedCacheSize,
				Direct: o.Direct, Writable: o.Writable, EditBitmaps: o.EditBitmaps, Logger: o.Logger, OpenBacking: o.OpenBacking, Shown: o.Shown}))
		}}
}

// Probe: QFI\xfb and any version but 1, which is qcow (QEMU's
// qcow2_probe wants version >= 2; a version 0 file is refused by the
// reader rather than served as raw).
func Probe(head []byte, _ string) int {
	if bytes.HasPrefix(head, magic[:]) && len(head) >= 8 && binary.BigEndian.Uint32(head[4:]) != 1 {
		return 100
	}
	return 0
}
