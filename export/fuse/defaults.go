package fuse

import (
	"log/slog"
	"os"
	"runtime"

	"github.com/blockexport/blockexport/aio"
)

// Served is what Tune decides on: the image, and what the command line
// asked.
type Served struct {
	// KernelCache is --kernel-cache: "on", "off" or "auto".
	KernelCache string
	// Raw, QCOW2, Null: the image's format; NBD: it is an NBD export;
	// MayStall: it reads from remote storage (HTTP(S), S3).
	Raw, QCOW2, Null, NBD, MayStall bool
	// Direct: the host files are opened O_DIRECT (--cache none).
	Direct bool
	// Files: the export serves several files over the same bytes
	// (--partitions).
	Files int
	// Hosts are the image's local files.
	Hosts []aio.File
}

// Tune decides the kernel cache Options of an export of s and applies what
// goes with it (drop-behind, the Go processors for a remote image). auto
// turns it on for a local raw or qcow2 image read through the page cache;
// never for the null device (a cache would hand back what was written) or
// several files over the same bytes. KeepCache only for qcow2, whose locks
// deny everybody else write access (docs/design.md, The kernel cache).
func Tune(o Options, s Served, logger *slog.Logger) Options {
	switch s.KernelCache {
	case "on":
		o.KernelCache = true
	case "auto":
		o.KernelCache = (s.Raw || s.QCOW2) && !s.NBD && !s.Direct
	}
	if o.KernelCache && s.Null {
		logger.Info("--kernel-cache on: the null device keeps no data, so it is served uncached")
		o.KernelCache = false
	}
	if s.Files > 1 {
		o.KernelCache = false
	}
	o.KeepCache = o.KernelCache && s.QCOW2 && !s.NBD
	if o.KernelCache && !s.Direct {
		// One cache, not two: the host files drop what they read,
		// keeping their read-ahead (which --cache none gives up).
		n := 0
		for _, h := range s.Hosts {
			if aio.SetDropBehind(h) {
				n++
			}
		}
		if n < len(s.Hosts) {
			logger.Info("kernel cache: some host files keep what they read in the page cache too (files of a backend that cannot drop what it reads)", "files", len(s.Hosts), "drop-behind", n)
		}
	}
	if s.MayStall && !s.NBD {
		moreProcsForRemote(logger)
	}
	return o
}

// moreProcsForRemote runs Go with twice as many Ps as CPUs for an export
// of an HTTP(S) or S3 object, unless GOMAXPROCS says otherwise
// (docs/design.md, Go processors for remote images).
func moreProcsForRemote(logger *slog.Logger) {
	if os.Getenv("GOMAXPROCS") != "" {
		return
	}
	n := 2 * runtime.GOMAXPROCS(0) // the CPUs, or a container's quota of them
	runtime.GOMAXPROCS(n)
	logger.Debug("remote image: Go runs with twice the CPUs' Ps", "GOMAXPROCS", n)
}

// OneProcForOneLoop sets GOMAXPROCS=1 where one loop serves /dev/fuse and
// reads the image's completions too (m.ReadsCompletions), unless the
// environment sets it: the thread then does all the work, and more Ps
// only wake threads to steal the requests each reply makes runnable
// (docs/design.md, One loop for an NBD source).
func OneProcForOneLoop(m *Mount, logger *slog.Logger) {
	if !m.ReadsCompletions() {
		return
	}
	procs := "GOMAXPROCS=1"
	if os.Getenv("GOMAXPROCS") == "" {
		runtime.GOMAXPROCS(1)
	} else {
		procs = "GOMAXPROCS from the environment"
	}
	logger.Info("the /dev/fuse loop reads the NBD replies too: one thread serves the export", "procs", procs)
}
