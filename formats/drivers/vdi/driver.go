package vdi

import (
	"context"
	"encoding/binary"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/driver"
)

// Driver is vdi's registry entry: read, written, created and checked
// (a check repairs nothing, as QEMU's).
func Driver() driver.Format {
	return driver.Format{Name: "vdi", Probe: Probe, Lock: driver.MetadataLock, Check: Check, Writable: true, Create: Create, CreateKeys: []string{"static=on|off"},
		Open: func(ctx context.Context, f aio.File, o driver.Options) (formats.Image, error) {
			return driver.Image(New(ctx, f, Options{Writable: o.Writable, Direct: o.Direct, Logger: o.Logger}))
		}}
}

// Probe: the signature 0xbeda107f, little-endian, at 64, after the
// 64-byte text of a 512-byte header (QEMU's vdi_probe).
func Probe(head []byte, _ string) int {
	return driver.Score(len(head) >= 512 && binary.LittleEndian.Uint32(head[64:]) == signature, 100)
}
