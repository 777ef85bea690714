package http

// Attacks on the lone reader's spin (spinConn, pconn.read): replies
// cut at every byte, chunked one byte a chunk, larger than the bufio
// buffer, over plain TCP and TLS; cancellation and deadlines in each phase
// of a reply; resets; lone and non-lone readers sharing the pool under
// -race; the spin never left set on a pooled connection. Each test is
// hang-guarded (hangGuard).

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"net"
	nethttp "net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/blockexport/blockexport/coroutines"
	"github.com/blockexport/blockexport/formats/protocols/remote"
)

// hangGuard fails the test (with every goroutine's stack) if it is
// still running after d.
func hangGuard(t *testing.T, d time.Duration) {
	t.Helper()
	done := make(chan struct{})
	t.Cleanup(func() { close(done) })
	go func() {
		select {
		case <-done:
		case <-time.After(d):
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			fmt.Fprintf(os.Stderr, "%s: hung after %v\n%s\n", t.Name(), d, buf)
			os.Exit(2)
		}
	}()
}

// rawServer answers range GETs on hijacked connections, keeping them
// alive, as mode says for each request's offset; a nil mode looks the
// offset up in modes (a string each), "whole" where it is not there.
type rawServer struct {
	data  []byte
	srv   *httptest.Server
	b     *Backend
	obj   remote.Object
	mode  func(off int64) string
	modes sync.Map
	stop  chan struct{}
	reqs  atomic.Int64
}

func newRawServer(t *testing.T, tlsOn bool, size int, mode func(off int64) string) *rawServer {
	t.Helper()
	s := &rawServer{data: make([]byte, size), mode: mode, stop: make(chan struct{})}
	if mode == nil {
		s.mode = func(off int64) string {
			if m, ok := s.modes.Load(off); ok {
				return m.(string)
			}
			return "whole"
		}
	}
	rand.New(rand.NewSource(int64(size))).Read(s.data)
	h := nethttp.HandlerFunc(func(w nethttp.ResponseWriter, r *nethttp.Request) {
		c, buf, err := w.(nethttp.Hijacker).Hijack()
		if err != nil {
			panic(err)
		}
		defer c.Close()
		for {
			if !s.answer(c, buf, r) {
				return
			}
			if r, err = nethttp.ReadRequest(buf.Reader); err != nil {
				return
			}
		}
	})
	var o Options
	if tlsOn {
		s.srv = httptest.NewTLSServer(h)
		ca := filepath.Join(t.TempDir(), "ca.pem")
		if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: s.srv.Certificate().Raw}), 0o600); err != nil {
			t.Fatal(err)
		}
		o.TLSCA = ca
	} else {
		s.srv = httptest.NewServer(h)
	}
	t.Cleanup(func() { close(s.stop); s.srv.CloseClientConnections(); s.srv.Close() })
	b, err := New(s.srv.URL+"/disk.img", o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	if b.fast == nil {
		t.Fatal("no fast client")
	}
	s.b = b
	s.obj = remote.Object{Size: int64(size), ETag: `"v1"`}
	return s
}

// tcpOf is the TCP connection under c.
func tcpOf(c net.Conn) *net.TCPConn {
	if tc, ok := c.(*tls.Conn); ok {
		return tc.NetConn().(*net.TCPConn)
	}
	return c.(*net.TCPConn)
}

