package fuse

import (
	"sync"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// TestBypassWriteWhileAnotherDropPending: a READ cached page 8192 (granule
// 0) with the old bytes; O_DIRECT write W1 at 0 (same granule, another
// page) takes the granule's mark, and its notify is slow (queued behind
// others on the notify thread). W2 over page 8192 lands meanwhile: it
// finds no mark and replies at once, while the kernel's page 8192 still
// holds the bytes from before W2 (W1's notify has not run yet). A
// buffered read after W2's reply returns the old bytes.
func TestBypassWriteWhileAnotherDropPending(t *testing.T) {
	e, _ := kcExport(t, 1<<20, Options{Writable: true})
	started, release := make(chan struct{}), make(chan struct{})
	var mu sync.Mutex
	calls, done := 0, 0
	e.inval = func(off, length int64) {
		mu.Lock()
		calls++
		first := calls == 1
		mu.Unlock()
		if first {
			close(started)
			<-release
		}
		mu.Lock()
		done++
		mu.Unlock()
	}
	defer close(release)
	buf := make([]byte, 4096)
	if _, st := e.ReadInto(ctx, &fuse.ReadIn{Offset: 8192, Size: 4096}, buf); st != fuse.OK {
		t.Fatal(st)
	}
	go e.Write(ctx, &fuse.WriteIn{Offset: 0}, make([]byte, 4096))
	<-started
	w2 := make(chan struct{})
	go func() {
		e.Write(ctx, &fuse.WriteIn{Offset: 8192}, make([]byte, 4096))
		close(w2)
	}()
	select {
	case <-w2:
		mu.Lock()
		d := done
		mu.Unlock()
		if d == 0 {
			t.Fatal("W2 over the READ's page replied while the only drop of that page (W1's) was still pending: the kernel still caches the bytes from before W2")
		}
	case <-time.After(time.Second):
		// W2 waits for the pending drop: coherent.
	}
}
