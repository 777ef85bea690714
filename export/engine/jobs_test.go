package engine

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/blockexport/blockexport/formats/registry"
)

// TestCloseStopsARunningStreamAndKeepsTheBackingFile closes the engine
// (quit) while a stream held to one byte a second runs: Close must
// wait for the stream's work without deadlocking on the engine's lock,
// and the overlay must still stand on its backing file, reading its
// bytes. The job's verbs on it answer in QEMU's words meanwhile.
func TestCloseStopsARunningStreamAndKeepsTheBackingFile(t *testing.T) {
	dir := t.TempDir()
	base, top := filepath.Join(dir, "base.raw"), filepath.Join(dir, "top.qcow2")
	data := bytes.Repeat([]byte{0x5a}, 4<<20)
	if err := os.WriteFile(base, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := registry.Create(top, registry.QCOW2, registry.CreateOptions{Size: 4 << 20, BackingFile: "base.raw", BackingFormat: "raw"}); err != nil {
		t.Fatal(err)
	}
	var (
		mu     sync.Mutex
		events []string
	)
	e := New(Options{Backend: "threads", Event: func(name string, d any) {
		b, _ := json.Marshal(d)
		mu.Lock()
		defer mu.Unlock()
		events = append(events, name+" "+string(b))
	}})
	if err := e.AddNode(BlockdevOptions{Driver: "qcow2", NodeName: "top", File: &BlockdevRef{Inline: &BlockdevOptions{Driver: "file", Filename: top}}}); err != nil {
		t.Fatal(err)
	}
	if err := e.Stream(JobOptions{ID: "s", Device: "top", AutoFinalize: true, AutoDismiss: true, Speed: 1}, "", "", ""); err != nil {
		t.Fatal(err)
	}
	wantDesc(t, "a second stream", e.Stream(JobOptions{ID: "t", Device: "top"}, "", "", ""), "Node 'top' is busy: block device is in use by block job: stream")
	if err := e.AddNode(BlockdevOptions{Driver: "null-co", NodeName: "n"}); err != nil {
		t.Fatal(err)
	}
	wantDesc(t, "a duplicate job id", e.Stream(JobOptions{ID: "s", Device: "n"}, "", "", ""), "Job ID 's' already in use")
	wantDesc(t, "dismissing a running job", e.JobVerb("s", "dismiss"), "Job 's' in state 'running' cannot accept command verb 'dismiss'")
	wantDesc(t, "an unknown job", e.JobVerb("x", "cancel"), "Job not found")
	wantDesc(t, "deleting its node", e.DelNode("top"), "Node 'top' is busy: block device is in use by block job: stream")
	if jobs := e.Jobs(); len(jobs) != 1 || jobs[0].Status != "running" || jobs[0].Type != "stream" || jobs[0].TotalProgress != 4<<20 {
		t.Fatalf("query-jobs: %+v", jobs)
	}
	closed := make(chan error, 1)
	go func() { closed <- e.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return while a stream ran")
	}
	mu.Lock()
	got := slices.Clone(events)
	mu.Unlock()
	if len(got) < 2 || got[0] != `JOB_STATUS_CHANGE {"status":"created","id":"s"}` || got[1] != `JOB_STATUS_CHANGE {"status":"running","id":"s"}` {
		t.Fatalf("events: %v", got)
	}
	o, err := registry.Open(top, registry.Options{Format: registry.QCOW2})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Image.Close()
	if o.Image.Info().BackingFilename != "base.raw" {
		t.Fatalf("after a stopped stream the backing file is %q, want base.raw", o.Image.Info().BackingFilename)
	}
	buf := make([]byte, len(data))
	if _, err := o.Image.ReadAt(t.Context(), buf, 0); err != nil || !bytes.Equal(buf, data) {
		t.Fatalf("the overlay reads other bytes after a stopped stream: %v", err)
	}
}