// answer answers r on c; false: the connection is done.
func (s *rawServer) answer(c net.Conn, buf *bufio.ReadWriter, r *nethttp.Request) bool {
	s.reqs.Add(1)
	if r.Method == nethttp.MethodHead { // Stat's
		fmt.Fprintf(buf, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\nETag: \"v1\"\r\nAccept-Ranges: bytes\r\n\r\n", len(s.data))
		return buf.Flush() == nil
	}
	off, last := rangeOf(r)
	if m := r.Header.Get("If-Match"); m != `"v1"` && !(off == 0 && last == 0) {
		panic("no If-Match: " + m)
	}
	body := s.data[off : last+1]
	m := s.mode(off)
	head := fmt.Sprintf("HTTP/1.1 206 Partial Content\r\nContent-Range: bytes %d-%d/%d\r\nETag: \"v1\"\r\n", off, last, len(s.data))
	tcpOf(c).SetNoDelay(true)
	bytewise := func(p []byte, pause bool) bool {
		for i := range p {
			if _, err := buf.Write(p[i : i+1]); err != nil {
				return false
			}
			if err := buf.Flush(); err != nil {
				return false
			}
			if pause && i%7 == 3 {
				// Now and then long enough that the reader's spin runs
				// out and it sleeps in the poller.
				time.Sleep(50 * time.Microsecond)
			}
		}
		return true
	}
	hang := func() bool {
		select {
		case <-s.stop:
		case <-time.After(20 * time.Second):
		}
		return false
	}
	switch m {
	case "whole":
		buf.WriteString(head + "Content-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n")
		buf.Write(body)
		return buf.Flush() == nil
	case "bytewise": // every byte of head and body in a segment (and TLS record) of its own
		if !bytewise([]byte(head+"Content-Length: "+strconv.Itoa(len(body))+"\r\n\r\n"), true) {
			return false
		}
		if len(body) <= 20000 {
			return bytewise(body, len(body) < 2000)
		}
		for k := 0; k < len(body); k += 997 { // a large body in odd pieces
			buf.Write(body[k:min(k+997, len(body))])
			if buf.Flush() != nil {
				return false
			}
		}
		return true
	case "chunked": // one byte a chunk, each written a byte at a time
		if !bytewise([]byte(head+"Transfer-Encoding: chunked\r\n\r\n"), true) {
			return false
		}
		for i := range body {
			if !bytewise([]byte("1\r\n"+string(body[i:i+1])+"\r\n"), false) {
				return false
			}
		}
		return bytewise([]byte("0\r\n\r\n"), true)
	case "chunked-big": // a chunked reply in large chunks, the end a little later
		buf.WriteString(head + "Transfer-Encoding: chunked\r\n\r\n")
		for k := 0; k < len(body); k += 20000 {
			p := body[k:min(k+20000, len(body))]
			fmt.Fprintf(buf, "%x\r\n", len(p))
			buf.Write(p)
			buf.WriteString("\r\n")
			buf.Flush()
			time.Sleep(100 * time.Microsecond)
		}
		buf.WriteString("0\r\n\r\n")
		return buf.Flush() == nil
	case "trickle": // the head after any spin, the body in three pieces 2 ms apart
		time.Sleep(3 * time.Millisecond)
		buf.WriteString(head + "Content-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n")
		if buf.Flush() != nil {
			return false
		}
		for k := 0; k < 3; k++ {
			time.Sleep(2 * time.Millisecond)
			buf.Write(body[k*len(body)/3 : (k+1)*len(body)/3])
			if buf.Flush() != nil {
				return false
			}
		}
		return true
	case "cut": // half the body, then the end of the stream
		buf.WriteString(head + "Content-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n")
		buf.Write(body[:len(body)/2])
		buf.Flush()
		return false
	case "silent": // nothing at all
		return hang()
	case "half-head":
		bytewise([]byte(head), false)
		return hang()
	case "half-body":
		buf.WriteString(head + "Content-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n")
		buf.Write(body[:len(body)/2])
		buf.Flush()
		return hang()
	case "half-chunked":
		buf.WriteString(head + "Transfer-Encoding: chunked\r\n\r\n")
		fmt.Fprintf(buf, "%x\r\n", len(body))
		buf.Write(body[:len(body)/2])
		buf.Flush()
		return hang()
	case "reset-body": // half the body, then a TCP reset
		buf.WriteString(head + "Content-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n")
		buf.Write(body[:len(body)/2])
		buf.Flush()
		time.Sleep(2 * time.Millisecond)
		tcpOf(c).SetLinger(0)
		tcpOf(c).Close()
		return false
	case "eof-head": // half the head, then the end of the stream
		bytewise([]byte(head), false)
		tcpOf(c).CloseWrite()
		time.Sleep(5 * time.Millisecond)
		return false
	}
	panic("mode " + m)
}

