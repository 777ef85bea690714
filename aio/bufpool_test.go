package aio

import (
	"testing"
	"unsafe"
)

func TestBufPoolAlignment(t *testing.T) {
	p := NewBufPool(8192, 4096)
	for i := 0; i < 10; i++ {
		b := p.Get()
		if len(*b) != 8192 || uintptr(unsafe.Pointer(&(*b)[0]))%4096 != 0 {
			t.Fatalf("buffer len %d at %p", len(*b), &(*b)[0])
		}
		p.Put(b)
	}
	if b := AlignedBuf(100, 3); len(b) != 100 || uintptr(unsafe.Pointer(&b[0]))%4 != 0 {
		t.Fatal("non-power-of-two alignment not rounded up")
	}
	for _, n := range []int{512, 4096, 8192, 12288, 65536, 1 << 20, 4096 + 512} {
		for _, a := range []int{512, 4096} {
			if b := AlignedBuf(n, a); len(b) != n || cap(b) != n || uintptr(unsafe.Pointer(&b[0]))%uintptr(a) != 0 {
				t.Fatalf("AlignedBuf(%d, %d): len %d cap %d at %p", n, a, len(b), cap(b), &b[0])
			}
		}
	}
}

// Buffer hands out pooled buffers up to Size and fresh ones beyond, all
// aligned and of the length asked; Release takes either back.
func TestBufPoolBuffer(t *testing.T) {
	p := NewBufPool(8192, 4096)
	for _, n := range []int{1, 8192, 8193, 1 << 20} {
		b, bp := p.Buffer(n)
		if len(b) != n || uintptr(unsafe.Pointer(&b[0]))%4096 != 0 {
			t.Fatalf("Buffer(%d): len %d, address %p", n, len(b), &b[0])
		}
		if pooled := bp != nil; pooled != (n <= p.Size()) {
			t.Fatalf("Buffer(%d): pooled %v", n, pooled)
		}
		p.Release(bp)
	}
}
