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

// AmendRequest is one qemu-img amend, in the order qemu-img takes its
// steps: the image is opened first, and only then are the options
// parsed (Options) and applied.
type AmendRequest struct {
	Options func() (qcow2.AmendOptions, error)
	// Resize changes the virtual size when the options ask (see
	// qcow2.Resizer); it opens the image again, without locks, since
	// the amend's open holds them.
	Resize qcow2.Resizer
	// Report gets the findings of the repair of an image not closed
	// cleanly, as QEMU prints them at open.
	Report func(string)
}

// Amend applies qemu-img amend's options to the local qcow2 image at
// spec: opened for writing under QEMU's writer lock (held to the end),
// with its backing chain opened and checked first, as qemu-img opens it.
func Amend(ctx context.Context, spec, format string, o Options, r AmendRequest) error {
	if format == Auto {
		var err error
		if format, _, err = detect(spec); err != nil {
			return &qcow2.AmendOpenError{Err: err}
		}
	}
	ff, ok := lookupFormat(format)
	if !ok {
		return &qcow2.AmendOpenError{Err: fmt.Errorf("Unknown driver '%s'", format)}
	}
	if format != QCOW2 {
		// Opened as qemu-img opens it (its refusals first), then refused.
		img, err := Open(spec, Options{Format: format, Writable: true, Lock: o.Lock, Backend: o.Backend, NoBacking: true})
		if err != nil {
			return &qcow2.AmendOpenError{Err: err}
		}
		img.Image.Close()
		return fmt.Errorf("Format driver '%s' %w", format, ErrNoAmend)
	}
	lock := o.lock(ff.Lock, true, false)
	f, err := aio.Open(spec, aio.Options{Backend: o.Backend, Writable: true, Logger: o.Logger, Lock: lock})
	if err != nil {
		return &qcow2.AmendOpenError{Err: err}
	}
	defer f.Close()
	// The image and its chain as a reader sees them: a damaged header or
	// table, or a missing backing file, stops here, before any change.
	check, err := Open(spec, Options{Format: QCOW2, Backend: o.Backend, Logger: o.Logger, RelatedDirs: o.RelatedDirs})
	if err != nil {
		return &qcow2.AmendOpenError{Err: err}
	}
	check.Image.Close()
	msgs, err := qcow2.PrepareAmend(ctx, f)
	if r.Report != nil {
		for _, m := range msgs {
			r.Report(m)
		}
	}
	if err != nil {
		return err
	}
	opts, err := r.Options()
	if err != nil {
		return err
	}
	return qcow2.Amend(ctx, f, opts, r.Resize)
}
