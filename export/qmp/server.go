// Package qmp speaks QEMU's Machine Protocol to monitors (unix sockets,
// stdio) and runs their commands on an engine, the way
// qemu-storage-daemon does: the same greeting, the same capabilities
// negotiation, errors with QEMU's classes and descriptions, events to
// every monitor. It also decodes the command line's QAPI options
// (--blockdev, --export, --nbd-server) with the same rules.
package qmp

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/blockexport/blockexport/export/engine"
)

// Version is what the greeting and query-version say.
type Version struct {
	Major, Minor, Micro int
	Package             string
}

// Server runs the QMP monitors of one engine.
type Server struct {
	eng     *engine.Engine
	version Version
	log     *slog.Logger
	// commands are the commands by name (commandTable).
	commands map[string]command

	// cmdMu runs one command at a time over all monitors, as QEMU's
	// main loop does: two clients cannot interleave halves of commands.
	cmdMu sync.Mutex

	mu       sync.Mutex
	monitors map[*monitor]struct{}
	quit     chan struct{}
	quitOnce sync.Once
}

// New makes a server for eng (nil: given later with SetEngine, for an
// engine whose Options.Event is the server's Event).
func New(eng *engine.Engine, v Version, log *slog.Logger) *Server {
	return &Server{eng: eng, version: v, log: log, commands: commandTable(), monitors: map[*monitor]struct{}{}, quit: make(chan struct{})}
}

// SetEngine gives the server its engine, for a caller that made the
// server first so that the engine's events could reach it.
func (s *Server) SetEngine(eng *engine.Engine) { s.eng = eng }

// Quit is closed when a monitor has run quit.
func (s *Server) Quit() <-chan struct{} { return s.quit }

// Event sends an event to every monitor past capabilities negotiation.
func (s *Server) Event(name string, data any) {
	now := time.Now()
	msg := fmt.Sprintf(`{"timestamp": {"seconds": %d, "microseconds": %d}, "event": %s, "data": %s}`,
		now.Unix(), now.Nanosecond()/1000, quote(name), encode(data))
	s.mu.Lock()
	defer s.mu.Unlock()
	for m := range s.monitors {
		if m.negotiated() {
			m.send(msg)
		}
	}
}

// Serve runs a monitor on each connection l accepts, until l is closed.
func (s *Server) Serve(l net.Listener) error {
	for {
		c, err := l.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			return err
		}
		go s.ServeConn(c)
	}
}

// ServeConn runs one monitor on rw until the client goes or quit.
func (s *Server) ServeConn(rw io.ReadWriteCloser) {
	defer rw.Close()
	m := &monitor{srv: s, w: rw}
	s.mu.Lock()
	s.monitors[m] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.monitors, m)
		s.mu.Unlock()
	}()
	v := s.version
	m.send(fmt.Sprintf(`{"QMP": {"version": {"qemu": {"micro": %d, "minor": %d, "major": %d}, "package": %s}, "capabilities": ["oob"]}}`,
		v.Micro, v.Minor, v.Major, quote(v.Package)))
	sc := &scanner{r: bufio.NewReaderSize(rw, 64<<10)}
	for {
		msg, err := sc.next()
		switch {
		case errors.Is(err, errTooBig), errors.Is(err, errTooDeep):
			m.send(errorReply(nil, engine.Generic, err.Error()))
			continue
		case err != nil:
			return
		}
		if m.handle(msg) {
			return
		}
	}
}

// monitor is one QMP client.
type monitor struct {
	srv *Server
	wmu sync.Mutex
	w   io.Writer
	// ready: qmp_capabilities has run (under srv.cmdMu for writes).
	ready bool
	// oob: the client enabled out-of-band execution (exec-oob), which
	// no command here supports (set once, by the reader).
	oob bool
	rmu sync.Mutex
}

func (m *monitor) negotiated() bool {
	m.rmu.Lock()
	defer m.rmu.Unlock()
	return m.ready
}

// sendTimeout bounds how long a reply or event waits for a client that
// does not read: events are sent under the engine's lock, and one such
// client must not stop the daemon. It is hung up on instead.
const sendTimeout = 10 * time.Second

func (m *monitor) send(line string) {
	m.wmu.Lock()
	defer m.wmu.Unlock()
	d, canTimeOut := m.w.(interface{ SetWriteDeadline(time.Time) error })
	if canTimeOut {
		d.SetWriteDeadline(time.Now().Add(sendTimeout))
	}
	// QEMU ends its lines so. A client gone is found by the reader; one
	// that stopped reading is hung up on.
	if _, err := io.WriteString(m.w, line+"\r\n"); err != nil && canTimeOut {
		if c, ok := m.w.(io.Closer); ok {
			c.Close()
		}
	}
}

