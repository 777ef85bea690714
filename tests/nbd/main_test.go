// Package nbd tests NBD both ways: blockexport nbd as a server (QEMU's
// tools, nbdinfo and nbdcopy as clients; abuse, handshake limits, shutdown)
// and NBD servers as an image source (qemu-nbd, nbdkit, TLS, reconnects,
// servers that lie).
package nbd

import (
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
