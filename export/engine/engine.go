// Package engine holds what one daemon process serves, the way
// qemu-storage-daemon does: block nodes (images opened under a node name,
// by QEMU's driver names) and exports of them (FUSE mounts, NBD exports),
// added and removed at run time while the others serve I/O. It knows
// nothing of how it is driven (QMP, a command line): callers give it
// typed options, and its errors carry QEMU's class and wording, so that a
// front end passes them on as they are.
package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/blockexport/blockexport/aio"
)

// Error is a failure as QEMU reports it: a class (GenericError,
// DeviceNotFound) and a description scripts match on.
type Error struct {
	Class string
	Desc  string
}

func (e *Error) Error() string { return e.Desc }

// Generic and DeviceNotFound are QEMU's error classes used here.
const (
	Generic        = "GenericError"
	DeviceNotFound = "DeviceNotFound"
)

func genericf(format string, a ...any) error {
	return &Error{Class: Generic, Desc: fmt.Sprintf(format, a...)}
}

// errnoText is an errno as QEMU's strerror prints it: "No such file or
// directory", capitalised, where Go's text is lower case.
func errnoText(err error) string {
	var en syscall.Errno
	if !errors.As(err, &en) {
		return err.Error()
	}
	s := en.Error()
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}

// Options say how the engine opens images.
type Options struct {
	Logger *slog.Logger
	// Backend is the host I/O engine of the images' files.
	Backend aio.Backend
	// Event is called for each event (BLOCK_EXPORT_DELETED) with its
	// name and data (a map, or a struct whose fields are in QEMU's
	// order); nil drops them.
	Event func(name string, data any)
	// ReturnMemory: once blockdev-dels go quiet (returnMemoryAfter), the
	// memory the deleted nodes freed goes back to the system. Go keeps a
	// freed heap resident for reuse and returns it only slowly: a daemon
	// whose 200 qcow2 nodes (each with its L2 and refcount tables) were
	// deleted held about as much as with them.
	ReturnMemory bool
}

// returnMemoryAfter is how long after the last blockdev-del the freed
// memory goes back: a script deleting many nodes pays one collection
// after its last, not one per node.
const returnMemoryAfter = 500 * time.Millisecond

// Engine is the set of nodes and exports of one daemon. Its methods are
// safe for concurrent use; each runs to its end before the next starts,
// as QMP commands do in QEMU's main loop.
type Engine struct {
	o   Options
	log *slog.Logger

	mu      sync.Mutex
	nodes   []*node // oldest first
	exports []*export
	jobs    []*job // block jobs not yet dismissed
	nbd     *nbdServer
	objects map[string]*tlsCreds // by id (object-add)
	// implicit numbers the nodes made for inline children ("#block1"),
	// as QEMU names them.
	implicit int

	// giveBack returns freed memory to the system (Options.ReturnMemory;
	// debug.FreeOSMemory but in tests); giveBackTimer waits for the
	// deletions to go quiet.
	giveBack      func()
	giveBackTimer *time.Timer
}

// New makes an empty engine.
func New(o Options) *Engine {
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	return &Engine{o: o, log: o.Logger, giveBack: debug.FreeOSMemory}
}

// nodeFreed notes that a node was deleted: with Options.ReturnMemory the
// memory goes back once no other deletion came for returnMemoryAfter.
// The caller holds e.mu.
func (e *Engine) nodeFreed() {
	if !e.o.ReturnMemory {
		return
	}
	if e.giveBackTimer != nil {
		e.giveBackTimer.Reset(returnMemoryAfter)
		return
	}
	e.giveBackTimer = time.AfterFunc(returnMemoryAfter, e.giveBack)
}

func (e *Engine) event(name string, data any) {
	if e.o.Event != nil {
		e.o.Event(name, data)
	}
}

// Close ends every export and closes every node, as quit does; the
// exports' deletion events are sent as QEMU sends them.
func (e *Engine) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	var first error
	if e.giveBackTimer != nil {
		e.giveBackTimer.Stop() // the process is ending
	}
	e.stopJobs()
	// Oldest first, the order QSD 7.2's events come in at quit.
	for len(e.exports) > 0 {
		x := e.exports[0]
		if err := e.removeExport(context.Background(), x, true); err != nil && first == nil {
			first = err
		}
	}
	if e.nbd != nil {
		e.nbd.stop()
		e.nbd = nil
	}
	for i := len(e.nodes) - 1; i >= 0; i-- {
		if err := e.nodes[i].close(); err != nil && first == nil {
			first = err
		}
	}
	e.nodes = nil
	return first
}
