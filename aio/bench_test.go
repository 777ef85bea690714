package aio

import (
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
)

// BenchmarkRandRead4K: 4 KiB random reads, 16 in flight (16 goroutines), on
// a 256 MiB file, for each engine with the page cache (warm) and O_DIRECT.
// Results: docs/design.md, The aio engines.
func BenchmarkRandRead4K(b *testing.B) {
	const size = 256 << 20
	path := filepath.Join(b.TempDir(), "bench")
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	chunk := make([]byte, 1<<20)
	for i := range chunk {
		chunk[i] = byte(i)
	}
	for off := int64(0); off < size; off += int64(len(chunk)) {
		f.WriteAt(chunk, off)
	}
	f.Close()
	for _, direct := range []bool{false, true} {
		for _, backend := range []Backend{IOUring, Threads} {
			name := string(backend) + "/pagecache"
			if direct {
				name = string(backend) + "/direct"
			}
			b.Run(name, func(b *testing.B) {
				af, err := Open(path, Options{Backend: backend, Direct: direct})
				if err != nil {
					b.Fatal(err)
				}
				defer af.Close()
				var next atomic.Int64
				var wg sync.WaitGroup
				b.ResetTimer()
				for g := 0; g < 16; g++ {
					wg.Add(1)
					go func(g int) {
						defer wg.Done()
						r := rand.New(rand.NewPCG(uint64(g), 2))
						buf := alignedBuf(4096, 4096)
						for next.Add(1) <= int64(b.N) {
							off := r.Int64N(size/4096) * 4096
							if _, err := af.ReadAt(context.Background(), buf, off); err != nil {
								b.Error(err)
								return
							}
						}
					}(g)
				}
				wg.Wait()
			})
		}
	}
}
