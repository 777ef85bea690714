package aio

import (
	"sync"
	"unsafe"
)

// BufPool hands out buffers of one size whose first byte is aligned to
// Align (a power of two), as O_DIRECT I/O needs. Buffers are reused across
// requests, so steady-state I/O does not allocate.
type BufPool struct {
	size, align int
	pool        sync.Pool
}

// NewBufPool makes a pool of size-byte buffers aligned to align.
func NewBufPool(size, align int) *BufPool {
	align = pow2(align)
	p := &BufPool{size: size, align: align}
	p.pool.New = func() any {
		b := AlignedBuf(size, align)
		return &b
	}
	return p
}

// Size is the length of the pool's buffers.
func (p *BufPool) Size() int { return p.size }

// Get returns a buffer of Size bytes; its content is undefined.
func (p *BufPool) Get() *[]byte { return p.pool.Get().(*[]byte) }

// Put returns a buffer obtained from Get.
func (p *BufPool) Put(b *[]byte) { p.pool.Put(b) }

// Buffer returns n bytes, aligned: pooled when n fits in Size, else freshly
// allocated. Give the handle back with Release (nil for a fresh buffer; a
// handle rather than a closure, so that taking a buffer allocates nothing).
func (p *BufPool) Buffer(n int) ([]byte, *[]byte) {
	if n > p.size {
		return AlignedBuf(n, p.align), nil
	}
	bp := p.Get()
	return (*bp)[:n], bp
}

// Release returns what Buffer handed out.
func (p *BufPool) Release(bp *[]byte) {
	if bp != nil {
		p.pool.Put(bp)
	}
}

// AlignedBuf allocates size bytes whose first byte is aligned to align
// (rounded up to a power of two).
func AlignedBuf(size, align int) []byte {
	align = pow2(align)
	if size > 0 && size%align == 0 {
		// Go's allocator places objects of a page-multiple size class,
		// and large ones, on page boundaries: try without the padding
		// first (a 4 KiB payload then costs 4 KiB, not 8).
		if b := make([]byte, size); uintptr(unsafe.Pointer(&b[0]))&uintptr(align-1) == 0 {
			return b
		}
	}
	b := make([]byte, size+align)
	skip := (align - int(uintptr(unsafe.Pointer(&b[0]))&uintptr(align-1))) & (align - 1)
	return b[skip : skip+size : skip+size]
}

// pow2 rounds n up to a power of two, at least 1.
func pow2(n int) int {
	p := 1
	for p < n {
		p <<= 1
	}
	return p
}
