package vhdx

import (
	"bytes"
	"context"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/driver"
)

// Driver is vhdx's registry entry: read, checked (a repair replays the
// log, so it writes), created and written (dynamic, fixed and
// differencing disks; metadata through the log: write.go).
func Driver() driver.Format {
	return driver.Format{Name: "vhdx", Probe: Probe, Lock: driver.MetadataLock, Check: Check, RepairWrites: true, Create: Create, Writable: true,
		CreateKeys: []string{"subformat=dynamic|fixed", "block_size=SIZE", "log_size=SIZE", "block_state_zero=on|off"},
		Open: func(ctx context.Context, f aio.File, o driver.Options) (formats.Image, error) {
			if o.Writable {
				return driver.Image(OpenWriter(ctx, f, Options{OpenParent: o.OpenParent}))
			}
			return driver.Image(New(ctx, f, Options{OpenParent: o.OpenParent}))
		}}
}

// Probe: "vhdxfile", the file identifier (QEMU's vhdx_probe).
func Probe(head []byte, _ string) int {
	return driver.Score(bytes.HasPrefix(head, []byte("vhdxfile")), 100)
}
