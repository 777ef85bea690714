package cli

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestVersion: --version and version print the module version and the
// VCS revision the binary was built from (the tests build it from this
// checkout, so the revision is HEAD's when git can tell).
func TestVersion(t *testing.T) {
	for _, arg := range []string{"--version", "version"} {
		code, out := harness.RunBlockexport(t, arg)
		if code != 0 || !strings.HasPrefix(out, "blockexport ") || strings.Count(out, "\n") != 1 {
			t.Fatalf("%s: exit %d, %q", arg, code, out)
		}
		if head, err := exec.Command("git", "rev-parse", "HEAD").Output(); err == nil {
			if rev := strings.TrimSpace(string(head)); !strings.Contains(out, rev) {
				t.Errorf("%s: %q does not name HEAD %s", arg, out, rev)
			}
		}
	}
}
