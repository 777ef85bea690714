package vhdx

import (
	"bytes"
	"context"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/driver"
)

// Driver is vhdx's registry entry: read and checked (a repair replays the
// log, so it writes), never written otherwise.
func Driver() driver.Format {
	return driver.Format{Name: "vhdx", Probe: Probe, Lock: driver.MetadataLock, Check: Check, RepairWrites: true,
		Open: func(ctx context.Context, f aio.File, o driver.Options) (formats.Image, error) {
			return driver.Image(New(ctx, f, Options{OpenParent: o.OpenParent}))
		}}
}

// Probe: "vhdxfile", the file identifier (QEMU's vhdx_probe).
func Probe(head []byte, _ string) int {
	return driver.Score(bytes.HasPrefix(head, []byte("vhdxfile")), 100)
}
