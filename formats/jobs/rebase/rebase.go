// Package rebase is qemu-img rebase's safe mode: the clusters where an
// image's old backing chain and its new one read differently are copied
// into the image (from the old chain, so that it reads the same), before
// its header names the new backing file.
package rebase

import (
	"bytes"
	"context"
	"fmt"
	"sync"

	"github.com/blockexport/blockexport/formats"
)

// Options say how to copy.
type Options struct {
	// Parallel is the number of chunks compared and copied at once
	// (default 8).
	Parallel int
	// Step is the bytes of one chunk (default 2 MiB, qemu-img's buffer).
	Step int64
	// Granularity is the unit compared and written (the image's cluster
	// size; default 64 KiB): a differing unit is written whole.
	Granularity int64
	// SharedDepth, when positive, is the depth in the image's old chain of
	// the new backing file itself (rebasing onto a layer further down):
	// what the old chain answers from there or below reads the same over
	// the new backing file and is neither read nor compared, as qemu-img
	// skips what is not allocated above it.
	SharedDepth int
	// Progress, when set, hears the bytes of the image walked so far and
	// its size (qemu-img rebase -p counts the whole image). Called from
	// one goroutine at a time.
	Progress func(done, total int64)
}

// Copy makes img, opened writable over its old backing chain, read the
// same over newBacking (nil: no backing file, zeroes) by copying into it
// every unit it does not allocate itself where the two differ. It
// flushes what it wrote, also when ctx is cancelled (then it returns
// ctx's error); the header is the caller's to change afterwards.
func Copy(ctx context.Context, img, newBacking formats.Image, o Options) (copied int64, err error) {
	if o.Parallel <= 0 {
		o.Parallel = 8
	}
	if o.Granularity <= 0 {
		o.Granularity = 64 << 10
	}
	if o.Step <= 0 {
		o.Step = 2 << 20
	}
	o.Step = max(o.Step/o.Granularity, 1) * o.Granularity
	size := img.Size()

	type chunk struct {
		off, n  int64
		oldZero bool // the old chain reads zeroes here
	}
	chunks := make(chan chunk)
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		firstErr error
		done     int64
	)
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
	report := func(n, c int64) {
		mu.Lock()
		done += n
		copied += c
		if o.Progress != nil {
			o.Progress(done, size)
		}
		mu.Unlock()
	}
	for range o.Parallel {
		wg.Add(1)
		go func() {
			defer wg.Done()
			oldBuf := make([]byte, o.Step)
			newBuf := make([]byte, o.Step)
			for c := range chunks {
				n, err := copyChunk(wctx, img, newBacking, c.off, c.n, c.oldZero, oldBuf[:c.n], newBuf[:c.n], o.Granularity)
				if err != nil {
					fail(fmt.Errorf("rebase [%d, +%d): %w", c.off, c.n, err))
					continue
				}
				report(0, n)
			}
		}()
	}
	werr := func() error {
		for off := int64(0); off < size; {
			if err := wctx.Err(); err != nil {
				return err
			}
			e, err := img.Extent(wctx, off, size-off)
			if err != nil {
				return fmt.Errorf("block status at %d: %w", off, err)
			}
			if e.Length <= 0 {
				return fmt.Errorf("block status at %d: an empty extent", off)
			}
			if e.Depth == 0 && e.Present || o.SharedDepth > 0 && e.Depth >= o.SharedDepth {
				// The image's own (it reads the same over any backing
				// file), or the new backing file's own chain.
				report(e.Length, 0)
				off += e.Length
				continue
			}
			oldZero := !e.Present || e.Zero
			for end := off + e.Length; off < end; {
				k := min(end-off, o.Step-off%o.Step)
				select {
				case chunks <- chunk{off, k, oldZero}:
				case <-wctx.Done():
					return wctx.Err()
				}
				report(k, 0)
				off += k
			}
		}
		return nil
	}()
	close(chunks)
	wg.Wait()
	ferr := img.Flush(context.WithoutCancel(ctx))
	switch {
	case firstErr != nil:
		return copied, firstErr
	case ctx.Err() != nil:
		return copied, ctx.Err()
	case werr != nil:
		return copied, werr
	case ferr != nil:
		return copied, fmt.Errorf("flush: %w", ferr)
	}
	return copied, nil
}

