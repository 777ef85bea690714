package raw

import (
	"context"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/driver"
)

// Driver is raw's registry entry: read, written and created; no checks.
// Its probe says 1 to anything, so that any magic wins over it.
func Driver() driver.Format {
	return driver.Format{Name: "raw", Probe: func([]byte, string) int { return 1 }, Lock: Lock, Writable: true, Create: Create,
		Open: func(ctx context.Context, f aio.File, o driver.Options) (formats.Image, error) {
			return driver.Image(New(ctx, f, Options{Writable: o.Writable, Direct: o.Direct}))
		}}
}
