package kernelcache

import (
	"bytes"
	"context"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/aio"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestKernelCacheBufferedReadSeesDirectWriteRacingIt: O_DIRECT writes through io_uring
// (asynchronous direct I/O, which the kernel does not follow with an
// invalidation of its own) while other threads read the same blocks
// buffered, over and over, so that READs of the old bytes land between
// the kernel's drop before the write and the write itself. Once a write
// returns, a buffered read must see it. --cache none: the export's host
// I/O is then O_DIRECT too, so neither the READs nor the WRITEs finish in
// the serve loop, and a READ of the old bytes overtakes the write often.
//
// What it caught: with no notify after such writes, a stale read within
// a few dozen writes; with the notify sent from whatever thread the Go
// runtime had free, a hang (the notify waited for a READ's page, and that
// READ's io_uring completion waited for the notifying thread to leave the
// kernel; see kernelCalls). The export drops the kernel's pages after a
// bypassing write only where a READ may have cached them (readMarks): a
// miss of that bookkeeping shows as a stale read.
func TestKernelCacheBufferedReadSeesDirectWriteRacingIt(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "img")
	harness.CreateImage(t, "-f", "raw", img, "4M")
	mnt := filepath.Join(dir, "mnt")
	harness.StartCached(t, img, mnt, "-f", "raw", "--cache", "none")
	// Two writers on alternate blocks, so that one's write lands in a
	// granule while the other's drop of it is still under way (a write
	// that took the other's cleared mark as "nothing cached here" replied
	// while its page still held the old bytes; found in review).
	harness.GuardAgainstHang(t, mnt, func() {
		var wg sync.WaitGroup
		for wr := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				raceDirectWritesAndReads(t, mnt, wr, 2)
			}()
		}
		wg.Wait()
	})
}

// raceDirectWritesAndReads is writer wr of writers: it writes every
// writers-th block from wr on, with two buffered readers of its own.
func raceDirectWritesAndReads(t *testing.T, mnt string, wr, writers int) {
	w, err := aio.Open(mnt, aio.Options{Backend: aio.IOUring, Writable: true, Direct: true})
	if err != nil {
		t.Error(err)
		return
	}
	defer w.Close()
	const blocks = 32
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var reads atomic.Int64
	stopReaders := sync.OnceFunc(func() { close(stop); wg.Wait() })
	defer stopReaders()
	for r := range 2 {
		fd, err := unix.Open(mnt, unix.O_RDONLY, 0)
		if err != nil {
			t.Error(err)
			return
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer unix.Close(fd)
			b := make([]byte, blocks*4096)
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				off := int64((i+r)%4) * int64(len(b)) / 4
				unix.Pread(fd, b[:len(b)/4], off)
				reads.Add(1)
			}
		}()
	}
	check, err := unix.Open(mnt, unix.O_RDONLY, 0)
	if err != nil {
		t.Error(err)
		return
	}
	defer unix.Close(check)
	buf := harness.AlignedBuf(4096)
	got := make([]byte, 4096)
	ctx := context.Background()
	stale := 0
	// At least 4 s, minWrites writes and as many racing reads: a slow or
	// loaded machine (CI's did 996 writes in 4 s) runs longer rather than
	// failing the floor below; the hard limit keeps a stalled export from
	// running forever.
	const minWrites = 1500
	start := time.Now()
	deadline, hardDeadline := start.Add(4*time.Second), start.Add(40*time.Second)
	n := 0
	for ; (time.Now().Before(deadline) || n < minWrites || reads.Load() < minWrites) && time.Now().Before(hardDeadline) && stale < 5; n++ {
		blk := int64(n%(blocks/writers)*writers + wr)
		v := byte(n%251 + 1)
		for i := range buf {
			buf[i] = v
		}
		if _, err := w.WriteAt(ctx, buf, blk*4096); err != nil {
			t.Errorf("O_DIRECT write %d: %v", n, err)
			return
		}
		if _, err := unix.Pread(check, got, blk*4096); err != nil {
			t.Error(err)
			return
		}
		if !bytes.Equal(got, buf) {
			stale++
			t.Errorf("write %d (block %d, byte %#x) returned, then a buffered read got %#x...: stale", n, blk, v, got[:4])
		}
	}
	stopReaders()
	t.Logf("%d O_DIRECT writes in %v, %d buffered reads racing them, %d stale", n, time.Since(start).Round(time.Millisecond), reads.Load(), stale)
	if n < 1000 || reads.Load() < 1000 {
		t.Errorf("too few operations to race: %d writes, %d reads", n, reads.Load())
		return
	}
}
