package stream

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/blockexport/blockexport/formats"
)

// Streaming (QEMU's block-stream): every range the top layer does not
// allocate and some layer below does (above the base, when there is one)
// is copied into the top layer, several requests in flight, then the top
// layer drops its backing file (unless the caller keeps it, to change it
// itself); bytes no layer allocates are left alone, as block-stream leaves
// them. An interrupted stream leaves a consistent image with its backing
// file; run again, it copies only what the top layer still lacks.

// Streamer is a writable top layer that streams its backing chain in.
type Streamer interface {
	formats.Image
	formats.Layered
	// Populate copies the clusters of [off, off+n) this layer does not
	// allocate from the backing chain, and returns the bytes copied.
	Populate(ctx context.Context, off, n int64) (int64, error)
	// DropBacking makes the layer stand alone, crash-safely; every
	// cluster the chain answered for must be copied and no request in
	// flight.
	DropBacking(ctx context.Context) error
}

// StreamOptions say how to stream.
type StreamOptions struct {
	// Parallel is the number of requests in flight (default 4).
	Parallel int
	// Step is the bytes one request copies (default 1 MiB): the memory
	// a stream holds is about Parallel*Step.
	Step int64
	// FlushEvery: the copies are made durable every so many bytes
	// (default 16 MiB) or FlushInterval (default 5 s), whichever comes
	// first, so that a killed stream loses little of its work.
	FlushEvery    int64
	FlushInterval time.Duration
	// Progress, when set, hears of every step done: its range, the
	// bytes done, made durable (flushed: what a rerun after a kill need
	// not copy again) and to do in all (done counts planned bytes, so a
	// rerun starts from what is left). Called from one goroutine at a
	// time.
	Progress func(off, n, done, durable, total int64)
	// Planned, when set, hears the total before the first step.
	Planned func(total int64)
	// Base, when positive, is the depth of the layer the stream stops
	// at (1: the image's own backing file): only what the layers above
	// it allocate is copied, as QEMU's block-stream to a base. 0: the
	// whole chain.
	Base int
	// KeepBacking leaves the header's backing file as it is: the caller
	// changes it itself (a daemon's job does so at finalize, as QEMU's
	// does in its prepare step). A stream to a base always keeps it.
	KeepBacking bool
}

// ErrNoBackingFile: the image has nothing to stream.
var ErrNoBackingFile = errors.New("the image has no backing file: nothing to stream")

