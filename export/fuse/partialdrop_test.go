package fuse

import (
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// TestPartialDropUnderWayDoesNotStandInForTheWritesOwn: a drop under
// way that covers only part of a granule (a punch of [100, 200)) drops
// only the pages of its range, so a bypassing write elsewhere in that
// granule, which a READ had marked, must drop the granule itself rather
// than wait for the partial drop (whose page range misses the write's
// page). Fails if a partial drop cleared the granule's mark, or if the
// write took the overlapping drop for its own.
func TestPartialDropUnderWayDoesNotStandInForTheWritesOwn(t *testing.T) {
	e, _ := kcExport(t, 1<<20, Options{Writable: true})
	started, release, _ := heldDrop(e)
	buf := make([]byte, 4096)
	if _, st := readInto(e, &fuse.ReadIn{Offset: 8192, Size: 4096}, buf); st != fuse.OK {
		t.Fatal(st)
	}
	done := make(chan struct{})
	go func() { e.invalidate(100, 100); close(done) }()
	<-started
	n, st, ok, d := e.TryWrite(&fuse.WriteIn{Offset: 8192}, make([]byte, 4096))
	close(release)
	<-done
	if !ok || st != fuse.OK || n != 4096 {
		t.Fatalf("try write: %v %v %d", ok, st, n)
	}
	if !d.own || d.from != 0 || d.length != 64<<10 {
		t.Fatalf("a write into a marked granule under a partial drop: %+v, want its own drop of [0 +64K]", d)
	}
}
