// Package formats tests the image formats end to end against qemu-img:
// qcow2, vmdk, vhdx, vpc and vdi exported and read as QEMU reads them,
// hostile images refused, partitions as files, probing of foreign formats,
// and the verbs info, map, check (and repair), create, convert and compare.
package formats

import (
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
