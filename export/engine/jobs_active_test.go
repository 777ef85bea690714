package engine

import (
	"bytes"
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/blockexport/blockexport/formats/registry"
)

// TestActiveCommitCopiesWritesMadeWhileItRuns writes through a node's
// image all along an active commit of it into its raw backing file, from
// before the job starts until job-complete: afterwards the node is the
// base, reads what was last written everywhere, and so does the base
// file. Run under -race, it also checks the image swap under requests.
func TestActiveCommitCopiesWritesMadeWhileItRuns(t *testing.T) {
	const size = 8 << 20
	dir := t.TempDir()
	base, top := filepath.Join(dir, "base.raw"), filepath.Join(dir, "top.qcow2")
	want := bytes.Repeat([]byte{0x5a}, size)
	if err := os.WriteFile(base, want, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := registry.Create(top, registry.QCOW2, registry.CreateOptions{Size: size, BackingFile: "base.raw", BackingFormat: "raw"}); err != nil {
		t.Fatal(err)
	}
	e := New(Options{Backend: "threads", Event: func(string, any) {}})
	t.Cleanup(func() { e.Close() })
	if err := e.AddNode(BlockdevOptions{Driver: "qcow2", NodeName: "top", File: &BlockdevRef{Inline: &BlockdevOptions{Driver: "file", Filename: top}}}); err != nil {
		t.Fatal(err)
	}
	e.mu.Lock()
	img := e.node("top").img
	e.mu.Unlock()

	var (
		mu   sync.Mutex // want
		stop = make(chan struct{})
		wg   sync.WaitGroup
	)
	for w := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 1))
			buf := make([]byte, 4096)
			for {
				select {
				case <-stop:
					return
				default:
				}
				off := r.Int64N(size/4096) * 4096
				mu.Lock() // one writer of a block at a time, so want is what landed
				for i := range buf {
					buf[i] = byte(r.Uint32())
				}
				if _, err := img.WriteAt(context.Background(), buf, off); err != nil {
					mu.Unlock()
					t.Errorf("write at %d: %v", off, err)
					return
				}
				copy(want[off:], buf)
				mu.Unlock()
			}
		}()
	}
	waitStatus := func(status string) {
		t.Helper()
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			jobs := e.Jobs()
			if status == "" && len(jobs) == 0 || len(jobs) == 1 && jobs[0].Status == status {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("the job did not reach %q: %+v", status, jobs)
			}
		}
	}
	time.Sleep(20 * time.Millisecond)
	if err := e.Commit(JobOptions{ID: "c", Device: "top", AutoFinalize: true, AutoDismiss: true}, "", "", "", ""); err != nil {
		t.Fatal(err)
	}
	waitStatus("ready")
	time.Sleep(100 * time.Millisecond) // writes while ready
	if err := e.JobVerb("c", "complete"); err != nil {
		t.Fatal(err)
	}
	waitStatus("")
	time.Sleep(20 * time.Millisecond) // writes into the base, through the same image
	close(stop)
	wg.Wait()
	if err := img.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, size)
	if _, err := img.ReadAt(context.Background(), got, 0); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("the node reads other bytes after the commit (%v)", err)
	}
	if info := img.Info(); info.Format != "raw" {
		t.Fatalf("the node's image after the pivot is %s %s, want the raw base", info.Format, info.Filename)
	}
	onDisk, err := os.ReadFile(base)
	if err != nil || !bytes.Equal(onDisk, want) {
		t.Fatalf("the base file holds other bytes after the commit (%v)", err)
	}
}
