package registry

import (
	"context"
	"fmt"

	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/vmdk"
)

// checkVMDK checks a vmdk image as qemu-img check does. It opens the image
// read-only whatever the repair mode: QEMU's vmdk check repairs nothing,
// so -r changes nothing there either. The parent is not opened (the check
// is of this image's own tables).
func checkVMDK(ctx context.Context, spec string, o Options) (formats.CheckResult, error) {
	img, err := Open(spec, Options{Format: "vmdk", Backend: o.Backend, Lock: o.Lock, Logger: o.Logger,
		RelatedDirs: o.RelatedDirs, NoBacking: true})
	if err != nil {
		return formats.CheckResult{}, err
	}
	defer img.Image.Close()
	v, ok := img.Image.(*vmdk.Image)
	if !ok {
		return formats.CheckResult{}, fmt.Errorf("%s: not opened as a vmdk image", spec)
	}
	return v.Check(ctx)
}
