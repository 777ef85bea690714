// Package cli tests the command line itself: usage and exit statuses,
// help text and messages, man pages and shell completion.
package cli

import (
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
