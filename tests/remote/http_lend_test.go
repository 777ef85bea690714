package remote

// Review of aad3184 (a READ of a remote raw object answered from its
// cache blocks in place, one writev of the lent slices): through the
// FUSE export, against an HTTP server in this process.

import (
	"bytes"
	"fmt"
	"math/rand"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// lendingServer serves data as an object with ETag "v1" and ranges; lie, when
// it says so, answers a request itself instead.
func lendingServer(t *testing.T, data []byte, lie func(w http.ResponseWriter, r *http.Request) bool) string {
	t.Helper()
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if lie != nil && lie(w, r) {
			return
		}
		w.Header().Set("ETag", `"v1"`)
		http.ServeContent(w, r, "disk.img", time.Time{}, bytes.NewReader(data))
	})}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	return "http://" + l.Addr().String() + "/disk.img"
}

// requestRange is a request's Range, ok false without one.
func requestRange(r *http.Request) (lo, hi int64, ok bool) {
	if _, err := fmt.Sscanf(r.Header.Get("Range"), "bytes=%d-%d", &lo, &hi); err != nil {
		return 0, 0, false
	}
	return lo, hi, true
}

// TestHTTPLentReadsMatchTheObject: sixteen readers of an export of a
// 6 MiB + 1234 object through the least cache (1M: 64 blocks of 16 KiB)
// read at random offsets and sizes up to 1 MiB (a MiB at qd16 is a
// quarter of the cache each: lent blocks are evicted under every loan),
// reads across the end (short), at and past it (empty), and of nothing.
// Every byte must be the object's.
func TestHTTPLentReadsMatchTheObject(t *testing.T) {
	const size = 6<<20 + 1234
	data := make([]byte, size)
	rand.New(rand.NewSource(41)).Read(data)
	url := lendingServer(t, data, nil)
	mnt := filepath.Join(t.TempDir(), "mnt")
	d := harness.StartExport(t, url, mnt, "-f", "raw", "--cache-size", "1M", "--kernel-cache", "off")
	harness.MustEqualBytes(t, "the object read whole", harness.ReadAll(t, mnt), data)

	f, err := os.Open(mnt)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fd := int(f.Fd())
	var wg sync.WaitGroup
	var mu sync.Mutex
	var fails []string
	fail := func(format string, a ...any) {
		mu.Lock()
		defer mu.Unlock()
		if len(fails) < 10 {
			fails = append(fails, fmt.Sprintf(format, a...))
		}
	}
	deadline := time.Now().Add(4 * time.Second)
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func(seed int64) {
			defer wg.Done()
			rng := rand.New(rand.NewSource(seed))
			buf := make([]byte, 1<<20)
			for i := 0; time.Now().Before(deadline); i++ {
				var off int64
				n := 1 + rng.Intn(1<<20)
				switch rng.Intn(8) {
				case 0: // across the end
					off = size - int64(rng.Intn(n)+1)
				case 1: // at or past the end
					off = size + int64(rng.Intn(3)*rng.Intn(1<<20))
				case 2: // nothing
					n = 0
					off = rng.Int63n(size)
				case 3: // a 16 KiB block, aligned
					n = 16 << 10
					off = rng.Int63n(size/(16<<10)) * (16 << 10)
				default:
					off = rng.Int63n(size)
				}
				got, err := unix.Pread(fd, buf[:n], off)
				if err != nil {
					fail("pread %d at %d: %v", n, off, err)
					return
				}
				want := data[min(off, size):min(off+int64(n), size)]
				if got != len(want) || !bytes.Equal(buf[:got], want) {
					k := 0
					for k < got && k < len(want) && buf[k] == want[k] {
						k++
					}
					fail("pread %d at %d: %d bytes, want %d; first difference at +%d", n, off, got, len(want), k)
				}
			}
		}(int64(g) + 100)
	}
	wg.Wait()
	if len(fails) > 0 {
		t.Fatalf("%d wrong reads (first ones):\n%v\n%s", len(fails), fails, d.Log())
	}
	harness.MustEqualBytes(t, "the object read whole again", harness.ReadAll(t, mnt), data)
	d.StopClean()
}

