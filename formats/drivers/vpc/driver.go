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
	return driver.Format{Name: "vpc", Probe: Probe, ProbeTail: ProbeTail, Lock: driver.MetadataLock, Writable: true, Create: Create,
		CreateKeys: []string{"subformat=dynamic|fixed", "force_size=on|off"},
		Open: func(ctx context.Context, f aio.File, o driver.Options) (formats.Image, error) {
			return driver.Image(New(ctx, f, Options{OpenParent: o.OpenParent, Writable: o.Writable}))
		}}
}

// Probe: a dynamic VHD's footer copy, "conectix", at the start (QEMU's
// vpc_probe). A fixed VHD has its footer only at the end, which QEMU
// does not look at: ProbeTail finds it.
func Probe(head []byte, _ string) int {
	return driver.Score(bytes.HasPrefix(head, []byte("conectix")), 100)
}

// ProbeTail: a fixed disk's footer at the end of the file, which QEMU 7.2
// probes as raw (its disk is the file's first bytes, the footer its last
// sector, which a writable raw export hands to the guest). A raw disk
// that merely ends in "conectix" is not taken for one: the footer's
// checksum must hold, its type be fixed, and its current size be the
// file's bytes before it, as every fixed disk's creator writes it.
func ProbeTail(tail []byte, size int64) bool {
	if len(tail) < footerSize {
		return false
	}
	b := tail[len(tail)-footerSize:]
	if !bytes.HasPrefix(b, []byte("conectix")) || !checksumOK(b) {
		return false
	}
	ft := parseFooter(b)
	return ft.Type == typeFixed && size >= footerSize && ft.CurrentSize == uint64(size-footerSize)
}
