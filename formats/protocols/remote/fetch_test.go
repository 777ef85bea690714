package remote

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

// TestQueuedReadsKeepTheReconnectTimeout: a server that accepts and
// never answers, one connection, four reads at once: each fails within
// the reconnect timeout (plus slack), counted from when it was asked,
// not one timeout after another as they take turns on the connection.
func TestQueuedReadsKeepTheReconnectTimeout(t *testing.T) {
	m := &memBackend{data: patterned(16 << 20)}
	m.fail = func(n int64, ctx context.Context) error {
		<-ctx.Done()
		return Temporary(ctx.Err())
	}
	f := openMem(t, m, Options{Connections: 1, ReconnectTimeout: 2 * time.Second})
	var wg sync.WaitGroup
	took := make([]time.Duration, 4)
	errs := make([]error, 4)
	for r := range took {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t0 := time.Now()
			_, errs[r] = f.ReadAt(context.Background(), make([]byte, 4096), int64(r+1)*(3<<20))
			took[r] = time.Since(t0)
		}()
	}
	wg.Wait()
	for r, d := range took {
		// Taking turns, the second would fail after 4 s; the slack is
		// for a loaded machine (a second and a bit).
		if errs[r] == nil || d > 3200*time.Millisecond {
			t.Errorf("read %d: %v after %v with a reconnect timeout of 2s", r, errs[r], d)
		}
	}
}

// TestCloseWhileReading: Close racing readers that start fetches: no
// reader waits past Close for a fetch nobody will complete (run with
// -race: the fetches' WaitGroup is not added to while Close waits).
func TestCloseWhileReading(t *testing.T) {
	for round := 0; round < 150; round++ {
		m := &memBackend{data: patterned(8 << 20)}
		f, err := Open(context.Background(), m, Options{Connections: 2})
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		hung := make(chan int, 8)
		for r := 0; r < 8; r++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
				defer cancel()
				buf := make([]byte, 4096)
				for i := 0; i < 40; i++ {
					_, err := f.ReadAt(ctx, buf, int64((r*40+i)*65536*3)%(8<<20))
					if errors.Is(err, context.DeadlineExceeded) {
						hung <- r
						return
					}
					if err != nil {
						return
					}
				}
			}()
		}
		time.Sleep(time.Duration(round%20) * 50 * time.Microsecond)
		f.Close()
		wg.Wait()
		close(hung)
		for r := range hung {
			t.Fatalf("round %d: reader %d waited until its own deadline after Close", round, r)
		}
	}
}

// TestReadersGoBeforeReadahead: a reader's own block is fetched before
// readahead queued earlier: with one connection, 100 ms a GET and
// megabytes of readahead queued for a sequential reader, a random read
// waits for the GET in flight and its own, not for the queue.
func TestReadersGoBeforeReadahead(t *testing.T) {
	m := &memBackend{data: patterned(64 << 20), delay: 100 * time.Millisecond}
	f := openMem(t, m, Options{Connections: 1, CacheSize: 64 << 20})
	ctx := context.Background()
	buf := make([]byte, 64<<10)
	var off int64
	for off < 8<<20 {
		if _, err := f.ReadAt(ctx, buf, off); err != nil {
			t.Fatal(err)
		}
		off += int64(len(buf))
	}
	m.mu.Lock()
	n0 := len(m.asked)
	m.mu.Unlock()
	t0 := time.Now()
	if _, err := f.ReadAt(ctx, buf, 60<<20); err != nil {
		t.Fatal(err)
	}
	d := time.Since(t0)
	// Counted in GETs, not time (in a loaded test run the read once took
	// 477 ms, behind four readahead GETs, when a reader's fetch queued only
	// once its goroutine ran): the read's own is the next one asked once the GET in
	// flight ends (one more if readahead took the connection before the
	// read queued); behind the queue it was the 17th.
	m.mu.Lock()
	defer m.mu.Unlock()
	k := n0
	for k < len(m.asked) && m.asked[k][0] != 60<<20 {
		k++
	}
	if k == len(m.asked) || k-n0 > 1 {
		t.Fatalf("a random read's GET went out after %d readahead GETs queued before it (%v; %d GETs so far, 100 ms each)", k-n0, d, len(m.asked))
	}
}