// TestHTTPLyingServerIsEIOThroughTheExport: a server that lies about the
// ranges that touch [2 MiB, 2 MiB + 64 KiB) (a body cut short, the
// bytes of another range, the whole object with 200): a read there
// fails with EIO, again on a second try (nothing of the lie was cached
// and lent), never with the lie's bytes; reads elsewhere, before and
// after, are the object's.
func TestHTTPLyingServerIsEIOThroughTheExport(t *testing.T) {
	const size = 6 << 20
	const bad, badEnd = 2 << 20, 2<<20 + 64<<10
	data := make([]byte, size)
	rand.New(rand.NewSource(43)).Read(data)
	for _, tc := range []struct {
		name string
		lie  func(w http.ResponseWriter, lo, hi int64)
	}{
		{"body cut short", func(w http.ResponseWriter, lo, hi int64) {
			c, bw, err := w.(http.Hijacker).Hijack()
			if err != nil {
				return
			}
			defer c.Close()
			fmt.Fprintf(bw, "HTTP/1.1 206 Partial Content\r\nETag: \"v1\"\r\nContent-Range: bytes %d-%d/%d\r\nContent-Length: %d\r\n\r\n", lo, hi, size, hi-lo+1)
			bw.Write(data[lo : lo+(hi-lo+1)/2])
			bw.Flush()
		}},
		{"the bytes of another range", func(w http.ResponseWriter, lo, hi int64) {
			lo2, hi2 := lo+512, min(hi+512, size-1)
			w.Header().Set("ETag", `"v1"`)
			w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", lo2, hi2, size))
			w.WriteHeader(http.StatusPartialContent)
			w.Write(data[lo2 : hi2+1])
		}},
		{"200 and the whole object", func(w http.ResponseWriter, lo, hi int64) {
			w.Header().Set("ETag", `"v1"`)
			w.WriteHeader(http.StatusOK)
			w.Write(data)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			url := lendingServer(t, data, func(w http.ResponseWriter, r *http.Request) bool {
				lo, hi, ok := requestRange(r)
				if !ok || r.Method != http.MethodGet || hi < bad || lo >= badEnd {
					return false
				}
				tc.lie(w, lo, hi)
				return true
			})
			mnt := filepath.Join(t.TempDir(), "mnt")
			d := harness.StartExport(t, url, mnt, "-f", "raw", "--cache-size", "1M", "--kernel-cache", "off", "--reconnect-timeout", "1s")
			f, err := os.Open(mnt)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			good := func(off int64, n int) {
				t.Helper()
				p := make([]byte, n)
				if got, err := unix.Pread(int(f.Fd()), p, off); err != nil || got != n || !bytes.Equal(p, data[off:off+int64(n)]) {
					t.Fatalf("read %d at %d (away from the lies): %d bytes, %v, right bytes %v", n, off, got, err, bytes.Equal(p, data[off:off+int64(n)]))
				}
			}
			good(5<<20, 256<<10)
			for try := 0; try < 2; try++ {
				// Each one READ (a READ split in two answers a short
				// count for the good half, not EIO): the last ends one
				// byte into the lies.
				for _, r := range [][2]int64{{bad - 16<<10, 32 << 10}, {bad + 100, 1000}, {bad - 256<<10 + 1, 256 << 10}} {
					p := make([]byte, r[1])
					start := time.Now()
					got, err := unix.Pread(int(f.Fd()), p, r[0])
					if err == nil {
						t.Fatalf("try %d: read %d at %d (the lies' range) gave %d bytes, no error; the object's %v\n%s",
							try, r[1], r[0], got, bytes.Equal(p[:got], data[r[0]:r[0]+int64(got)]), d.Log())
					}
					if harness.ErrnoOf(err) != syscall.EIO {
						t.Fatalf("try %d: read %d at %d: %v, want EIO", try, r[1], r[0], err)
					}
					if took := time.Since(start); took > 5*time.Second {
						t.Fatalf("try %d: EIO after %v with a 1s reconnect timeout", try, took)
					}
				}
			}
			good(0, 1<<20)
			good(4<<20+1, 1<<20-2)
			d.StopClean()
		})
	}
}
