package stream

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/blockexport/blockexport/formats/drivers/qcow2"
)

// slowFlush is a qcow2 overlay whose first Flush takes a while (another
// worker's copy and flush overtake it), and whose flushes fail once
// failAfter is set.
type slowFlush struct {
	*qcow2.Image
	calls     atomic.Int64
	failAfter atomic.Bool
}

var errFlush = errors.New("flush failed")

func (s *slowFlush) Flush(ctx context.Context) error {
	if s.failAfter.Load() {
		return errFlush
	}
	if s.calls.Add(1) == 1 {
		time.Sleep(50 * time.Millisecond)
	}
	return s.Image.Flush(ctx)
}

// TestStreamDurableNeverAheadOfDone: every progress step's durable is at
// most its done ("of done, the bytes a flush made durable"), even when a
// later step's flush returns before an earlier step has reported.
func TestStreamDurableNeverAheadOfDone(t *testing.T) {
	q, _, _ := overlay(t, 8<<20, 1<<62)
	s := &slowFlush{Image: q}
	defer q.Close()
	var mu sync.Mutex
	var bad []string
	err := Stream(context.Background(), s, StreamOptions{Parallel: 2, Step: 1 << 20, FlushEvery: 1 << 20,
		Progress: func(off, n, done, durable, total int64) {
			if durable > done || done > total {
				mu.Lock()
				bad = append(bad, fmt.Sprintf("%d/%d/%d", done, durable, total))
				mu.Unlock()
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	if len(bad) > 0 {
		t.Fatalf("progress steps with durable past done (done/durable/total): %v", bad)
	}
}

// TestStreamInterruptedFlushFailureIsReported: a stream cancelled while its
// last flush fails does not return the bare context error (which the
// command reports as "copied and flushed; run it again").
func TestStreamInterruptedFlushFailureIsReported(t *testing.T) {
	q, _, _ := overlay(t, 16<<20, 1<<62)
	s := &slowFlush{Image: q}
	defer q.Close()
	ctx, cancel := context.WithCancel(context.Background())
	err := Stream(ctx, s, StreamOptions{Parallel: 2, Progress: func(_, _, done, _, _ int64) {
		if done >= 4<<20 {
			s.failAfter.Store(true)
			cancel()
		}
	}})
	if !errors.Is(err, errFlush) {
		t.Fatalf("a cancelled stream whose flush failed returned %v, not the flush's error", err)
	}
}
