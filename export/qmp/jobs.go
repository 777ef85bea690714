package qmp

import (
	"github.com/blockexport/blockexport/export/engine"
)

// jobOptions reads the arguments block-stream and block-commit share
// (backing-file among them: the name written for the base at finalize);
// auto-finalize and auto-dismiss default to true, as in QEMU.
func jobOptions(a *args, raw map[string]any) engine.JobOptions {
	o := engine.JobOptions{ID: a.str("job-id", false), Device: a.str("device", true), AutoFinalize: true, AutoDismiss: true}
	if _, ok := raw["auto-finalize"]; ok {
		o.AutoFinalize = a.boolean("auto-finalize")
	}
	if _, ok := raw["auto-dismiss"]; ok {
		o.AutoDismiss = a.boolean("auto-dismiss")
	}
	a.enum("on-error", false, "report", "ignore", "enospc", "stop", "auto")
	o.Speed = a.integer("speed", false)
	o.BackingFile = a.str("backing-file", false)
	return o
}

func blockStream(s *Server, args map[string]any) (any, error) {
	a := newArgs(args, false)
	o := jobOptions(a, args)
	// QEMU's block-stream words its conflicts its own way, not as
	// block-commit's "mutually exclusive".
	base, baseNode, bottom := a.str("base", false), a.str("base-node", false), a.str("bottom", false)
	for _, c := range [][2]string{{"base", "base-node"}, {"base", "bottom"}, {"bottom", "base-node"}} {
		if _, x := args[c[0]]; x {
			if _, y := args[c[1]]; y {
				a.fail("'%s' and '%s' cannot be specified at the same time", c[0], c[1])
			}
		}
	}
	a.str("filter-node-name", false) // QEMU's filter node is not here: nothing to name
	if err := a.done(); err != nil {
		return nil, err
	}
	return map[string]any{}, s.eng.Stream(o, base, baseNode, bottom)
}

func blockCommit(s *Server, args map[string]any) (any, error) {
	a := newArgs(args, false)
	o := jobOptions(a, args)
	top, topNode := exclusive(a, "top")
	base, baseNode := exclusive(a, "base")
	a.str("filter-node-name", false) // QEMU's filter node is not here: nothing to name
	if err := a.done(); err != nil {
		return nil, err
	}
	return map[string]any{}, s.eng.Commit(o, top, base, topNode, baseNode)
}

// exclusive reads a layer named by file (name) or by node (name-node),
// not both, as QEMU takes them.
func exclusive(a *args, name string) (file, node string) {
	file, node = a.str(name, false), a.str(name+"-node", false)
	if file != "" && node != "" {
		a.fail("'%s-node' and '%s' are mutually exclusive", name, name)
	}
	return file, node
}

// jobVerb is job-cancel, -complete, -finalize or -dismiss.
func jobVerb(verb string) command {
	return func(s *Server, args map[string]any) (any, error) {
		a := newArgs(args, false)
		id := a.str("id", true)
		if verb == "cancel" {
			a.boolean("force") // for mirror's ready state, which no job here has
		}
		if err := a.done(); err != nil {
			return nil, err
		}
		return map[string]any{}, s.eng.JobVerb(id, verb)
	}
}
