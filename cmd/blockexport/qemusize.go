package main

import (
	"errors"
	"fmt"

	"github.com/blockexport/blockexport/formats/registry"
)

// cvtnum parses a number operand as qemu-img's cvtnum_full does: a size
// with qemu's suffixes, from lo to hi, refused in its words ("Invalid bs
// specified. ...").
func cvtnum(name, value string, lo, hi int64) (int64, error) {
	n, err := registry.ParseQemuSize(value)
	if err != nil && !errors.Is(err, registry.ErrSizeRange) {
		return 0, qemuRefusal(fmt.Sprintf("Invalid %s specified. You may use k, M, G, T, P or E suffixes for", name),
			"kilobytes, megabytes, gigabytes, terabytes, petabytes and exabytes.")
	}
	if err != nil || n > uint64(hi) || int64(n) < lo {
		return 0, qemuRefusal(fmt.Sprintf("Invalid %s specified. Must be between %d and %d.", name, lo, hi))
	}
	return int64(n), nil
}
