// Package remote tests images read over HTTP(S) (nginx) and S3
// (versitygw): exports, info and map against qemu-img's curl driver,
// objects replaced or servers killed mid-read, memory bounds, credentials
// kept out of every message; and the copy-on-read filter and the stream
// job, over local, NBD, HTTP and S3 backing files.
package remote

import (
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
