// Package kernelcache tests --kernel-cache: what the kernel serves from its
// page cache, when the daemon invalidates it (direct writes, punches,
// shrinks, reopens of images that may change behind the export), write-back
// on SIGTERM and after fsync, read-ahead, drop-behind of the host's pages,
// and a loop mount under a memory limit.
package kernelcache

import (
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
