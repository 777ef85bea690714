package qmp

import (
	"context"
	"fmt"

	"github.com/blockexport/blockexport/export/engine"
)

// command runs one QMP command's arguments on the engine.
type command func(s *Server, args map[string]any) (any, error)

// commandTable is the QMP commands served here; any other, QSD's
// included, is CommandNotFound, as QEMU answers a command it has not.
func commandTable() map[string]command {
	return map[string]command{
		"qmp_capabilities":        nil, // handled by the monitor
		"query-version":           queryVersion,
		"query-commands":          queryCommands,
		"quit":                    noArgs(quit),
		"blockdev-add":            blockdevAdd,
		"blockdev-del":            blockdevDel,
		"block-export-add":        blockExportAdd,
		"block-export-del":        blockExportDel,
		"query-block-exports":     noArgs(func(s *Server) (any, error) { return s.eng.Exports(), nil }),
		"query-named-block-nodes": queryNamedBlockNodes,
		"nbd-server-start":        nbdServerStart,
		"block_resize":            blockResize,
		"query-blockstats":        queryBlockstats,
		"block-stream":            blockStream,
		"block-commit":            blockCommit,
		"query-jobs":              noArgs(func(s *Server) (any, error) { return s.eng.Jobs(), nil }),
		"job-cancel":              jobVerb("cancel"),
		"job-complete":            jobVerb("complete"),
		"job-finalize":            jobVerb("finalize"),
		"job-dismiss":             jobVerb("dismiss"),
		"nbd-server-stop":         noArgs(func(s *Server) (any, error) { return map[string]any{}, s.eng.StopNBD() }),
		"object-add":              objectAdd,
		"object-del":              objectDel,
	}
}

func (s *Server) run(name string, args map[string]any) (any, error) {
	c, ok := s.commands[name]
	if !ok {
		return nil, &engine.Error{Class: "CommandNotFound", Desc: fmt.Sprintf("The command %s has not been found", name)}
	}
	if c == nil {
		return nil, &engine.Error{Class: "CommandNotFound", Desc: "Capabilities negotiation is already complete, command ignored"}
	}
	return c(s, args)
}

// noArgs is a command that takes no arguments.
func noArgs(f func(*Server) (any, error)) command {
	return func(s *Server, args map[string]any) (any, error) {
		if err := newArgs(args, false).done(); err != nil {
			return nil, err
		}
		return f(s)
	}
}

var queryVersion = noArgs(func(s *Server) (any, error) {
	// A struct, so that the members come in QEMU's order.
	type triple struct {
		Micro int `json:"micro"`
		Minor int `json:"minor"`
		Major int `json:"major"`
	}
	v := s.version
	return struct {
		QEMU    triple `json:"qemu"`
		Package string `json:"package"`
	}{triple{v.Micro, v.Minor, v.Major}, v.Package}, nil
})

var queryCommands = noArgs(func(s *Server) (any, error) {
	var list []map[string]string
	for _, name := range sortedKeys(anyMap(s.commands)) {
		list = append(list, map[string]string{"name": name})
	}
	return list, nil
})

func anyMap(m map[string]command) map[string]any {
	out := make(map[string]any, len(m))
	for k := range m {
		out[k] = nil
	}
	return out
}

func blockdevAdd(s *Server, args map[string]any) (any, error) {
	o, err := BlockdevOptions(args, false)
	if err != nil {
		return nil, err
	}
	return map[string]any{}, s.eng.AddNode(o)
}

func blockdevDel(s *Server, args map[string]any) (any, error) {
	a := newArgs(args, false)
	name := a.str("node-name", true)
	if err := a.done(); err != nil {
		return nil, err
	}
	return map[string]any{}, s.eng.DelNode(name)
}

func blockExportAdd(s *Server, args map[string]any) (any, error) {
	o, err := ExportOptions(args, false)
	if err != nil {
		return nil, err
	}
	return map[string]any{}, s.eng.AddExport(o)
}

func blockExportDel(s *Server, args map[string]any) (any, error) {
	a := newArgs(args, false)
	id := a.str("id", true)
	mode := a.enum("mode", false, "safe", "hard")
	if err := a.done(); err != nil {
		return nil, err
	}
	return map[string]any{}, s.eng.DelExport(id, mode == "hard")
}

func queryNamedBlockNodes(s *Server, args map[string]any) (any, error) {
	a := newArgs(args, false)
	a.boolean("flat") // the nodes are listed without their backing chains either way
	if err := a.done(); err != nil {
		return nil, err
	}
	return s.eng.Nodes(), nil
}

func nbdServerStart(s *Server, args map[string]any) (any, error) {
	o, err := NBDServerOptions(args)
	if err != nil {
		return nil, err
	}
	return map[string]any{}, s.eng.StartNBD(o)
}

func blockResize(s *Server, args map[string]any) (any, error) {
	a := newArgs(args, false)
	device := a.str("device", false)
	node := a.str("node-name", false)
	size := a.integer("size", true)
	if err := a.done(); err != nil {
		return nil, err
	}
	return map[string]any{}, s.eng.Resize(context.Background(), device, node, size)
}

// quit ends every export before its reply, as QSD does: a client sees
// each BLOCK_EXPORT_DELETED first. A failure to close is logged, and the
// process ends anyway.
func quit(s *Server) (any, error) {
	if err := s.eng.Close(); err != nil {
		s.log.Warn("closing the block nodes at quit", "err", err)
	}
	return map[string]any{}, nil
}

func queryBlockstats(s *Server, args map[string]any) (any, error) {
	a := newArgs(args, false)
	nodes := a.boolean("query-nodes")
	if err := a.done(); err != nil {
		return nil, err
	}
	return s.eng.BlockStats(nodes), nil
}

func objectAdd(s *Server, args map[string]any) (any, error) {
	o, err := TLSCredsOptions(args, false)
	if err != nil {
		return nil, err
	}
	return map[string]any{}, s.eng.AddTLSCreds(o)
}

func objectDel(s *Server, args map[string]any) (any, error) {
	a := newArgs(args, false)
	id := a.str("id", true)
	if err := a.done(); err != nil {
		return nil, err
	}
	return map[string]any{}, s.eng.DelObject(id)
}
