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
