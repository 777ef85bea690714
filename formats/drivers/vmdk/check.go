package vmdk

import (
	"context"
	"errors"
	"fmt"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/driver"
)

// Check checks the image as qemu-img check checks a vmdk (QEMU's
// vmdk_co_check): every allocated grain lies inside its extent file, and
// a flat extent starts inside its file. The first finding is said in
// qemu-img's words and fails the check, as it fails QEMU's (qemu-img
// exits 1, "Check failed"). An image whose grain directory or tables do
// not check out is refused at open, before any check (QEMU's check reads
// such tables as zeroes and passes them). QEMU's vmdk check repairs
// nothing, so -r changes nothing here either. The parent is not opened
// (the check is of this image's own tables). f is closed.
func Check(ctx context.Context, f aio.File, o driver.Options, _ int) (formats.CheckResult, error) {
	im, err := New(ctx, f, Options{Name: o.Name, OpenExtent: o.OpenFile,
		OpenParent: func(n string) (formats.Image, string, error) { return nil, n, nil }})
	if err != nil {
		return formats.CheckResult{}, err
	}
	defer im.Close()
	return im.check(ctx)
}

func (im *Image) check(ctx context.Context) (formats.CheckResult, error) {
	r := formats.CheckResult{Filename: im.name, Format: "vmdk"}
	for _, e := range im.extents {
		if err := ctx.Err(); err != nil {
			return r, err
		}
		switch {
		case e.f == nil: // ZERO
		case !e.sparse:
			fs, err := aio.FileSize(e.f)
			if err != nil {
				return r, err
			}
			if e.flatOff >= fs {
				return failed(r, fmt.Sprintf("ERROR: cluster offset for sector %d points after EOF", e.start/sectorSize))
			}
		default:
			span := e.grain * e.gtes
			for off := int64(0); off < e.size; {
				if e.gd[off/span] == 0 {
					off = (off/span + 1) * span // a whole table unallocated
					continue
				}
				if _, _, _, err := e.lookupGrain(ctx, off, false); errors.Is(err, ErrCorrupt) {
					return failed(r, fmt.Sprintf("ERROR: cluster offset for sector %d points after EOF or into metadata", (e.start+off)/sectorSize))
				} else if err != nil {
					return r, err
				}
				off += e.grain
			}
		}
	}
	return r, nil
}

// failed is the check's result after its first finding.
func failed(r formats.CheckResult, msg string) (formats.CheckResult, error) {
	r.Corruptions++
	r.Messages = append(r.Messages, msg)
	return r, fmt.Errorf("%w: check failed: %s", ErrCorrupt, msg)
}