// handle runs one message; it returns true after quit.
func (m *monitor) handle(msg []byte) bool {
	d := json.NewDecoder(bytes.NewReader(msg))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		m.send(errorReply(nil, engine.Generic, "JSON parse error, "+parseError(msg, err)))
		return false
	}
	obj, ok := v.(map[string]any)
	if !ok {
		m.send(errorReply(nil, engine.Generic, "QMP input must be a JSON object"))
		return false
	}
	id, hasID := obj["id"]
	if !hasID {
		id = nil
	}
	name, args, oob, err := checkInput(obj, m.oob)
	if err != nil {
		m.send(errorReply(id, engine.Generic, err.Error()))
		return false
	}
	if oob {
		// Nothing here runs out of band; QEMU says so of the commands
		// it has, and CommandNotFound of the others.
		if _, ok := m.srv.commands[name]; ok {
			m.send(errorReply(id, engine.Generic, fmt.Sprintf("The command %s does not support OOB", name)))
		} else {
			m.send(errorReply(id, "CommandNotFound", fmt.Sprintf("The command %s has not been found", name)))
		}
		return false
	}
	m.srv.cmdMu.Lock()
	defer m.srv.cmdMu.Unlock()
	if !m.negotiated() {
		if name != "qmp_capabilities" {
			m.send(errorReply(id, "CommandNotFound", "Expecting capabilities negotiation with 'qmp_capabilities'"))
			return false
		}
		oob, err := capabilities(args)
		if err != nil {
			m.send(errorReply(id, engine.Generic, err.Error()))
			return false
		}
		m.oob = oob
		m.rmu.Lock()
		m.ready = true
		m.rmu.Unlock()
		m.send(returnReply(id, map[string]any{}))
		return false
	}
	ret, err := m.srv.run(name, args)
	var qe *engine.Error
	switch {
	case errors.As(err, &qe):
		m.send(errorReply(id, qe.Class, qe.Desc))
	case err != nil:
		m.send(errorReply(id, engine.Generic, err.Error()))
	default:
		m.send(returnReply(id, ret))
	}
	if name == "quit" && err == nil {
		m.srv.quitOnce.Do(func() { close(m.srv.quit) })
		return true
	}
	return false
}

// checkInput checks the message's members as QEMU's dispatcher does;
// exec-oob is a member only once the client enabled oob.
func checkInput(obj map[string]any, oobEnabled bool) (name string, args map[string]any, oob bool, err error) {
	args = map[string]any{}
	for _, k := range sortedKeys(obj) {
		switch {
		case k == "execute" || (k == "exec-oob" && oobEnabled):
			s, ok := obj[k].(string)
			if !ok {
				return "", nil, false, fmt.Errorf("QMP input member '%s' must be a string", k)
			}
			name, oob = s, k == "exec-oob"
		case k == "arguments":
			a, ok := obj[k].(map[string]any)
			if !ok {
				return "", nil, false, fmt.Errorf("QMP input member 'arguments' must be an object")
			}
			args = a
		case k == "id":
		default:
			return "", nil, false, fmt.Errorf("QMP input member '%s' is unexpected", k)
		}
	}
	if name == "" {
		return "", nil, false, fmt.Errorf("QMP input lacks member 'execute'")
	}
	return name, args, oob, nil
}

// capabilities checks qmp_capabilities' arguments: enable, a list of
// capabilities, of which QEMU has only oob; it says whether oob is on.
func capabilities(args map[string]any) (oob bool, err error) {
	for k, v := range args {
		if k != "enable" {
			return false, fmt.Errorf("Parameter '%s' is unexpected", k)
		}
		list, ok := v.([]any)
		if !ok {
			return false, fmt.Errorf("Invalid parameter type for 'enable', expected: array")
		}
		for i, c := range list {
			if c != "oob" {
				return false, fmt.Errorf("Parameter 'enable[%d]' does not accept value '%v'", i, c)
			}
			oob = true
		}
	}
	return oob, nil
}

// parseError words a JSON syntax error as QEMU does where it can.
func parseError(msg []byte, err error) string {
	t := strings.TrimSpace(string(msg))
	if t == "}" || t == "]" {
		return "expecting value"
	}
	var se *json.SyntaxError
	if errors.As(err, &se) && se.Offset > 0 && int(se.Offset) <= len(msg) {
		rest := msg[se.Offset-1:]
		if c := rest[0]; c >= 'a' && c <= 'z' {
			end := bytes.IndexFunc(rest, func(r rune) bool { return r < 'a' || r > 'z' })
			if end < 0 {
				end = len(rest)
			}
			return fmt.Sprintf("invalid keyword '%s'", rest[:end])
		}
	}
	return err.Error()
}
