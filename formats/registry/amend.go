package registry

import (
	"context"
	"errors"
	"fmt"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats/drivers/qcow2"
)

// ErrNoAmend is a format qemu-img amend has no options for.
var ErrNoAmend = errors.New("does not support option amendment")

// Amend applies qemu-img amend's options to the local qcow2 image at
// spec: opened for writing under QEMU's writer lock (held to the end),
// with its backing chain opened and checked first, as qemu-img opens it.
// resize changes the virtual size when o asks (see qcow2.Resizer); it
// opens the image again, without locks, since this open holds them.
func Amend(ctx context.Context, spec, format string, o Options, opts qcow2.AmendOptions, resize qcow2.Resizer) error {
	if format == Auto {
		var err error
		if format, err = detect(spec); err != nil {
			return &qcow2.AmendOpenError{Err: err}
		}
	}
	ff, ok := lookupFormat(format)
	if !ok {
		return &qcow2.AmendOpenError{Err: fmt.Errorf("Unknown driver '%s'", format)}
	}
	if format != QCOW2 {
		return fmt.Errorf("Format driver '%s' %w", format, ErrNoAmend)
	}
	lock := o.lock(ff.Lock, true, false)
	f, err := aio.Open(spec, aio.Options{Backend: o.Backend, Writable: true, Logger: o.Logger, Lock: lock})
	if err != nil {
		return &qcow2.AmendOpenError{Err: err}
	}
	defer f.Close()
	// The image and its chain as a reader sees them: a damaged header,
	// table or a missing backing file stops here, before any change.
	check, err := Open(spec, Options{Format: QCOW2, Backend: o.Backend, Logger: o.Logger, RelatedDirs: o.RelatedDirs})
	if err != nil {
		return &qcow2.AmendOpenError{Err: err}
	}
	check.Image.Close()
	return qcow2.Amend(ctx, f, opts, resize)
}