// read GETs n bytes at off with ctx and checks them.
func (s *rawServer) read(ctx context.Context, off, n int64) error {
	p := make([]byte, n)
	for i := range p {
		p[i] = 0xa5
	}
	if err := s.b.ReadRange(ctx, s.obj, p, off); err != nil {
		return err
	}
	if !bytes.Equal(p, s.data[off:off+n]) {
		i := 0
		for p[i] == s.data[off+int64(i)] {
			i++
		}
		return fmt.Errorf("wrong bytes from byte %d of %d", i, n)
	}
	return nil
}

// checkIdle fails if a pooled connection kept its spin.
func (s *rawServer) checkIdle(t *testing.T) int {
	t.Helper()
	c := s.b.fast
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, pc := range c.idle {
		if pc.spin != 0 {
			t.Errorf("a pooled connection kept spin %v", pc.spin)
		}
	}
	return len(c.idle)
}

func forBoth(t *testing.T, f func(t *testing.T, tlsOn bool)) {
	for _, tlsOn := range []bool{false, true} {
		t.Run(map[bool]string{false: "http", true: "https"}[tlsOn], func(t *testing.T) { f(t, tlsOn) })
	}
}

// Replies cut at every byte (head, body, TLS records), chunked a byte a
// chunk, and larger than the 16 KiB reader, lone and not, on kept-alive
// connections: the right bytes, and the connections go back to the pool
// with no spin.
func TestSpinPiecewiseReplies(t *testing.T) {
	hangGuard(t, 60*time.Second)
	forBoth(t, func(t *testing.T, tlsOn bool) {
		const size = 1 << 20
		s := newRawServer(t, tlsOn, size, nil)
		lone := coroutines.WithPath(context.Background(), coroutines.Lone)
		plain := context.Background()
		sizes := []int64{1, 2, 4095, 4096, 16<<10 - 1, 16 << 10, 16<<10 + 1, 70001, 300000}
		for _, mode := range []string{"bytewise", "chunked", "chunked-big", "whole"} {
			for k, n := range sizes {
				if mode == "chunked" && n > 5000 || mode == "bytewise" && n > 20000 {
					continue // a byte a write: too slow
				}
				if mode == "chunked-big" && n < 20000 {
					continue
				}
				off := int64(k*40961+len(mode)*13) % (size - n)
				s.modes.Store(off, mode)
				for i, ctx := range []context.Context{lone, plain, lone} {
					ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
					err := s.read(ctx, off, n)
					cancel()
					if err != nil {
						t.Fatalf("%s %d bytes at %d (read %d, lone %v): %v", mode, n, off, i, coroutines.PathOf(ctx) == coroutines.Lone, err)
					}
				}
				s.modes.Delete(off)
				s.checkIdle(t)
			}
		}
		if n := s.checkIdle(t); n == 0 {
			t.Errorf("no connection kept alive")
		}
	})
}

