package main

import (
	"fmt"
	"os"
	"runtime/debug"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/cobra/doc"
)

// manCommand writes the man pages, generated from the commands and their
// flags (cobra/doc), so that they cannot drift from what the commands
// parse. docs/man holds the pages of the current tree (make man); a test
// checks they are current.
func manCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "man DIR",
		Short: "write a man page per command into DIR (blockexport.1, blockexport-fuse.1, ...)",
		Long: "Write the man pages of blockexport and of each of its commands into DIR (created if\n" +
			"missing), generated from the same flag definitions the commands parse.",
		Example: "  blockexport man /usr/local/share/man/man1",
		ValidArgsFunction: func(*cobra.Command, []string, string) ([]string, cobra.ShellCompDirective) {
			return nil, cobra.ShellCompDirectiveFilterDirs
		},
		RunE: func(c *cobra.Command, args []string) error {
			if len(args) != 1 {
				return usagef("man: want one DIR, got %d argument(s)", len(args))
			}
			if err := os.MkdirAll(args[0], 0o755); err != nil {
				return fmt.Errorf("man: %w", err)
			}
			root := c.Root()
			disableAutoGenTag(root)
			h := &doc.GenManHeader{Section: "1", Source: "blockexport", Manual: "blockexport manual"}
			if when, ok := commitTime(); ok {
				h.Date = &when // reproducible pages: the commit's date, not today's
			}
			if err := doc.GenManTree(root, h, args[0]); err != nil {
				return fmt.Errorf("man: %w", err)
			}
			return nil
		},
	}
}

// disableAutoGenTag drops cobra's "Auto generated" history line (it
// carries a date, and says nothing a reader needs).
func disableAutoGenTag(c *cobra.Command) {
	c.DisableAutoGenTag = true
	for _, sub := range c.Commands() {
		disableAutoGenTag(sub)
	}
}

// commitTime is the VCS time of this build, if it has one.
func commitTime() (time.Time, bool) {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return time.Time{}, false
	}
	t, err := time.Parse(time.RFC3339, buildSettings(bi)["vcs.time"])
	return t, err == nil
}
