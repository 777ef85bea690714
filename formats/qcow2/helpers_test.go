package qcow2

import (
	"io"

	"github.com/blockexport/blockexport/aio"
)

type (
	io_Reader     = io.Reader
	io_ReadCloser = io.ReadCloser
)

var io_EOF = io.EOF

func aioBackend(s string) aio.Backend { return aio.Backend(s) }