// A lone GET ended by its context in every phase: before the head, in
// it, in a Content-Length body (readv on plain TCP), in a chunked body;
// by a deadline and by a cancel (AfterFunc's past deadline). It ends
// within a bound, with the context's error, and the pool stays good.
func TestSpinCancelEveryPhase(t *testing.T) {
	hangGuard(t, 60*time.Second)
	forBoth(t, func(t *testing.T, tlsOn bool) {
		const size = 1 << 20
		s := newRawServer(t, tlsOn, size, nil)
		lone := coroutines.WithPath(context.Background(), coroutines.Lone)
		for k, mode := range []string{"silent", "half-head", "half-body", "half-chunked"} {
			for _, how := range []string{"deadline", "cancel"} {
				for _, n := range []int64{4096, 200000} {
					off := int64(k*100000+len(how)*1000) + n%7
					s.modes.Store(off, mode)
					var ctx context.Context
					var cancel context.CancelFunc
					if how == "deadline" {
						ctx, cancel = context.WithTimeout(lone, 40*time.Millisecond)
					} else {
						ctx, cancel = context.WithCancel(lone)
						time.AfterFunc(40*time.Millisecond, cancel)
					}
					start := time.Now()
					err := s.read(ctx, off, n)
					took := time.Since(start)
					cancel()
					s.modes.Delete(off)
					if err == nil {
						t.Fatalf("%s, %s, %d bytes: no error", mode, how, n)
					}
					if took > 2*time.Second {
						t.Fatalf("%s, %s, %d bytes: ended after %v", mode, how, n, took)
					}
					want := context.DeadlineExceeded
					if how == "cancel" {
						want = context.Canceled
					}
					// A deadline: the connection's timer may fire before
					// the context's (as before the spin), an i/o timeout.
					timedOut := how == "deadline" && strings.Contains(err.Error(), "i/o timeout")
					if !(errors.Is(err, want) || timedOut) || !errors.Is(err, remote.ErrTemporary) {
						t.Errorf("%s, %s, %d bytes: %v; want a temporary %v", mode, how, n, err, want)
					}
					s.checkIdle(t)
					if err := s.read(lone, 1<<19, 8192); err != nil {
						t.Fatalf("after %s, %s: %v", mode, how, err)
					}
				}
			}
		}
	})
}

// A reset in the body, and an end of stream in the head, of a lone GET:
// a temporary error, no wrong bytes, and the next read is good.
func TestSpinResetAndEOF(t *testing.T) {
	hangGuard(t, 30*time.Second)
	forBoth(t, func(t *testing.T, tlsOn bool) {
		const size = 1 << 20
		s := newRawServer(t, tlsOn, size, nil)
		lone := coroutines.WithPath(context.Background(), coroutines.Lone)
		for k, mode := range []string{"reset-body", "eof-head"} {
			for _, n := range []int64{4096, 100000} {
				off := int64(k*300000) + n
				s.modes.Store(off, mode)
				ctx, cancel := context.WithTimeout(lone, 5*time.Second)
				err := s.read(ctx, off, n)
				cancel()
				s.modes.Delete(off)
				if err == nil || !errors.Is(err, remote.ErrTemporary) || strings.Contains(err.Error(), "wrong bytes") {
					t.Fatalf("%s, %d bytes: %v; want a temporary error", mode, n, err)
				}
				if err := s.read(lone, 1<<19, 8192); err != nil {
					t.Fatalf("after %s: %v", mode, err)
				}
			}
		}
	})
}

// Lone and other readers share the pool at once (-race: pc.spin is
// written and read on one goroutine only); lone GETs cancelled at random
// times mixed in.
func TestSpinSharedPool(t *testing.T) {
	hangGuard(t, 60*time.Second)
	forBoth(t, func(t *testing.T, tlsOn bool) {
		const size = 4 << 20
		s := newRawServer(t, tlsOn, size, func(off int64) string {
			switch off % 5 {
			case 1:
				return "bytewise"
			case 2:
				return "chunked-big"
			}
			return "whole"
		})
		lone := coroutines.WithPath(context.Background(), coroutines.Lone)
		var wg sync.WaitGroup
		var bad atomic.Value
		for g := 0; g < 8; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := rand.New(rand.NewSource(int64(g)))
				for i := 0; i < 40; i++ {
					base := context.Background()
					if r.Intn(2) == 0 {
						base = lone
					}
					n := int64(1 + r.Intn(3)*40000 + r.Intn(4096))
					off := r.Int63n(size - n)
					if off%5 == 1 {
						n = min(n, 3000) // a byte a segment: short
					}
					ctx, cancel := context.WithTimeout(base, 20*time.Second)
					cancelled := false
					if r.Intn(6) == 0 {
						cancelled = true
						time.AfterFunc(time.Duration(r.Intn(300))*time.Microsecond, cancel)
					}
					err := s.read(ctx, off, n)
					cancel()
					if err != nil && (!cancelled || strings.Contains(err.Error(), "wrong bytes")) {
						bad.Store(fmt.Errorf("%d bytes at %d (lone %v, cancelled %v): %w", n, off, base == lone, cancelled, err))
						return
					}
				}
			}()
		}
		wg.Wait()
		if err, _ := bad.Load().(error); err != nil {
			t.Fatal(err)
		}
		s.checkIdle(t)
	})
}

