package qcow2

import (
	"bytes"
	"context"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestFreedClustersArePunchedAndTheirNeighboursKept: clusters freed out
// of order, in runs and alone, are punched out of the host file (its
// allocation drops by all of them) in neighbouring runs, and no punch
// reaches a cluster still in use.
func TestFreedClustersArePunchedAndTheirNeighboursKept(t *testing.T) {
	ctx := context.Background()
	img := filepath.Join(t.TempDir(), "img.qcow2")
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", img, "1M").CombinedOutput(); err != nil {
		t.Fatalf("qemu-img create: %v\n%s", err, out)
	}
	q := openRW(t, img)
	closed := false
	t.Cleanup(func() {
		if !closed {
			q.Close()
		}
	})
	cs := q.h.clusterSize
	const clusters = 16
	mirror := make([]byte, clusters*cs)
	// Written in order, the clusters lie in order in the host file.
	for c := range int64(clusters) {
		p := mirror[c*cs : (c+1)*cs]
		for i := range p {
			p[i] = byte(c + 1)
		}
		if _, err := q.WriteAt(ctx, p, c*cs); err != nil {
			t.Fatal(err)
		}
	}
	if err := q.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	before, err := q.AllocatedSize(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Runs of three, one and two clusters, freed out of order; the
	// first and last clusters and those between the runs stay.
	freed := []int64{9, 3, 7, 2, 10, 4}
	for _, c := range freed {
		if err := q.Unallocate(ctx, c*cs, cs); err != nil {
			t.Fatal(err)
		}
		clear(mirror[c*cs : (c+1)*cs])
	}
	if err := q.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	after, err := q.AllocatedSize(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Less a block or so that the metadata written meanwhile may take.
	if drop := before - after; drop <= int64(len(freed)-1)*cs {
		t.Errorf("the host file's allocation dropped by %d bytes, want about the %d freed", drop, int64(len(freed))*cs)
	}
	got := make([]byte, len(mirror))
	if _, err := q.ReadAt(ctx, got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, mirror) {
		i := firstDiff(got, mirror)
		t.Fatalf("reads differ from what was written at byte %d (cluster %d)", i, int64(i)/cs)
	}
	closed = true
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	checkClean(t, img)
	compareRaw(t, img, mirror)
}
