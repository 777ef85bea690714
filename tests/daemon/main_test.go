// Package daemon tests the blockexport fuse process around the exported
// file: argument and mountpoint rules, signals, the pidfile and the log,
// QEMU's image locks, unprivileged mounts, queues,
// mapped reads, and a differential run against qemu-storage-daemon. Unlike
// tests/fuse, these run once, over /dev/fuse with the daemon's defaults.
package daemon

import (
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
