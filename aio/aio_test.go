package aio

import (
	"bytes"
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/coroutines"
)

func openBoth(t *testing.T, path string, o Options) map[Backend]File {
	t.Helper()
	files := map[Backend]File{}
	for _, b := range []Backend{IOUring, Threads} {
		o.Backend = b
		f, err := Open(path, o)
		if err != nil {
			t.Fatal(err)
		}
		if f.Backend() != b {
			t.Fatalf("asked for %s, got %s (is io_uring disabled here?)", b, f.Backend())
		}
		t.Cleanup(func() { f.Close() })
		files[b] = f
	}
	return files
}

// TestConcurrentRandomIO: many goroutines write and read random ranges
// through each engine; afterwards the file equals a model of the writes, and
// every read matched pread on the same file. Half of them mark their
// requests lone (plain system calls beside the ring's).
func TestConcurrentRandomIO(t *testing.T) {
	for _, direct := range []bool{false, true} {
		const size = 8 << 20
		path := filepath.Join(t.TempDir(), "f")
		os.WriteFile(path, make([]byte, size), 0o644)
		for backend, f := range openBoth(t, path, Options{Writable: true, Direct: direct, Entries: 8}) {
			t.Run(string(backend), func(t *testing.T) {
				align := 1
				if direct {
					align = LogicalBlockSize(f.Fd())
				}
				// Each goroutine owns a disjoint 512 KiB region, so the
				// model is exact without locking.
				lone := coroutines.WithPath(context.Background(), coroutines.Lone)
				var wg sync.WaitGroup
				for g := 0; g < 16; g++ {
					wg.Add(1)
					go func(g int) {
						defer wg.Done()
						r := rand.New(rand.NewPCG(uint64(g), 1))
						base := int64(g) * (size / 16)
						buf := alignedBuf(64<<10, 4096)
						chk := alignedBuf(64<<10, 4096)
						for i := 0; i < 50; i++ {
							n := (1 + r.IntN(64<<10/align-1)) * align
							off := base + int64(r.IntN(int(size/16-int64(n))/align))*int64(align)
							for j := range buf[:n] {
								buf[j] = byte(r.Uint32())
							}
							ctx := context.Background()
							if g%2 == 1 {
								ctx = lone
							}
							if i%3 == 0 {
								half := n / 2 / align * align
								_, err := f.WritevAt(ctx, [][]byte{buf[:half], buf[half:n]}, off)
								if err != nil {
									t.Error(err)
									return
								}
							} else if _, err := f.WriteAt(ctx, buf[:n], off); err != nil {
								t.Error(err)
								return
							}
							if _, err := f.ReadAt(ctx, chk[:n], off); err != nil {
								t.Error(err)
								return
							}
							if !bytes.Equal(chk[:n], buf[:n]) {
								t.Errorf("read back differs at %d", off)
								return
							}
							if _, err := unix.Pread(f.Fd(), chk[:n], off); err != nil || !bytes.Equal(chk[:n], buf[:n]) {
								t.Errorf("pread differs at %d (%v)", off, err)
								return
							}
						}
					}(g)
				}
				wg.Wait()
				if err := f.Fdatasync(context.Background()); err != nil {
					t.Fatal(err)
				}
				if err := f.Fsync(context.Background()); err != nil {
					t.Fatal(err)
				}
			})
		}
	}
}

func alignedBuf(n, align int) []byte {
	b := make([]byte, n+align)
	skip := (align - int(uintptrOf(b))%align) % align
	return b[skip : skip+n]
}

func TestShortReadAtEOFAndFallocate(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f")
	os.WriteFile(path, bytes.Repeat([]byte{7}, 10000), 0o644)
	for backend, f := range openBoth(t, path, Options{Writable: true}) {
		t.Run(string(backend), func(t *testing.T) {
			buf := make([]byte, 4096)
			n, err := f.ReadAt(context.Background(), buf, 8000)
			if n != 2000 || !errors.Is(err, io.EOF) {
				t.Fatalf("read across EOF: %d %v", n, err)
			}
			n, err = f.ReadvAt(context.Background(), [][]byte{buf[:1000], buf[1000:]}, 9000)
			if n != 1000 || !errors.Is(err, io.EOF) {
				t.Fatalf("readv across EOF: %d %v", n, err)
			}
			if err := f.Fallocate(context.Background(), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, 4096); err != nil {
				t.Fatal(err)
			}
			f.ReadAt(context.Background(), buf, 0)
			if !bytes.Equal(buf, make([]byte, 4096)) {
				t.Fatal("punched range does not read zeroes")
			}
			os.WriteFile(path, bytes.Repeat([]byte{7}, 10000), 0o644)
		})
	}
}

