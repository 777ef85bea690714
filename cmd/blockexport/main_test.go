package main

import (
	"bytes"
	"testing"
)

// TestVerbsAreNamedAsTheirCommands: soleVerb finds a command by the name
// verbs gives it, which must be the name cobra dispatches on.
func TestVerbsAreNamedAsTheirCommands(t *testing.T) {
	for _, v := range verbs() {
		if got := v.build().Name(); got != v.name {
			t.Errorf("verbs() names %q a command cobra calls %q", v.name, got)
		}
	}
}

// TestSoleVerbBuildsTheWholeTreeWhereItIsNeeded: man documents every
// command, help and completion list them, the root's own flags and an
// unknown command are answered with all of them known.
func TestSoleVerbBuildsTheWholeTreeWhereItIsNeeded(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, ""}, {[]string{"man", "dir"}, ""}, {[]string{"help", "measure"}, ""}, {[]string{"completion", "bash"}, ""},
		{[]string{"__complete", "measure", ""}, ""}, {[]string{"--version"}, ""}, {[]string{"mesure"}, ""},
		{[]string{"measure", "--help"}, "measure"}, {[]string{"info", "x.qcow2"}, "info"}, {[]string{"version"}, "version"},
	} {
		if got := soleVerb(tc.args); got != tc.want {
			t.Errorf("soleVerb(%q) = %q, want %q", tc.args, got, tc.want)
		}
	}
}

// TestAVerbBuiltAloneAnswersAsInTheWholeTree: a command run with only
// itself built prints the same help and the same flag errors, with the
// same status, as in the tree of every command.
func TestAVerbBuiltAloneAnswersAsInTheWholeTree(t *testing.T) {
	for _, v := range verbs() {
		if cs := rootCommand(v.name).Commands(); len(cs) != 1 || cs[0].Name() != v.name {
			t.Errorf("rootCommand(%q) has %d commands, want %s alone", v.name, len(cs), v.name)
		}
		for _, args := range [][]string{{v.name, "--help"}, {v.name, "--no-such-flag"}, {v.name, "-h"}} {
			var aloneOut, aloneErr, allOut, allErr bytes.Buffer
			alone := execute(rootCommand(v.name), args, &aloneOut, &aloneErr)
			all := execute(rootCommand(""), args, &allOut, &allErr)
			if alone != all || aloneOut.String() != allOut.String() || aloneErr.String() != allErr.String() {
				t.Errorf("%q built alone: status %d, stdout %q, stderr %q; in the whole tree: status %d, stdout %q, stderr %q",
					args, alone, aloneOut.String(), aloneErr.String(), all, allOut.String(), allErr.String())
			}
			if aloneOut.Len()+aloneErr.Len() == 0 {
				t.Errorf("%q printed nothing", args)
			}
		}
	}
}
