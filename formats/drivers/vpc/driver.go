package vpc

import (
	"bytes"
	"context"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/driver"
)

// Driver is vpc's registry entry: read, created and written (fixed and
// dynamic disks), no checks (QEMU's vpc driver has none either).
func Driver() driver.Format {
	return driver.Format{Name: "vpc", Probe: Probe, Lock: driver.MetadataLock, Writable: true, Create: Create,
		Open: func(ctx context.Context, f aio.File, o driver.Options) (formats.Image, error) {
			return driver.Image(New(ctx, f, Options{OpenParent: o.OpenParent, Writable: o.Writable}))
		}}
}

// Probe: a dynamic VHD's footer copy, "conectix", at the start (QEMU's
// vpc_probe). A fixed VHD has its footer only at the end: QEMU probes it
// as raw, and so does this (its disk is the file's first bytes).
func Probe(head []byte, _ string) int {
	return driver.Score(bytes.HasPrefix(head, []byte("conectix")), 100)
}