// TestErrorsComeBackAsErrno: an I/O error (EBADF on a read-only file
// written to; EINVAL for a misaligned O_DIRECT read) is returned with its
// errno, not a hang.
func TestErrorsComeBackAsErrno(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f")
	os.WriteFile(path, make([]byte, 1<<20), 0o644)
	for backend, f := range openBoth(t, path, Options{}) {
		_, err := f.WriteAt(context.Background(), make([]byte, 512), 0)
		var pe *os.PathError
		if !errors.As(err, &pe) || !errors.Is(err, syscall.EBADF) {
			t.Errorf("%s: write to a read-only file: %v, want a PathError with EBADF", backend, err)
		}
		if err := f.Fallocate(context.Background(), 0, 0, 4096); !errors.Is(err, syscall.EBADF) {
			t.Errorf("%s: fallocate on a read-only file: %v, want EBADF", backend, err)
		}
	}
	for backend, f := range openBoth(t, path, Options{Direct: true}) {
		buf := alignedBuf(4096, 4096)
		if _, err := f.ReadAt(context.Background(), buf[1:513], 1); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("%s: misaligned O_DIRECT read: %v, want EINVAL", backend, err)
		}
	}
}

// TestRingFullAppliesBackPressure: with a 2-entry ring, 64 concurrent
// requests all complete (callers wait for a slot; none fails).
func TestRingFullAppliesBackPressure(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f")
	os.WriteFile(path, bytes.Repeat([]byte{3}, 1<<20), 0o644)
	f, err := Open(path, Options{Backend: IOUring, Entries: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for i := 0; i < 64; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			buf := make([]byte, 16384)
			// Fsync and reads mixed, so requests really queue in the ring.
			if i%4 == 0 {
				errs <- f.Fsync(context.Background())
				return
			}
			_, err := f.ReadAt(context.Background(), buf, int64(i)*16384)
			errs <- err
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
}

func TestParseBackend(t *testing.T) {
	for _, ok := range []string{"io_uring", "threads"} {
		if _, err := ParseBackend(ok); err != nil {
			t.Error(err)
		}
	}
	if _, err := ParseBackend("posix"); err == nil {
		t.Error("posix accepted")
	}
}

// TestUseAfterCloseIsAnError: a call on a closed file returns os.ErrClosed
// at once; it neither hangs nor touches a descriptor number reused since.
func TestUseAfterCloseIsAnError(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f")
	os.WriteFile(path, make([]byte, 8192), 0o644)
	for _, b := range []Backend{IOUring, Threads} {
		f, err := Open(path, Options{Backend: b, Writable: true})
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
		buf := make([]byte, 4096)
		if _, err := f.ReadAt(context.Background(), buf, 0); !errors.Is(err, os.ErrClosed) {
			t.Errorf("%s: read after close: %v", b, err)
		}
		if _, err := f.WriteAt(context.Background(), buf, 0); !errors.Is(err, os.ErrClosed) {
			t.Errorf("%s: write after close: %v", b, err)
		}
		if err := f.Fdatasync(context.Background()); !errors.Is(err, os.ErrClosed) {
			t.Errorf("%s: fdatasync after close: %v", b, err)
		}
	}
}

// TestCancelReachesTheRing: a read that cannot complete (a pipe nobody
// writes) returns once its context ends, because the ring is asked to
// cancel it; and the ring still serves reads afterwards.
func TestCancelReachesTheRing(t *testing.T) {
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer pw.Close()
	u, err := newURingFile(pr, Options{Entries: 4})
	if err != nil {
		t.Fatalf("no io_uring here: %v", err)
	}
	defer u.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := u.ReadAt(ctx, make([]byte, 8), 0)
		done <- err
	}()
	time.Sleep(50 * time.Millisecond)
	select {
	case err := <-done:
		t.Fatalf("the read returned before anything was written or cancelled: %v", err)
	default:
	}
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("cancelled read returned %v, want context.Canceled", err)
		}
	case <-time.After(5 * time.Second):
		pw.Write(make([]byte, 8)) // let it finish, so that Close does not wait forever
		<-done
		t.Fatal("the read did not return after its context was cancelled: the cancel never reached the ring")
	}
	// The slot came back, and the ring still works.
	if _, err := pw.Write([]byte("12345678")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 8)
	if _, err := u.ReadAt(context.Background(), buf, 0); err != nil || string(buf) != "12345678" {
		t.Fatalf("read after a cancel: %q, %v", buf, err)
	}
}

