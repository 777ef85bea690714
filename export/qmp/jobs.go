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
	base, baseNode := exclusive(a, "base")
	if err := a.done(); err != nil {
		return nil, err
	}
	return map[string]any{}, s.eng.Stream(o, base, baseNode)
}

func blockCommit(s *Server, args map[string]any) (any, error) {
	a := newArgs(args, false)
	o := jobOptions(a, args)
	top, topNode := exclusive(a, "top")
	base, baseNode := exclusive(a, "base")
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
