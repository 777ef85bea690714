package registry

import (
	"context"
	"fmt"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/qcow2"
	"github.com/blockexport/blockexport/formats/drivers/vhdx"
)

// checkVHDX checks a vhdx image as qemu-img check does (vhdx.Check).
// QEMU's vhdx check repairs nothing itself; its one repair is replaying a
// dirty log, which it does at any writable open, so -r (leaks or all)
// opens the image writable (the writer's lock: an image in use is
// refused) and replays the log first (vhdx.Replay), counted as one
// corruption fixed, as qemu-img counts it. The parent of a differencing
// image is not opened: the check is of this file.
func checkVHDX(ctx context.Context, spec string, o Options, repair int) (formats.CheckResult, error) {
	replayed := false
	if repair != qcow2.RepairNone {
		var lock *aio.Lock
		if o.Lock {
			l := vhdx.Lock(true)
			lock = &l
		}
		f, err := aio.Open(spec, aio.Options{Backend: o.Backend, Logger: o.Logger, Lock: lock, Writable: true})
		if err != nil {
			return formats.CheckResult{}, fmt.Errorf("vhdx: %w", err)
		}
		replayed, err = vhdx.Replay(ctx, f)
		f.Close()
		if err != nil {
			return formats.CheckResult{}, err
		}
	}
	var lock *aio.Lock
	if o.Lock {
		l := vhdx.Lock(false)
		lock = &l
	}
	f, err := aio.Open(spec, aio.Options{Backend: o.Backend, Logger: o.Logger, Lock: lock})
	if err != nil {
		return formats.CheckResult{}, fmt.Errorf("vhdx: %w", err)
	}
	res, err := vhdx.Check(ctx, f)
	if replayed {
		res.CorruptionsFixed++
	}
	return res, err
}