// TestTryReadAndWrite: a buffered file answers tries from the page cache
// (and writes into it); an O_DIRECT one never does, so nothing is written.
func TestTryReadAndWrite(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(path, bytes.Repeat([]byte{7}, 1<<16), 0o644); err != nil {
		t.Fatal(err)
	}
	for b, f := range openBoth(t, path, Options{Writable: true}) {
		p := make([]byte, 4096)
		if !f.TryReadAt(p, 4096) || p[0] != 7 {
			t.Errorf("%s: a cached read was not served by TryReadAt (%d)", b, p[0])
		}
		if f.TryReadAt(make([]byte, 4096), 1<<16-100) {
			t.Errorf("%s: TryReadAt across the end of the file said it read everything", b)
		}
		if ok, err := f.TryWriteAt([]byte{9}, 10); !ok || err != nil {
			t.Errorf("%s: buffered TryWriteAt: %v %v", b, ok, err)
		}
	}
	for b, f := range openBoth(t, path, Options{Writable: true, Direct: true}) {
		p := AlignedBuf(4096, 4096)
		if f.TryReadAt(p, 0) {
			t.Errorf("%s: O_DIRECT TryReadAt said it hit a cache", b)
		}
		if ok, _ := f.TryWriteAt(p, 0); ok {
			t.Errorf("%s: O_DIRECT TryWriteAt wrote without waiting", b)
		}
	}
	got, _ := os.ReadFile(path)
	if got[10] != 9 || got[0] != 7 {
		t.Fatalf("after the tries the file holds %d at 10 and %d at 0, want 9 and 7", got[10], got[0])
	}
}

// TestThreadTransfersOfNothingAndOfPieces: the thread engine moves
// nothing for an empty buffer (no EOF, no ENOSPC), skips empty pieces of
// an iovec, and reads a one-piece iovec as a plain read.
func TestThreadTransfersOfNothingAndOfPieces(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f")
	os.WriteFile(path, []byte("0123456789"), 0o644)
	f, err := Open(path, Options{Backend: Threads, Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctx := context.Background()
	if n, err := f.ReadAt(ctx, nil, 10); n != 0 || err != nil {
		t.Fatalf("empty read at EOF: %d %v", n, err)
	}
	if n, err := f.WriteAt(ctx, []byte{}, 3); n != 0 || err != nil {
		t.Fatalf("empty write: %d %v", n, err)
	}
	buf := make([]byte, 6)
	if n, err := f.ReadvAt(ctx, [][]byte{{}, buf[:2], {}, buf[2:]}, 2); n != 6 || err != nil || string(buf) != "234567" {
		t.Fatalf("readv with empty pieces: %d %v %q", n, err, buf)
	}
	if n, err := f.ReadvAt(ctx, [][]byte{buf}, 6); n != 4 || !errors.Is(err, io.EOF) || string(buf[:4]) != "6789" {
		t.Fatalf("one-piece readv across EOF: %d %v %q", n, err, buf[:4])
	}
}

// TestThreadReadvLeavesTheCallersPiecesAlone: a short read continued
// through a one-piece iovec does not reslice the caller's piece.
func TestThreadReadvLeavesTheCallersPiecesAlone(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f")
	os.WriteFile(path, []byte("0123456789"), 0o644)
	f, err := Open(path, Options{Backend: Threads})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 8)
	iov := [][]byte{buf}
	if n, err := f.ReadvAt(context.Background(), iov, 6); n != 4 || !errors.Is(err, io.EOF) {
		t.Fatalf("readv across EOF: %d %v", n, err)
	}
	if len(iov[0]) != 8 || &iov[0][0] != &buf[0] {
		t.Fatalf("the caller's piece was resliced to %d bytes", len(iov[0]))
	}
}