// Stream copies the backing chain into img and drops its backing file. On
// a cancelled ctx it flushes what it copied and returns ctx's error.
func Stream(ctx context.Context, img formats.Image, o StreamOptions) error {
	s, ok := img.(Streamer)
	if !ok {
		return errors.New("only a qcow2 overlay can be streamed")
	}
	if s.Backing() == nil {
		return ErrNoBackingFile
	}
	// Said before anything is copied: the top layer would refuse to drop
	// its backing file at the end (its snapshots read from it too).
	if n := len(s.Info().Snapshots); n > 0 {
		return fmt.Errorf("the image has %d internal snapshots, which would lose what they read from the backing file: delete them first (qemu-img snapshot -d)", n)
	}
	if o.Parallel <= 0 {
		o.Parallel = 4
	}
	if o.Step <= 0 {
		o.Step = 1 << 20
	}
	if o.FlushEvery <= 0 {
		o.FlushEvery = 16 << 20
	}
	if o.FlushInterval <= 0 {
		o.FlushInterval = 5 * time.Second
	}
	var total int64
	if err := walkMissing(ctx, s, o.Base, func(off, n int64) error { total += n; return nil }); err != nil {
		return err
	}
	if o.Planned != nil {
		o.Planned(total)
	}

	type step struct{ off, n int64 }
	steps := make(chan step)
	var (
		wg        sync.WaitGroup
		mu        sync.Mutex // Progress, done, durable, firstErr
		done      int64      // bytes whose copy returned
		durable   int64      // of done, bytes counted before a flush that returned
		firstErr  error
		sinceSync atomic.Int64
		lastSync  atomic.Int64 // UnixNano
	)
	lastSync.Store(time.Now().UnixNano())
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	fail := func(err error) {
		mu.Lock()
		if firstErr == nil {
			firstErr = err
		}
		mu.Unlock()
		cancel()
	}
	for range o.Parallel {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for st := range steps {
				if _, err := s.Populate(wctx, st.off, st.n); err != nil {
					fail(fmt.Errorf("copy [%d, +%d) from the backing file: %w", st.off, st.n, err))
					continue
				}
				// Counted as done before any flush: a flush that begins
				// after this makes it durable, and durable (a mark of
				// done) can never run ahead of done in a report.
				mu.Lock()
				done += st.n
				mark := done
				mu.Unlock()
				now := time.Now().UnixNano()
				if sinceSync.Add(st.n) >= o.FlushEvery || now-lastSync.Load() >= int64(o.FlushInterval) {
					sinceSync.Store(0)
					lastSync.Store(now)
					// Other workers go on copying (and reporting) while
					// this flush runs: what it makes durable is what had
					// been copied when it began.
					if err := s.Flush(wctx); err != nil {
						fail(err)
						continue
					}
					mu.Lock()
					durable = max(durable, mark)
					mu.Unlock()
				}
				mu.Lock()
				if o.Progress != nil {
					o.Progress(st.off, st.n, done, durable, total)
				}
				mu.Unlock()
			}
		}()
	}
	werr := walkMissing(wctx, s, o.Base, func(off, n int64) error {
		// Steps at multiples of Step: a cluster at most is shared with
		// the neighbour, and the range lock orders those two.
		for end := off + n; off < end; {
			k := min(end-off, o.Step-off%o.Step)
			select {
			case steps <- step{off, k}:
			case <-wctx.Done():
				return wctx.Err()
			}
			off += k
		}
		return nil
	})
	close(steps)
	wg.Wait()
	// What was copied is made durable, whatever happened.
	ferr := s.Flush(context.WithoutCancel(ctx))
	switch {
	case ferr != nil && (firstErr != nil || ctx.Err() != nil || werr != nil):
		// Said first: the copies since the last flush are not durable,
		// whatever stopped the stream (a caller would otherwise report
		// an interruption as "copied and flushed").
		return fmt.Errorf("flush the copies: %w (the stream stopped on: %v)", ferr, cmp.Or(firstErr, ctx.Err(), werr))
	case firstErr != nil:
		return firstErr
	case ctx.Err() != nil:
		return ctx.Err()
	case werr != nil:
		return werr
	case ferr != nil:
		return ferr
	}
	// Nothing may be left below (nothing else writes the image: it is
	// locked), else dropping the backing file would lose it.
	var left int64
	if err := walkMissing(ctx, s, o.Base, func(off, n int64) error { left += n; return nil }); err != nil {
		return err
	}
	if left > 0 {
		return fmt.Errorf("stream: %d bytes still come from the backing file after the copy", left)
	}
	if o.KeepBacking || o.Base > 0 {
		return nil
	}
	return s.DropBacking(ctx)
}

// walkMissing calls fn for every run that the top layer does not allocate
// and some layer below does, above depth base when base is positive (the
// bytes to copy), neighbours merged.
func walkMissing(ctx context.Context, img formats.Image, base int, fn func(off, n int64) error) error {
	var runOff, runLen int64
	flush := func() error {
		if runLen == 0 {
			return nil
		}
		err := fn(runOff, runLen)
		runLen = 0
		return err
	}
	size := img.Size()
	for off := int64(0); off < size; {
		if err := ctx.Err(); err != nil {
			return err
		}
		e, err := img.Extent(ctx, off, size-off)
		if err != nil {
			return fmt.Errorf("block status at %d: %w", off, err)
		}
		if e.Length <= 0 {
			return fmt.Errorf("block status at %d: an empty extent", off)
		}
		if e.Depth > 0 && e.Present && (base <= 0 || e.Depth < base) {
			if runLen == 0 {
				runOff = off
			}
			runLen += e.Length
		} else if err := flush(); err != nil {
			return err
		}
		off += e.Length
	}
	return flush()
}
