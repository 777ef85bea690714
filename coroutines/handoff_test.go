package coroutines

import (
	"context"
	"testing"
	"time"
)

// TestMissTrackerSkipsTriesWhileReadsMiss: a window of misses makes the
// loop stop trying reads inline except for one probe in probeEvery; a
// window of probes that hit at least half the time makes it try every read
// again.
func TestMissTrackerSkipsTriesWhileReadsMiss(t *testing.T) {
	var m MissTracker
	for i := 0; i < missWindow; i++ {
		if !m.ShouldTry() {
			t.Fatalf("read %d of the first window was not tried", i)
		}
		m.Note(i%2 == 0) // half hit: keep trying
	}
	for i := 0; i < missWindow; i++ {
		if !m.ShouldTry() {
			t.Fatalf("read %d was not tried after a window that hit half the time", i)
		}
		m.Note(false)
	}
	tried := 0
	for i := 0; i < probeEvery*missWindow; i++ {
		if m.ShouldTry() {
			tried++
			m.Note(tried > missWindow/2) // the probes' second half hits
		}
	}
	if tried != missWindow {
		t.Fatalf("%d of %d reads tried while skipping, want one in %d", tried, probeEvery*missWindow, probeEvery)
	}
	// Two reads in a row (ShouldTry counts each): both tried.
	if first, second := m.ShouldTry(), m.ShouldTry(); !first || !second {
		t.Fatal("a window of probes that hit half the time did not bring the tries back")
	}
}

// TestPathMark: a context keeps its path's mark through contexts derived
// from it; an unmarked one is Fresh; each of Handoff's contexts carries
// its own path.
func TestPathMark(t *testing.T) {
	ctx, cancel := context.WithTimeout(WithPath(context.Background(), Lone), time.Second)
	defer cancel()
	if PathOf(ctx) != Lone {
		t.Fatal("a context derived from a Lone one is not Lone")
	}
	if PathOf(context.Background()) != Fresh {
		t.Fatal("a plain context is not Fresh")
	}
	h := NewHandoff(context.Background())
	for _, p := range []Path{Fresh, AfterMiss, Lone} {
		if got := PathOf(h.Context(p)); got != p {
			t.Fatalf("Handoff's context for path %d says %d", p, got)
		}
	}
}
