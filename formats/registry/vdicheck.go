package registry

import (
	"context"
	"fmt"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/qcow2"
	"github.com/blockexport/blockexport/formats/drivers/vdi"
)

// checkVDI checks a vdi image as qemu-img check does (vdi.Check). A
// repair (-r) is refused as QEMU's vdi check refuses it, which qemu-img
// reports as a format without checks (exit 63), once the image has
// opened as it would for writing (the header checked, the writer's
// lock taken: an image in use fails first, exit 1, as in qemu-img).
func checkVDI(ctx context.Context, spec string, o Options, repair int) (formats.CheckResult, error) {
	var lock *aio.Lock
	if o.Lock {
		l := vdi.Lock(repair != qcow2.RepairNone)
		lock = &l
	}
	f, err := aio.Open(spec, aio.Options{Backend: o.Backend, Logger: o.Logger, Lock: lock})
	if err != nil {
		return formats.CheckResult{}, fmt.Errorf("vdi: %w", err)
	}
	if repair != qcow2.RepairNone {
		if err := vdi.CheckHeader(ctx, f); err != nil {
			return formats.CheckResult{}, err
		}
		return formats.CheckResult{}, fmt.Errorf("%s: %w: %w", spec, vdi.ErrNoRepair, ErrNoChecks)
	}
	return vdi.Check(ctx, f)
}
