package fuse

import (
	"runtime"
	"testing"
	"unsafe"
)

// TestMappedBuffersArePageAlignedAndReused checks what the queues rely
// on: a pooled request buffer is page-aligned (a WRITE's payload at
// reqPad lands on a page boundary), holds what is written to it, and a
// request larger than the pool's buffers gets a mapping of its own that
// is not put back into the pool.
func TestMappedBuffersArePageAlignedAndReused(t *testing.T) {
	p := newMappedPool(reqPad + bufSize)
	bp := p.Get()
	b := *bp
	if len(b) != reqPad+bufSize {
		t.Fatalf("buffer of %d bytes, want %d", len(b), reqPad+bufSize)
	}
	if a := uintptr(unsafe.Pointer(&b[0])) % 4096; a != 0 {
		t.Fatalf("buffer starts %d bytes past a page boundary", a)
	}
	b[0], b[len(b)-1] = 1, 2
	if b[0] != 1 || b[len(b)-1] != 2 {
		t.Fatal("the buffer did not keep what was written to it")
	}
	p.Put(bp)

	big, h := p.Buffer(p.Size() + 4096)
	if len(big) != p.Size()+4096 || h == nil {
		t.Fatalf("a large buffer: %d bytes, handle %v", len(big), h)
	}
	big[len(big)-1] = 3
	p.Release(h) // not pooled: a Get must still return the pool's size
	if g := p.Get(); len(*g) != p.Size() {
		t.Fatalf("Get after releasing a large buffer: %d bytes, want %d", len(*g), p.Size())
	}
	// Dropped buffers are unmapped by their cleanups; a GC must not
	// disturb one still held.
	held := newMapped(8192)
	(*held)[8191] = 7
	runtime.GC()
	runtime.GC()
	if (*held)[8191] != 7 {
		t.Fatal("a held mapping lost its contents across a GC")
	}
}
