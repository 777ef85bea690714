// Package fuse tests the exported file as clients see it over FUSE: reads,
// writes, clamping and growth, fallocate, SEEK_DATA/HOLE, setattr, statfs,
// shared mmap, host errors, the export's lifecycle under
// signals and unmounts, and real clients on it (a loop-mounted ext4, fio
// verify, fsx, qcow2 written through the export and killed).
//
// make test runs every test in this package twice: uncached and with the
// kernel page cache on (BLOCKEXPORT_KERNEL_CACHE=on). A test joins both
// runs by living here; one that cannot hold under both belongs in
// tests/daemon or tests/kernelcache.
package fuse

import (
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
