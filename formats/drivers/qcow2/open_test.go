package qcow2

import (
	"context"
	"errors"
	"log/slog"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/raw"
)

// testOpts are the knobs the package's tests turn: what the registry
// would be told.
type testOpts struct {
	Backend  aio.Backend
	Direct   bool
	Writable bool
	Logger   *slog.Logger
}

// openTest opens the qcow2 image at path as the registry does (which
// these tests cannot import: it imports this package), backing files
// included: qcow2 ones (detected by magic when the header names no
// format) recursively, raw ones through package raw.
func openTest(path string, o testOpts) (*Image, error) {
	return openTestDepth(path, o, 0)
}

func openTestDepth(path string, o testOpts, depth int) (*Image, error) {
	f, err := openTestFile(path, o)
	if err != nil {
		return nil, err
	}
	return New(context.Background(), f, Options{Direct: o.Direct, Writable: o.Writable, Logger: o.Logger,
		OpenBacking: func(bpath, format string) (formats.Image, error) {
			if depth > 8 {
				return nil, errors.New("backing chain deeper than the tests go")
			}
			if format == "" {
				bf, err := openTestFile(bpath, testOpts{Backend: o.Backend})
				if err != nil {
					return nil, err
				}
				head := make([]byte, 8)
				bf.ReadAt(context.Background(), head, 0) // a short file is raw
				bf.Close()
				format = "raw"
				if Probe(head, "") > 0 {
					format = "qcow2"
				}
			}
			bo := o
			bo.Writable = false
			if format == "qcow2" {
				return openTestDepth(bpath, bo, depth+1)
			}
			rf, err := openTestFile(bpath, bo)
			if err != nil {
				return nil, err
			}
			return raw.New(context.Background(), rf, raw.Options{Direct: o.Direct})
		}})
}

func openTestFile(path string, o testOpts) (aio.File, error) {
	f, err := aio.Open(path, aio.Options{Backend: o.Backend, Writable: o.Writable, Direct: o.Direct})
	if err != nil {
		return nil, err
	}
	if o.Direct {
		f = aio.Aligned(f, aio.LogicalBlockSize(f.Fd()))
	}
	return f, nil
}