// copyChunk compares [off, off+n) of img's old chain (zeroes when
// oldZero) with newBacking and writes the differing units of the old
// content into img. It returns the bytes written.
func copyChunk(ctx context.Context, img, newBacking formats.Image, off, n int64, oldZero bool, oldBuf, newBuf []byte, gran int64) (int64, error) {
	newZero, err := zeroKnown(ctx, newBacking, off, n)
	if err != nil {
		return 0, err
	}
	if oldZero && newZero {
		return 0, nil
	}
	if oldZero {
		clear(oldBuf)
	} else if _, err := img.ReadAt(ctx, oldBuf, off); err != nil {
		return 0, fmt.Errorf("read the old backing chain: %w", err)
	}
	if newZero {
		clear(newBuf)
	} else if err := readClipped(ctx, newBacking, newBuf, off); err != nil {
		return 0, fmt.Errorf("read the new backing file: %w", err)
	}
	var written int64
	// Runs of differing units, each written in one request.
	for i := int64(0); i < n; {
		j := i
		for j < n {
			k := min(j+gran-(off+j)%gran, n)
			if bytes.Equal(oldBuf[j:k], newBuf[j:k]) {
				break
			}
			j = k
		}
		if j > i {
			if err := write(ctx, img, oldBuf[i:j], off+i); err != nil {
				return written, err
			}
			written += j - i
			i = j
			continue
		}
		i = min(i+gran-(off+i)%gran, n)
	}
	return written, nil
}

// write writes p at off, as zeroes kept allocated when it is all zeroes.
func write(ctx context.Context, img formats.Image, p []byte, off int64) error {
	if isZero(p) {
		if err := img.WriteZeroes(ctx, off, int64(len(p)), false); err != nil {
			return fmt.Errorf("write zeroes [%d, +%d): %w", off, len(p), err)
		}
		return nil
	}
	if _, err := img.WriteAt(ctx, p, off); err != nil {
		return fmt.Errorf("write [%d, +%d): %w", off, len(p), err)
	}
	return nil
}

// zeroKnown says whether [off, off+n) of img (nil: no image) is known to
// read as zeroes by its block status; what lies past its end reads as
// zeroes, as a backing file shorter than its overlay does.
func zeroKnown(ctx context.Context, img formats.Image, off, n int64) (bool, error) {
	if img == nil {
		return true, nil
	}
	end := min(off+n, img.Size())
	for off < end {
		e, err := img.Extent(ctx, off, end-off)
		if err != nil {
			return false, fmt.Errorf("block status of the new backing file at %d: %w", off, err)
		}
		if e.Length <= 0 {
			return false, fmt.Errorf("block status of the new backing file at %d: an empty extent", off)
		}
		if e.Present && !e.Zero {
			return false, nil
		}
		off += e.Length
	}
	return true, nil
}

// readClipped fills p from off of img, zeroes past its end.
func readClipped(ctx context.Context, img formats.Image, p []byte, off int64) error {
	size := img.Size()
	k := max(0, min(int64(len(p)), size-off))
	if k > 0 {
		if _, err := img.ReadAt(ctx, p[:k], off); err != nil {
			return err
		}
	}
	clear(p[k:])
	return nil
}

func isZero(p []byte) bool {
	for len(p) >= 8 {
		if p[0]|p[1]|p[2]|p[3]|p[4]|p[5]|p[6]|p[7] != 0 {
			return false
		}
		p = p[8:]
	}
	for _, b := range p {
		if b != 0 {
			return false
		}
	}
	return true
}
