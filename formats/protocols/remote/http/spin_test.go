package http

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/blockexport/blockexport/coroutines"
	"github.com/blockexport/blockexport/formats/protocols/remote"
)

// A lone reader's GET spins for its reply before it sleeps in the poller
// (replySpin). These drive that read over plain TCP and TLS with replies
// that come inside the spin, after it, in pieces, never, or cut short:
// the right bytes or an error, and the context's deadline still holds.
// (rawServer, in spinrev_test.go, is the server.)
func TestLoneReadsSpinThenSleep(t *testing.T) {
	forBoth(t, func(t *testing.T, tlsOn bool) {
		const size = 1 << 20
		s := newRawServer(t, tlsOn, size, nil)
		lone := coroutines.WithPath(context.Background(), coroutines.Lone)
		// Honest replies on a kept-alive connection, of sizes that take
		// one read and several.
		for k := int64(0); k < 64; k++ {
			n := int64(4096) << (k % 6)
			if err := s.read(lone, k*12345%(size-n), n); err != nil {
				t.Fatalf("honest reply %d: %v", k, err)
			}
		}
		s.modes.Store(int64(4096), "trickle")
		if err := s.read(lone, 4096, 64<<10); err != nil {
			t.Fatalf("a reply in pieces, after the spin: %v", err)
		}
		s.modes.Store(int64(8192), "silent")
		ctx, cancel := context.WithTimeout(lone, 200*time.Millisecond)
		defer cancel()
		start := time.Now()
		if err := s.read(ctx, 8192, 4096); err == nil {
			t.Fatal("a reply that never comes: no error")
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Fatalf("a reply that never comes: the 200 ms deadline ended the read after %v", d)
		}
		s.modes.Store(int64(12288), "cut")
		if err := s.read(lone, 12288, 64<<10); err == nil || !errors.Is(err, remote.ErrTemporary) {
			t.Fatalf("a body cut short: %v, want a temporary error", err)
		}
		// The connections left are still good for the next reader.
		if err := s.read(lone, 1<<19, 4096); err != nil {
			t.Fatalf("after the faults: %v", err)
		}
	})
}
