package main

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/qcow2"
)

// snapshotSpec is --snapshot's value as qemu-nbd -l takes it: an ID or a
// name (the ID tried first), or snapshot.id=ID and/or snapshot.name=NAME.
type snapshotSpec struct {
	id, name string
	idOrName bool
}

func parseSnapshotSpec(s string) (snapshotSpec, error) {
	if !strings.HasPrefix(s, "snapshot.") {
		return snapshotSpec{id: s, name: s, idOrName: true}, nil
	}
	var sp snapshotSpec
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(kv, "=")
		switch {
		case ok && k == "snapshot.id":
			sp.id = v
		case ok && k == "snapshot.name":
			sp.name = v
		default:
			return sp, fmt.Errorf("--snapshot %q: want NAME, ID, snapshot.id=ID or snapshot.name=NAME", s)
		}
	}
	return sp, nil
}

// loadSnapshot makes img read as its internal snapshot spec (read-only).
func loadSnapshot(ctx context.Context, img formats.Image, spec snapshotSpec) error {
	q, ok := img.(*qcow2.Image)
	if !ok {
		return fmt.Errorf("Failed to load snapshot: the image format has no internal snapshots (qcow2 has)")
	}
	err := q.LoadSnapshot(ctx, spec.id, "")
	if spec.idOrName {
		if errors.Is(err, qcow2.ErrSnapshotNotFound) {
			err = q.LoadSnapshot(ctx, "", spec.name)
		}
	} else {
		err = q.LoadSnapshot(ctx, spec.id, spec.name)
	}
	if errors.Is(err, qcow2.ErrSnapshotNotFound) {
		err = errors.New("Can't find snapshot") // qemu-nbd -l's words
	}
	if err != nil {
		return fmt.Errorf("Failed to load snapshot: %w", err)
	}
	return nil
}
