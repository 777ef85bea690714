package fuse

import (
	"runtime"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/aio"
)

// Request buffers live in anonymous mappings of their own, not on Go's
// heap. A queue's loop holds a request buffer of 1 MiB past the headers
// (the kernel refuses a read(2) of /dev/fuse smaller than max_write) and
// an inline-read buffer of 1 MiB while it sleeps; on Go's heap a reused
// span is zeroed whole when allocated, so every idle export cost about
// 2 MiB of resident memory (200 exports in one daemon: 180 MB, measured,
// where qemu-storage-daemon holds 41 MB). A mapped page costs memory only
// once something is written to it: an idle export's buffers hold the few
// pages its requests wrote, and a busy one's the pages its large requests
// wrote, kept as before. A mapping goes back to the kernel when its
// handle becomes unreachable (runtime.AddCleanup), as a heap buffer would
// be freed.

// newMapped returns a handle to size bytes of page-aligned anonymous
// memory, unmapped once the handle is unreachable: whoever uses the bytes
// must keep the handle. Where the mapping fails it falls back to Go's heap.
func newMapped(size int) *[]byte {
	p, err := unix.MmapPtr(-1, 0, nil, uintptr(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		b := aio.AlignedBuf(size, 4096)
		return &b
	}
	b := unsafe.Slice((*byte)(p), size)
	h := &b
	runtime.AddCleanup(h, func(p unsafe.Pointer) { unix.MunmapPtr(p, uintptr(size)) }, p)
	return h
}

// mappedPool is aio.BufPool's pool of buffers of one size (page-aligned),
// each its own mapping (newMapped): those sync.Pool drops are unmapped.
type mappedPool struct {
	size int
	pool sync.Pool
}

func newMappedPool(size int) *mappedPool {
	p := &mappedPool{size: size}
	p.pool.New = func() any { return newMapped(size) }
	return p
}

// Size is the length of the pool's buffers.
func (p *mappedPool) Size() int { return p.size }

// Get returns a buffer of Size bytes; its content is undefined. The
// handle must be kept while the bytes are used (newMapped).
func (p *mappedPool) Get() *[]byte { return p.pool.Get().(*[]byte) }

// Put returns a buffer obtained from Get.
func (p *mappedPool) Put(b *[]byte) { p.pool.Put(b) }

// Buffer returns n bytes: pooled when n fits in Size, else a mapping of
// its own. Give the handle back with Release, and keep it until then.
func (p *mappedPool) Buffer(n int) ([]byte, *[]byte) {
	if n > p.size {
		h := newMapped(n)
		return *h, h
	}
	bp := p.Get()
	return (*bp)[:n], bp
}

// Release returns what Buffer handed out (one of another size is left to
// be unmapped when unreachable).
func (p *mappedPool) Release(bp *[]byte) {
	if bp != nil && len(*bp) == p.size {
		p.pool.Put(bp)
	}
}

// bufferPool is what a request's buffer comes from: the small pool
// (aio.BufPool, on the heap) or the large one (mappedPool).
type bufferPool interface {
	Buffer(n int) ([]byte, *[]byte)
	Release(bp *[]byte)
}
