package main

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"runtime/debug"
	"strings"
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
			return boolFlagsAsInHelp(root, args[0])
		},
	}
}

// manBoolFlag is how cobra/doc writes a boolean flag: its default as if
// it were the value it takes (--writable[=false]), where --help writes
// --writable alone.
var manBoolFlag = regexp.MustCompile(`(\\fB--[a-z0-9-]+\\fP)\[=(true|false)\]\n\t([^\n]*)`)

// boolFlagsAsInHelp rewrites the boolean flags of the pages GenManTree
// wrote for c and its commands into DIR as --help shows them: the flag
// alone, its default said in words where it is true. Only a bool flag has a bare
// true or false in brackets (a string's value is quoted).
func boolFlagsAsInHelp(c *cobra.Command, dir string) error {
	page := filepath.Join(dir, strings.ReplaceAll(c.CommandPath(), " ", "-")+".1")
	b, err := os.ReadFile(page)
	switch {
	case errors.Is(err, fs.ErrNotExist): // a command without a page (help)
	case err != nil:
		return fmt.Errorf("man: %w", err)
	default:
		out := manBoolFlag.ReplaceAllFunc(b, func(m []byte) []byte {
			g := manBoolFlag.FindSubmatch(m)
			line := string(g[1]) + "\n\t" + string(g[3])
			if string(g[2]) == "true" {
				line += " (default true)"
			}
			return []byte(line)
		})
		if err := os.WriteFile(page, out, 0o644); err != nil {
			return fmt.Errorf("man: %w", err)
		}
	}
	for _, sub := range c.Commands() {
		if err := boolFlagsAsInHelp(sub, dir); err != nil {
			return err
		}
	}
	return nil
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
