package cli

import (
	"regexp"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestHelpShowsBooleanFlagsAsCobraToolsDo: a boolean flag's help line is
// "-w, --writable   USAGE", as in every other cobra tool, not
// "--writable[=true|false]" (pflag 1.1.0's rendering), in --help and in
// the man pages alike.
func TestHelpShowsBooleanFlagsAsCobraToolsDo(t *testing.T) {
	for _, name := range append([]string{"", "convert", "compare"}, commandNames...) {
		args := []string{"--help"}
		if name != "" {
			args = []string{name, "--help"}
		}
		code, out := harness.RunBlockexport(t, args...)
		if code != 0 {
			t.Fatalf("blockexport %v: exit %d\n%s", args, code, out)
		}
		if strings.Contains(out, "[=true|false]") {
			t.Errorf("blockexport %v shows [=true|false]:\n%s", args, out)
		}
		if !regexp.MustCompile(`(?m)^  -h, --help +help for `).MatchString(out) {
			t.Errorf("blockexport %v: no plain \"-h, --help\" line:\n%s", args, out)
		}
	}
	_, out := harness.RunBlockexport(t, "fuse", "--help")
	for _, line := range []string{`  -w, --writable +allow writes`, `      --mapped-reads +reads .*\(default true\)`} {
		if !regexp.MustCompile(`(?m)^` + line).MatchString(out) {
			t.Errorf("fuse --help has no line like %q:\n%s", line, out)
		}
	}
}
