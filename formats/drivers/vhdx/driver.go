package vhdx

import (
	"bytes"
	"context"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/driver"
)

// Driver is vhdx's registry entry: read, checked (a repair replays the
// log, so it writes) and created; an open image is never written (not
// Writable: exports stay read-only until writes go through the log),
// except a new image convert fills (FreshWritable, Fresh).
func Driver() driver.Format {
	return driver.Format{Name: "vhdx", Probe: Probe, Lock: driver.MetadataLock, Check: Check, RepairWrites: true, Create: Create, FreshWritable: true,
		CreateKeys: []string{"subformat=dynamic|fixed", "block_size=SIZE", "log_size=SIZE", "block_state_zero=on|off"},
		Open: func(ctx context.Context, f aio.File, o driver.Options) (formats.Image, error) {
			if o.Writable {
				// Only ever a new image, for convert: FreshWritable.
				return driver.Image(OpenFresh(ctx, f))
			}
			return driver.Image(New(ctx, f, Options{OpenParent: o.OpenParent}))
		}}
}

// Probe: "vhdxfile", the file identifier (QEMU's vhdx_probe).
func Probe(head []byte, _ string) int {
	return driver.Score(bytes.HasPrefix(head, []byte("vhdxfile")), 100)
}
