package fuse

import (
	"io"
	"log/slog"
	"runtime"
	"testing"
)

// An export of a remote object runs with twice the Ps Go gave it, unless
// the user's GOMAXPROCS says how many.
func TestMoreProcsForRemote(t *testing.T) {
	was := runtime.GOMAXPROCS(0)
	t.Cleanup(func() { runtime.GOMAXPROCS(was) })
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))

	t.Setenv("GOMAXPROCS", "")
	moreProcsForRemote(quiet)
	if got := runtime.GOMAXPROCS(0); got != 2*was {
		t.Fatalf("GOMAXPROCS %d, want %d (twice %d)", got, 2*was, was)
	}
	runtime.GOMAXPROCS(was)

	t.Setenv("GOMAXPROCS", "1")
	moreProcsForRemote(quiet)
	if got := runtime.GOMAXPROCS(0); got != was {
		t.Fatalf("with GOMAXPROCS set by the user: %d Ps, want %d as they were", got, was)
	}
}

// Tune's kernel cache: auto is on for a local raw or qcow2 image read
// through the page cache and off elsewhere; the cache is kept across
// opens for a local qcow2 only; the null device and several files over
// the same bytes are never cached.
func TestTuneKernelCache(t *testing.T) {
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, c := range []struct {
		name        string
		s           Served
		cache, keep bool
	}{
		{"auto raw", Served{KernelCache: "auto", Raw: true}, true, false},
		{"auto qcow2", Served{KernelCache: "auto", QCOW2: true}, true, true},
		{"auto qcow2 over NBD", Served{KernelCache: "auto", QCOW2: true, NBD: true}, false, false},
		{"auto raw, cache none", Served{KernelCache: "auto", Raw: true, Direct: true}, false, false},
		{"auto vmdk", Served{KernelCache: "auto"}, false, false},
		{"auto null", Served{KernelCache: "auto", Null: true}, false, false},
		{"on null", Served{KernelCache: "on", Null: true}, false, false},
		{"on vmdk", Served{KernelCache: "on"}, true, false},
		{"auto raw, partitions", Served{KernelCache: "auto", Raw: true, Files: 3}, false, false},
		{"off qcow2", Served{KernelCache: "off", QCOW2: true}, false, false},
	} {
		o := Tune(Options{}, c.s, quiet)
		if o.KernelCache != c.cache || o.KeepCache != c.keep {
			t.Errorf("%s: kernel cache %v, keep %v; want %v, %v", c.name, o.KernelCache, o.KeepCache, c.cache, c.keep)
		}
	}
}
