package probe

import (
	"context"
	"fmt"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/vhdx"
)

// checkVHDX checks a vhdx image as qemu-img check does (vhdx.Check). It
// opens the file read-only whatever the repair mode: QEMU's vhdx check
// repairs nothing itself (its one repair, replaying a log, happens at a
// writable open, which this reader does not make). The parent of a
// differencing image is not opened: the check is of this file.
func checkVHDX(ctx context.Context, spec string, o Options) (formats.CheckResult, error) {
	var lock *aio.Lock
	if o.Lock {
		l := vhdx.Lock(false)
		lock = &l
	}
	f, err := aio.Open(spec, aio.Options{Backend: o.Backend, Logger: o.Logger, Lock: lock})
	if err != nil {
		return formats.CheckResult{}, fmt.Errorf("vhdx: %w", err)
	}
	return vhdx.Check(ctx, f)
}
