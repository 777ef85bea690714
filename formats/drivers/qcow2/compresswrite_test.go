package qcow2

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"sync"
	"testing"

	"github.com/blockexport/blockexport/aio"
)

// Compressed clusters written from several goroutines at once, packed
// into shared host clusters, then overwritten (compressed again, as data,
// and zeroed) with flushes between, so that shared host clusters are
// freed and reused: QEMU reads every cluster as written and qemu-img
// check finds the refcounts exact, for zlib and zstd and small and large
// clusters.
func TestCompressedWrites(t *testing.T) {
	for _, c := range []struct {
		comp string
		cs   int64
	}{{"zlib", 512}, {"zlib", 65536}, {"zstd", 4096}, {"zstd", 2 << 20}} {
		t.Run(fmt.Sprintf("%s-%d", c.comp, c.cs), func(t *testing.T) {
			ctx := context.Background()
			img := filepath.Join(t.TempDir(), "c.qcow2")
			// Enough clusters that compressed ones share host clusters;
			// fewer of the 2 MiB ones, which pack just as well and whose
			// 96 MiB took 100 s under the race detector.
			n := int64(48)
			if c.cs > 64<<10 {
				n = 12
			}
			size := n*c.cs - 512 // a last cluster shorter than the others
			clusters := (size + c.cs - 1) / c.cs
			if err := Create(img, CreateOptions{Size: size, ClusterSize: c.cs, CompressionType: c.comp}); err != nil {
				t.Fatal(err)
			}
			q := openRW(t, img)
			mirror := make([]byte, size)
			src := rand.NewChaCha8([32]byte{byte(c.cs), byte(c.cs >> 8), byte(c.cs >> 16), 3})
			r := rand.New(src)
			for round := range 3 {
				var wg sync.WaitGroup
				errs := make(chan error, clusters)
				for vc := range clusters {
					p := mirror[vc*c.cs : min((vc+1)*c.cs, size)]
					switch k := r.IntN(5); {
					case k < 3 || round == 0: // compressible: a few letters
						src.Read(p)
						for i := range p {
							p[i] = 'a' + p[i]%byte(3+round)
						}
					case k == 3: // incompressible: written as data
						src.Read(p)
					default:
						clear(p)
					}
					data := bytes.Clone(p)
					wg.Add(1)
					go func() {
						defer wg.Done()
						comp, ok, err := q.CompressCluster(data)
						switch {
						case err != nil:
						case !ok:
							_, err = q.WriteAt(ctx, data, vc*c.cs)
						default:
							err = q.WriteCompressed(ctx, comp, vc*c.cs)
						}
						errs <- err
					}()
				}
				wg.Wait()
				close(errs)
				for err := range errs {
					if err != nil {
						t.Fatal(err)
					}
				}
				if err := q.Flush(ctx); err != nil {
					t.Fatal(err)
				}
				got := make([]byte, size)
				if _, err := q.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, mirror) {
					t.Fatalf("round %d: reads back wrong (%v)", round, err)
				}
			}
			if err := q.Close(); err != nil {
				t.Fatal(err)
			}
			checkClean(t, img)
			compareRaw(t, img, mirror)
		})
	}
}

// Refused: a write not at a cluster, past the end, or too large.
func TestCompressedWriteRefusals(t *testing.T) {
	img := filepath.Join(t.TempDir(), "c.qcow2")
	if err := Create(img, CreateOptions{Size: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	q := openRW(t, img)
	defer q.Close()
	ctx := context.Background()
	for _, c := range []struct {
		n   int
		off int64
	}{{10, 512}, {10, 1 << 20}, {10, -65536}, {0, 0}, {65536, 0}, {10, 1<<63 - 65536}} {
		if err := q.WriteCompressed(ctx, make([]byte, c.n), c.off); err == nil {
			t.Errorf("WriteCompressed(%d bytes at %d) succeeded", c.n, c.off)
		}
	}
	if _, _, err := q.CompressCluster(make([]byte, 65537)); err == nil {
		t.Error("CompressCluster of more than a cluster succeeded")
	}
	checkClean(t, img)
}

// Options.DecodedCacheSize (--decompressed-cache-size) bounds the cache
// of decompressed clusters: reading six compressed clusters leaves the
// last two held with a cache of two clusters' bytes, all six with the
// default (4 MiB), and the reads are right either way.
func TestDecodedCacheSize(t *testing.T) {
	ctx := context.Background()
	const cs = 4096
	img := filepath.Join(t.TempDir(), "c.qcow2")
	if err := Create(img, CreateOptions{Size: 6 * cs, ClusterSize: cs, CompressionType: "zlib"}); err != nil {
		t.Fatal(err)
	}
	q := openRW(t, img)
	mirror := make([]byte, 6*cs)
	for i := range mirror {
		mirror[i] = byte('a' + i/7%5)
	}
	for vc := int64(0); vc < 6; vc++ {
		comp, ok, err := q.CompressCluster(mirror[vc*cs : (vc+1)*cs])
		if err != nil || !ok {
			t.Fatalf("compress cluster %d: %v %v", vc, ok, err)
		}
		if err := q.WriteCompressed(ctx, comp, vc*cs); err != nil {
			t.Fatal(err)
		}
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ size, held int64 }{{2 * cs, 2}, {0, 6}, {1, 2}} {
		f, err := openTestFile(img, testOpts{Backend: aio.Threads})
		if err != nil {
			t.Fatal(err)
		}
		q, err := New(context.Background(), f, Options{DecodedCacheSize: c.size})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { q.Close() })
		got := make([]byte, len(mirror))
		for vc := int64(0); vc < 6; vc++ {
			if _, err := q.ReadAt(ctx, got[vc*cs:(vc+1)*cs], vc*cs); err != nil {
				t.Fatal(err)
			}
		}
		if !bytes.Equal(got, mirror) {
			t.Fatalf("DecodedCacheSize %d: reads back wrong", c.size)
		}
		if n := int64(q.dcache.Len()); n != c.held {
			t.Errorf("DecodedCacheSize %d: %d clusters held decompressed, want %d", c.size, n, c.held)
		}
	}
}
