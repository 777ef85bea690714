package remote

import (
	"bytes"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestStallRemoteReadDoesNotBlockOthers: an HTTP server that answers the
// probe at open and then holds every later range request: a read of the
// export waits for the reconnect timeout, and meanwhile another process
// opens, stats and closes the export at once. The FUSE loop ran such a
// read on its own thread when nothing else was in flight, so the open
// waited the whole timeout behind it (6.8 s measured).
func TestStallRemoteReadDoesNotBlockOthers(t *testing.T) {
	const size = 4 << 20
	img := bytes.Repeat([]byte{0x5a}, size)
	var mu sync.Mutex
	hold := false
	release := make(chan struct{})
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var lo, hi int64
		if _, err := fmt.Sscanf(r.Header.Get("Range"), "bytes=%d-%d", &lo, &hi); err != nil || lo < 0 || hi >= size || lo > hi {
			w.Header().Set("Accept-Ranges", "bytes")
			w.Header().Set("ETag", `"v1"`)
			w.Header().Set("Content-Length", strconv.Itoa(size))
			if r.Method == http.MethodHead {
				return
			}
			w.Write(img)
			return
		}
		mu.Lock()
		h := hold
		mu.Unlock()
		if h {
			select {
			case <-release:
			case <-r.Context().Done():
			}
			return
		}
		w.Header().Set("ETag", `"v1"`)
		w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", lo, hi, size))
		w.Header().Set("Content-Length", strconv.FormatInt(hi-lo+1, 10))
		w.WriteHeader(http.StatusPartialContent)
		w.Write(img[lo : hi+1])
	})}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(l)
	t.Cleanup(func() {
		close(release)
		srv.Close()
	})
	mnt := filepath.Join(t.TempDir(), "mnt")
	d := harness.StartExport(t, "http://"+l.Addr().String()+"/disk.img", mnt, "-f", "raw", "--reconnect-timeout", "6s", "--cache-size", "1M")
	mu.Lock()
	hold = true
	mu.Unlock()

	readDone := make(chan error, 1)
	go func() {
		f, err := os.Open(mnt)
		if err != nil {
			readDone <- err
			return
		}
		defer f.Close()
		_, err = f.ReadAt(make([]byte, 4096), 2<<20)
		readDone <- err
	}()
	time.Sleep(300 * time.Millisecond) // the read is at the server, held
	select {
	case err := <-readDone:
		t.Fatalf("the held read returned at once: %v", err)
	default:
	}
	began := time.Now()
	for i := 0; i < 3; i++ {
		f, err := os.Open(mnt)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.Stat(); err != nil {
			t.Fatal(err)
		}
		f.Close()
	}
	if took := time.Since(began); took > 2*time.Second {
		t.Fatalf("three open/stat/close of the export took %v while one read was held by the server\n%s", took, d.Log())
	}
	select {
	case err := <-readDone:
		if err == nil || !strings.Contains(err.Error(), "input/output error") {
			t.Fatalf("the held read: %v; want EIO after the reconnect timeout", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("the held read never ended\n%s", d.Log())
	}
	d.StopClean()
}
