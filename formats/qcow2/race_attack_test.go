package qcow2

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// waitBlockedIn waits until some goroutine's stack shows it blocked (in
// a channel receive or select) inside fn: a request caught at a lock.
func waitBlockedIn(t *testing.T, fn string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	buf := make([]byte, 1<<20)
	for time.Now().Before(deadline) {
		n := runtime.Stack(buf, true)
		for _, g := range strings.Split(string(buf[:n]), "\n\n") {
			if (strings.Contains(g, "[select") || strings.Contains(g, "[chan receive")) && strings.Contains(g, fn) {
				return
			}
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatalf("no goroutine blocked in %s", fn)
}

// TestZeroingTheLastClusterKeepsWritesPastTheOldEnd: a discard or
// write-zeroes that reaches the image end takes the last, partial cluster
// whole (its part past the end reads as zeroes anyway). If the image
// grows before the request changes that cluster (it waits for the range
// lock), and a writer then writes into the cluster's part past the old
// end, which the grow made part of the image, the request must not wipe
// that write: it covered only bytes before the old end. (Found by
// reading the code for this attack; the write read back as zeroes, or
// as the backing file, before the fix.)
func TestZeroingTheLastClusterKeepsWritesPastTheOldEnd(t *testing.T) {
	const cs = 65536
	for _, compat := range []string{"0.10", "1.1"} {
		for _, backing := range []bool{false, true} {
			for _, op := range []string{"discard", "zeroes-unmap", "zeroes-keep"} {
				if compat == "0.10" && op != "discard" && (backing || op == "zeroes-keep") {
					continue // no zero flag: zero bytes are written, up to the request's end
				}
				t.Run(fmt.Sprintf("compat=%s/backing=%t/%s", compat, backing, op), func(t *testing.T) {
					zeroLastClusterRacingGrow(t, compat, backing, op)
				})
			}
		}
	}
}

func zeroLastClusterRacingGrow(t *testing.T, compat string, backing bool, op string) {
	const cs = 65536
	ctx := context.Background()
	dir := t.TempDir()
	img := filepath.Join(dir, "t.qcow2")
	args := []string{"create", "-q", "-f", "qcow2", "-o", "cluster_size=65536,compat=" + compat}
	if backing {
		// Longer than the image: the grow zeroes the new part.
		base := filepath.Join(dir, "base.raw")
		data := make([]byte, 4*cs)
		fill(rand.New(rand.NewPCG(3, 3)), data)
		if err := os.WriteFile(base, data, 0o644); err != nil {
			t.Fatal(err)
		}
		args = append(args, "-b", base, "-F", "raw")
	}
	tool(t, "qemu-img", append(args, img, "96K")...)
	q := openRW(t, img)
	mirror := bytes.Repeat([]byte{0xaa}, 2*cs)
	if _, err := q.WriteAt(ctx, mirror[:cs+cs/2], 0); err != nil {
		t.Fatal(err)
	}
	// Hold the last cluster, so that the request waits after deciding
	// to take it whole.
	unlock, err := q.w.clusters.Lock(ctx, cs, cs)
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() {
		switch op {
		case "discard":
			errc <- q.Discard(ctx, cs, cs/2)
		default:
			errc <- q.WriteZeroes(ctx, cs, cs/2, op == "zeroes-unmap")
		}
	}()
	waitBlockedIn(t, "(*Image).setClusters")
	if err := q.Resize(ctx, 2*cs); err != nil {
		unlock()
		t.Fatal(err)
	}
	// As a writer that found the image long enough.
	want := bytes.Repeat([]byte{0x5c}, cs/2)
	if _, err := q.WriteAt(ctx, want, cs+cs/2); err != nil {
		unlock()
		t.Fatal(err)
	}
	unlock()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	// Zeroed; a discard's cluster is no longer whole once the image
	// grew, and keeps its data.
	if op != "discard" {
		clear(mirror[cs : cs+cs/2])
	}
	copy(mirror[cs+cs/2:], want)
	got := readAll(t, q)
	if !bytes.Equal(got[cs+cs/2:], want) {
		t.Fatalf("a write past the old end, made once the image had grown, reads back as %#x... (the %s of the old last cluster wiped it)", got[cs+cs/2:cs+cs/2+8], op)
	}
	if !bytes.Equal(got, mirror) {
		t.Fatalf("byte %d differs", firstDiff(got, mirror))
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	checkClean(t, img)
	compareRaw(t, img, mirror)
}