// spinConn's Read straight: data that comes inside the spin and after it,
// in pieces; the end of the stream; a reset; a deadline while it spins
// and while it sleeps; a deadline set from another goroutine (the
// context's AfterFunc); a read after Close.
func TestSpinConnRead(t *testing.T) {
	hangGuard(t, 30*time.Second)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	pair := func() (spinConn, *net.TCPConn) {
		t.Helper()
		acc := make(chan net.Conn, 1)
		go func() { c, _ := ln.Accept(); acc <- c }()
		nc, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		peer := (<-acc).(*net.TCPConn)
		peer.SetNoDelay(true)
		tc := nc.(*net.TCPConn)
		raw, err := tc.SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		pc := &pconn{sock: raw, plain: true, spin: replySpin}
		pc.nc = spinConn{tc, pc}
		t.Cleanup(func() { tc.Close(); peer.Close() })
		return spinConn{tc, pc}, peer
	}

	// trickle writes want to peer a byte at a time, pausing after every
	// every-th byte for up to maxUs µs: some reads find bytes within the
	// spin, some sleep in the poller.
	trickle := func(peer net.Conn, want []byte, every, maxUs int) {
		for i := range want {
			peer.Write(want[i : i+1])
			if i%every == 0 {
				time.Sleep(time.Duration(i%maxUs) * time.Microsecond)
			}
		}
	}
	t.Run("pieces", func(t *testing.T) {
		c, peer := pair()
		want := make([]byte, 3000)
		rand.Read(want)
		go trickle(peer, want, 3, 90)
		c.SetDeadline(time.Now().Add(10 * time.Second))
		got := make([]byte, 0, len(want))
		p := make([]byte, 700)
		for len(got) < len(want) {
			n, err := c.Read(p)
			if n < 0 || n > len(p) {
				t.Fatalf("Read returned %d", n)
			}
			if err != nil {
				t.Fatalf("after %d bytes: %v", len(got), err)
			}
			got = append(got, p[:n]...)
		}
		if !bytes.Equal(got, want) {
			t.Fatal("wrong bytes")
		}
	})
	t.Run("readv-pieces", func(t *testing.T) {
		c, peer := pair()
		want := make([]byte, 5000)
		rand.Read(want)
		go trickle(peer, want, 5, 70)
		c.SetDeadline(time.Now().Add(10 * time.Second))
		c.pc.br = bufio.NewReaderSize(c, 16<<10)
		bufs := [][]byte{make([]byte, 1), make([]byte, 0), make([]byte, 999), make([]byte, 4000)}
		n, err := c.pc.fill(bufs)
		if err != nil || n != len(want) {
			t.Fatalf("fill: %d, %v", n, err)
		}
		if !bytes.Equal(bytes.Join(bufs, nil), want) {
			t.Fatal("wrong bytes")
		}
	})
	t.Run("eof", func(t *testing.T) {
		c, peer := pair()
		peer.Write([]byte("ab"))
		peer.CloseWrite()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		b, err := io.ReadAll(c)
		if err != nil || string(b) != "ab" {
			t.Fatalf("%q, %v", b, err)
		}
		n, err := c.Read(make([]byte, 10))
		if n != 0 || err != io.EOF {
			t.Fatalf("after the end: %d, %v; want 0, EOF", n, err)
		}
	})
	t.Run("reset", func(t *testing.T) {
		c, peer := pair()
		peer.SetLinger(0)
		peer.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		n, err := c.Read(make([]byte, 10))
		if n != 0 || err == nil {
			t.Fatalf("%d, %v; want an error", n, err)
		}
	})
	for _, d := range []time.Duration{10 * time.Microsecond, 5 * time.Millisecond} {
		t.Run("deadline-"+d.String(), func(t *testing.T) {
			c, _ := pair()
			c.SetDeadline(time.Now().Add(d))
			start := time.Now()
			n, err := c.Read(make([]byte, 10))
			var ne net.Error
			if n != 0 || !errors.As(err, &ne) || !ne.Timeout() || !errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("%d, %v; want a timeout", n, err)
			}
			if took := time.Since(start); took > time.Second {
				t.Fatalf("took %v", took)
			}
		})
	}
	t.Run("deadline-from-another-goroutine", func(t *testing.T) {
		for i := 0; i < 200; i++ {
			c, _ := pair()
			at := time.Duration(i%40) * time.Microsecond
			time.AfterFunc(at, func() { c.SetDeadline(aLongTimeAgo) })
			done := make(chan error, 1)
			go func() {
				_, err := c.Read(make([]byte, 10))
				done <- err
			}()
			select {
			case err := <-done:
				if !errors.Is(err, os.ErrDeadlineExceeded) {
					t.Fatalf("deadline at %v: %v", at, err)
				}
			case <-time.After(2 * time.Second):
				t.Fatalf("deadline set after %v: the read never ended", at)
			}
		}
	})
	t.Run("closed", func(t *testing.T) {
		c, _ := pair()
		c.Close()
		n, err := c.Read(make([]byte, 10))
		if n != 0 || !errors.Is(err, net.ErrClosed) {
			t.Fatalf("%d, %v; want net.ErrClosed", n, err)
		}
	})
	t.Run("close-while-waiting", func(t *testing.T) {
		c, _ := pair()
		done := make(chan error, 1)
		go func() {
			_, err := c.Read(make([]byte, 10))
			done <- err
		}()
		time.Sleep(2 * time.Millisecond)
		c.Close()
		select {
		case err := <-done:
			if !errors.Is(err, net.ErrClosed) {
				t.Fatalf("%v; want net.ErrClosed", err)
			}
		case <-time.After(2 * time.Second):
			t.Fatal("Close did not end the read")
		}
	})
}

// The whole way: a remote.File whose reader cannot give up (no Done) makes
// its GET itself, marked Lone (load with held), over replies cut at every
// byte and chunked; the bytes are right, and each 4 KiB read ends.
func TestSpinFileLoneReads(t *testing.T) {
	hangGuard(t, 60*time.Second)
	forBoth(t, func(t *testing.T, tlsOn bool) {
		const size = 1 << 20
		s := newRawServer(t, tlsOn, size, func(off int64) string {
			switch (off / 4096) % 3 {
			case 0:
				return "bytewise"
			case 1:
				return "chunked-big"
			}
			return "whole"
		})
		f, err := remote.Open(context.Background(), s.b, remote.Options{Connections: 2, CacheSize: 256 << 10, ReconnectTimeout: 10 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		r := rand.New(rand.NewSource(1))
		p := make([]byte, 4096)
		for i := 0; i < 30; i++ {
			off := r.Int63n(size/4096) * 4096
			if _, err := f.ReadAt(context.Background(), p, off); err != nil {
				t.Fatalf("read at %d: %v", off, err)
			}
			if !bytes.Equal(p, s.data[off:off+4096]) {
				t.Fatalf("read at %d: wrong bytes", off)
			}
		}
		s.checkIdle(t)
	})
}
