package nbd_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/coroutines"
	exportnbd "github.com/blockexport/blockexport/export/nbd"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/protocols/nbd"
	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
	"github.com/blockexport/blockexport/formats/registry"
)

func TestParseURI(t *testing.T) {
	good := []struct {
		uri                   string
		network, addr, export string
		tls                   bool
		serverName, certDir   string
	}{
		{"nbd://example.com/disk", "tcp", "example.com:10809", "disk", false, "example.com", ""},
		{"nbd://127.0.0.1:1234", "tcp", "127.0.0.1:1234", "", false, "127.0.0.1", ""},
		{"nbd://[::1]:99/a%20b", "tcp", "[::1]:99", "a b", false, "::1", ""},
		{"nbd:///x", "tcp", "localhost:10809", "x", false, "localhost", ""},
		{"nbds://host/e?tls-certificates=/etc/pki", "tcp", "host:10809", "e", true, "host", "/etc/pki"},
		{"nbd+unix:///exp?socket=/run/nbd.sock", "unix", "/run/nbd.sock", "exp", false, "localhost", ""},
		{"nbds+unix:///?socket=/s&tls-hostname=srv", "unix", "/s", "", true, "srv", ""},
		{"nbd+tcp://h/e", "tcp", "h:10809", "e", false, "h", ""},
	}
	for _, g := range good {
		a, err := nbd.ParseURI(g.uri)
		if err != nil {
			t.Errorf("%s: %v", g.uri, err)
			continue
		}
		if a.Network != g.network || a.Addr != g.addr || a.Export != g.export || a.TLS != g.tls || a.ServerName != g.serverName || a.CertDir != g.certDir {
			t.Errorf("%s: %+v", g.uri, a)
		}
		if !nbd.IsURI(g.uri) {
			t.Errorf("IsURI(%s) = false", g.uri)
		}
	}
	for _, bad := range []string{
		"nbd+unix:///exp",               // no socket
		"nbd+unix://host/exp?socket=/s", // a host on a unix URI
		"nbd://host/e?socket=/s",        // socket on tcp
		"nbd://host:0/e", "nbd://host:99999/e", "nbd://host:x/e",
		"nbd://user@host/e", // TLS-PSK user names
		"nbd://host/e?bogus=1",
		"http://host/e",
	} {
		if _, err := nbd.ParseURI(bad); !errors.Is(err, nbd.ErrBadURI) {
			t.Errorf("%s: %v, want ErrBadURI", bad, err)
		}
	}
	for _, notURI := range []string{"disk.img", "/tmp/nbd:/x", "null:1G", "nbd:x"} {
		if nbd.IsURI(notURI) {
			t.Errorf("IsURI(%s) = true", notURI)
		}
	}
}

// server serves a raw file over a unix socket with our own NBD server.
type server struct {
	t    *testing.T
	sock string
	img  *registry.Opened
	srv  *exportnbd.Server
	l    net.Listener
	done chan struct{}
}

func serve(t *testing.T, sockPath, file string, o exportnbd.Options) *server {
	t.Helper()
	img, err := registry.Open(file, registry.Options{Format: registry.Raw, Writable: o.Writable, Backend: "threads"})
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", sockPath)
	if err != nil {
		t.Fatal(err)
	}
	o.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	s := &server{t: t, sock: sockPath, img: img, srv: exportnbd.New(img.Image, o), l: l, done: make(chan struct{})}
	go func() { s.srv.Serve(l); close(s.done) }()
	t.Cleanup(s.stop)
	return s
}

// stop ends the server as a crash would: the listener and every
// connection go, nothing is flushed.
func (s *server) stop() {
	select {
	case <-s.done:
		return
	default:
	}
	s.l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s.srv.Shutdown(ctx)
	<-s.done
	s.img.Image.Close()
	os.Remove(s.sock)
}

func open(t *testing.T, uri string, o nbd.Options) *nbd.Image {
	t.Helper()
	a, err := nbd.ParseURI(uri)
	if err != nil {
		t.Fatal(err)
	}
	o.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	img, err := nbd.Open(context.Background(), a, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { img.Close() })
	return img
}

func randomFile(t *testing.T, path string, size int, seed uint64) []byte {
	t.Helper()
	b := make([]byte, size)
	r := rand.New(rand.NewPCG(seed, seed))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestAgainstOurServer: reads, writes, zeroes, trims, flush and block
// status through the client, checked against the file the server serves,
// with many requests in flight at once; with extended headers (which both
// ends offer) and with the compact headers other servers speak.
func TestAgainstOurServer(t *testing.T) {
	for _, compact := range []bool{false, true} {
		name := map[bool]string{false: "extended", true: "compact"}[compact]
		t.Run(name, func(t *testing.T) { testAgainstOurServer(t, compact) })
	}
}

// serverLine is the line of the image's server description that starts
// with prefix (after the indent), or "".
func serverLine(img *nbd.Image, prefix string) string {
	for _, l := range img.Info().ServerLines {
		if strings.HasPrefix(strings.TrimSpace(l), prefix) {
			return strings.TrimSpace(l)
		}
	}
	return ""
}

func testAgainstOurServer(t *testing.T, compact bool) {
	dir := t.TempDir()
	file := filepath.Join(dir, "disk.raw")
	want := randomFile(t, file, 4<<20, 1)
	s := serve(t, filepath.Join(dir, "s.sock"), file, exportnbd.Options{Name: "disk", Writable: true, CompactHeaders: compact})
	img := open(t, "nbd+unix:///disk?socket="+s.sock, nbd.Options{Writable: true})
	ctx := context.Background()
	if img.Size() != 4<<20 {
		t.Fatalf("size %d", img.Size())
	}
	wantLine := map[bool]string{false: "extended headers: yes", true: "extended headers: no"}[compact]
	if got := serverLine(img, "extended headers:"); got != wantLine {
		t.Fatalf("negotiated %q, want %q", got, wantLine)
	}
	// 64 reads and writes at once, odd sizes and offsets included.
	errs := make(chan error, 64)
	for i := range 64 {
		go func() {
			off, n := int64(i)*65536+int64(i), 4096+i*13
			if i%2 == 0 {
				data := bytes.Repeat([]byte{byte(i)}, n)
				copy(want[off:], data)
				_, err := img.WriteAt(ctx, data, off)
				errs <- err
				return
			}
			got := make([]byte, n)
			if _, err := img.ReadAt(ctx, got, off); err != nil {
				errs <- err
				return
			}
			if !bytes.Equal(got, want[off:off+int64(n)]) {
				errs <- errors.New("read wrong data")
				return
			}
			errs <- nil
		}()
	}
	for range 64 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if err := img.WriteZeroes(ctx, 1<<20, 1<<20, true); err != nil {
		t.Fatal(err)
	}
	clear(want[1<<20 : 2<<20])
	if err := img.Discard(ctx, 3<<20, 4096); err != nil { // a raw file punches it: zeroes
		t.Fatal(err)
	}
	clear(want[3<<20 : 3<<20+4096])
	if err := img.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(file)
	if !bytes.Equal(got, want) {
		t.Fatal("the served file differs from what was written")
	}
	all := make([]byte, len(want))
	if _, err := img.ReadAt(ctx, all, 0); err != nil || !bytes.Equal(all, want) {
		t.Fatalf("reading it all back: %v", err)
	}
	// The zeroed MiB was unmapped: a hole that reads as zeroes.
	e, err := img.Extent(ctx, 1<<20, 1<<20)
	if err != nil || e.Data || !e.Zero || e.Start != 1<<20 || e.Length <= 0 {
		t.Fatalf("extent of the zeroed range: %+v, %v", e, err)
	}
	if e, err := img.Extent(ctx, 0, 4096); err != nil || !e.Data {
		t.Fatalf("extent of data: %+v, %v", e, err)
	}
	// Out of range is refused before it reaches the server.
	if _, err := img.ReadAt(ctx, make([]byte, 2), 4<<20-1); !errors.Is(err, formats.ErrOutOfRange) {
		t.Fatalf("read across the end: %v", err)
	}
}

// TestLargeRanges: zeroing, trimming and block status over an 8 GiB
// export. With extended headers each is one request and one extent covers
// the whole export; with compact headers lengths are 32 bits, so an
// extent stops at 2 GiB (our server's largest descriptor) and the client
// cuts commands into 1 GiB requests. Both must leave the same result.
func TestLargeRanges(t *testing.T) {
	const size = 8 << 30
	for _, compact := range []bool{false, true} {
		t.Run(map[bool]string{false: "extended", true: "compact"}[compact], func(t *testing.T) {
			dir := t.TempDir()
			file := filepath.Join(dir, "big.raw")
			f, err := os.Create(file)
			if err != nil {
				t.Fatal(err)
			}
			// Data at 1 MiB and at 7 GiB, a hole everywhere else.
			f.WriteAt(bytes.Repeat([]byte{7}, 4096), 1<<20)
			f.WriteAt(bytes.Repeat([]byte{9}, 4096), 7<<30)
			f.Truncate(size)
			f.Close()
			s := serve(t, filepath.Join(dir, "s.sock"), file, exportnbd.Options{Name: "big", Writable: true, CompactHeaders: compact})
			img := open(t, "nbd+unix:///big?socket="+s.sock, nbd.Options{Writable: true})
			ctx := context.Background()
			// The hole from 2 MiB runs to 7 GiB.
			e, err := img.Extent(ctx, 2<<20, size-2<<20)
			if err != nil || e.Data {
				t.Fatalf("extent at 2 MiB: %+v, %v", e, err)
			}
			wantLen := int64(7<<30 - 2<<20)
			if compact {
				wantLen = 1 << 30 // a compact BLOCK_STATUS asks for 1 GiB at most
			}
			if e.Length != wantLen {
				t.Fatalf("extent at 2 MiB is %d bytes, want %d", e.Length, wantLen)
			}
			// Zero everything from 0 to 7 GiB + 4 KiB, as one range.
			if err := img.WriteZeroes(ctx, 0, 7<<30+4096, true); err != nil {
				t.Fatal(err)
			}
			if e, err := img.Extent(ctx, 0, size); err != nil || e.Data {
				t.Fatalf("extent after zeroing: %+v, %v", e, err)
			} else if !compact && e.Length != size {
				t.Fatalf("after zeroing, the first extent is %d bytes, want the whole %d", e.Length, int64(size))
			}
			got := make([]byte, 4096)
			for _, off := range []int64{1 << 20, 7 << 30} {
				if _, err := img.ReadAt(ctx, got, off); err != nil || !bytes.Equal(got, make([]byte, 4096)) {
					t.Fatalf("at %d after zeroing: %v, %x...", off, err, got[:8])
				}
			}
			if err := img.Discard(ctx, 0, size); err != nil {
				t.Fatal(err)
			}
			if err := img.Flush(ctx); err != nil {
				t.Fatal(err)
			}
			var st syscall.Stat_t
			if err := syscall.Stat(file, &st); err != nil || st.Blocks > 64 {
				t.Fatalf("the file still holds %d blocks after zeroing and trimming it all (%v)", st.Blocks, err)
			}
		})
	}
}

// TestReadOnlyExport: a read-only export refuses a writable open and
// writes through a read-only one.
func TestReadOnlyExport(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "disk.raw")
	randomFile(t, file, 1<<20, 2)
	s := serve(t, filepath.Join(dir, "s.sock"), file, exportnbd.Options{})
	uri := "nbd+unix:///?socket=" + s.sock
	a, _ := nbd.ParseURI(uri)
	if _, err := nbd.Open(context.Background(), a, nbd.Options{Writable: true}); !errors.Is(err, formats.ErrReadOnly) {
		t.Fatalf("writable open of a read-only export: %v", err)
	}
	img := open(t, uri, nbd.Options{})
	if _, err := img.WriteAt(context.Background(), []byte("x"), 0); !errors.Is(err, formats.ErrReadOnly) {
		t.Fatalf("write: %v", err)
	}
}

// TestUnknownExport: the server's refusal, in words.
func TestUnknownExport(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "disk.raw")
	randomFile(t, file, 1<<20, 3)
	s := serve(t, filepath.Join(dir, "s.sock"), file, exportnbd.Options{Name: "disk"})
	a, _ := nbd.ParseURI("nbd+unix:///other?socket=" + s.sock)
	_, err := nbd.Open(context.Background(), a, nbd.Options{})
	if err == nil || !bytes.Contains([]byte(err.Error()), []byte(`no export named "other"`)) {
		t.Fatalf("open of an unknown export: %v", err)
	}
}

// TestReconnectReplaysUnflushedWrites: the server goes away and comes
// back having lost the writes it acknowledged but never flushed (it
// serves the file as it was before them); the client reconnects, sends
// them again, and nothing is lost. A later write waits for the server
// and succeeds.
func TestReconnectReplaysUnflushedWrites(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "disk.raw")
	before := randomFile(t, file, 1<<20, 4)
	sockPath := filepath.Join(dir, "s.sock")
	s := serve(t, sockPath, file, exportnbd.Options{Writable: true})
	img := open(t, "nbd+unix:///?socket="+sockPath, nbd.Options{Writable: true, ReconnectTimeout: 10 * time.Second})
	ctx := context.Background()
	want := bytes.Clone(before)
	for i := range 8 {
		data := bytes.Repeat([]byte{0xa0 + byte(i)}, 4096)
		copy(want[i*8192:], data)
		if _, err := img.WriteAt(ctx, data, int64(i*8192)); err != nil {
			t.Fatal(err)
		}
	}
	if err := img.WriteZeroes(ctx, 512<<10, 64<<10, false); err != nil {
		t.Fatal(err)
	}
	clear(want[512<<10 : 576<<10])

	s.stop()
	if err := os.WriteFile(file, before, 0o644); err != nil { // the "lost" writes
		t.Fatal(err)
	}
	restarted := make(chan struct{})
	go func() {
		time.Sleep(300 * time.Millisecond)
		serve(t, sockPath, file, exportnbd.Options{Writable: true})
		close(restarted)
	}()
	late := bytes.Repeat([]byte{0x5c}, 4096)
	if _, err := img.WriteAt(ctx, late, 900<<10); err != nil {
		t.Fatalf("a write while the server was away: %v", err)
	}
	<-restarted
	copy(want[900<<10:], late)
	if err := img.Flush(ctx); err != nil {
		t.Fatalf("flush after the reconnect: %v", err)
	}
	got, _ := os.ReadFile(file)
	if !bytes.Equal(got, want) {
		t.Fatal("writes acknowledged before the server went away are missing after the reconnect")
	}
}

// TestReconnectTimeout: a server that stays away fails requests with EIO
// once the timeout has passed, not before, and not never.
func TestReconnectTimeoutCountsFromTheOutage(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "disk.raw")
	randomFile(t, file, 1<<20, 5)
	sockPath := filepath.Join(dir, "s.sock")
	s := serve(t, sockPath, file, exportnbd.Options{})
	img := open(t, "nbd+unix:///?socket="+sockPath, nbd.Options{ReconnectTimeout: 700 * time.Millisecond})
	s.stop()
	began := time.Now()
	_, err := img.ReadAt(context.Background(), make([]byte, 4096), 0)
	if took := time.Since(began); !errors.Is(err, syscall.EIO) || took < 500*time.Millisecond || took > 10*time.Second {
		t.Fatalf("read with the server gone: %v after %v; want EIO after about 700ms", err, took)
	}
	// As QEMU's reconnect-delay: past the first timeout of the outage a
	// request fails after its own try, not after a timeout of its own.
	began = time.Now()
	if _, err := img.ReadAt(context.Background(), make([]byte, 4096), 0); !errors.Is(err, syscall.EIO) || time.Since(began) > 300*time.Millisecond {
		t.Fatalf("a later read with the server still gone: %v after %v; want EIO at once", err, time.Since(began))
	}
	// And the server that comes back is used by the next request.
	os.Remove(sockPath)
	serve(t, sockPath, file, exportnbd.Options{})
	if _, err := img.ReadAt(context.Background(), make([]byte, 4096), 0); err != nil {
		t.Fatalf("a read once the server is back: %v", err)
	}
	a, _ := nbd.ParseURI("nbd+unix:///?socket=" + filepath.Join(dir, "none.sock"))
	if _, err := nbd.Open(context.Background(), a, nbd.Options{}); err == nil {
		t.Fatal("opened an export on a socket nobody listens on")
	}
}

// fakeServer runs a server that completes the handshake (structured
// replies, no block status), answers the first request with reply and
// hangs up; it returns the URI.
// With extended, it accepts extended headers and reads 32-byte requests.
func fakeServer(t *testing.T, extended bool, reply func(cookie, off uint64) []byte) string {
	t.Helper()
	sockPath := filepath.Join(t.TempDir(), "fake.sock")
	l, err := net.Listen("unix", sockPath)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		be := binary.BigEndian
		w := func(b []byte) { c.Write(b) }
		g := be.AppendUint64(nil, wire.MagicOldstyle)
		g = be.AppendUint64(g, wire.MagicOption)
		w(be.AppendUint16(g, wire.HandshakeFixed|wire.HandshakeNoZeroes))
		io.ReadFull(c, make([]byte, 4))
		optReply := func(opt, typ uint32, data []byte) {
			b := be.AppendUint64(nil, wire.MagicReply)
			b = be.AppendUint32(b, opt)
			b = be.AppendUint32(b, typ)
			b = be.AppendUint32(b, uint32(len(data)))
			w(append(b, data...))
		}
		for {
			var h [16]byte
			if _, err := io.ReadFull(c, h[:]); err != nil {
				return
			}
			opt, n := be.Uint32(h[8:]), be.Uint32(h[12:])
			io.ReadFull(c, make([]byte, n))
			switch opt {
			case wire.OptStructuredReply:
				optReply(opt, wire.RepAck, nil)
			case 11: // NBD_OPT_EXTENDED_HEADERS
				if extended {
					optReply(opt, wire.RepAck, nil)
				} else {
					optReply(opt, wire.RepErrUnsup, nil)
				}
			case wire.OptGo:
				info := be.AppendUint16(nil, wire.InfoExport)
				info = be.AppendUint64(info, 1<<20)
				optReply(opt, wire.RepInfo, be.AppendUint16(info, wire.FlagHasFlags))
				optReply(opt, wire.RepAck, nil)
				req := make([]byte, 28)
				if extended {
					req = make([]byte, 32)
				}
				if _, err := io.ReadFull(c, req); err != nil {
					return
				}
				if extended && be.Uint32(req) != 0x21e41c71 {
					return // not an extended request: hang up
				}
				w(reply(be.Uint64(req[8:]), be.Uint64(req[16:])))
				return // and hang up
			default:
				optReply(opt, wire.RepErrUnsup, nil)
			}
		}
	}()
	return "nbd+unix:///?socket=" + sockPath
}

// TestMalformedReplies: a server that breaks the protocol gets an EIO
// error for the request, in time, and never a hang or a panic.
func TestMalformedReplies(t *testing.T) {
	be := binary.BigEndian
	chunk := nbd.Chunk
	data := func(off uint64) []byte { return append(be.AppendUint64(nil, off), make([]byte, 4096)...) }
	cases := map[string]func(cookie, off uint64) []byte{
		"bad magic":      func(uint64, uint64) []byte { return bytes.Repeat([]byte{0xee}, 64) },
		"unknown cookie": func(c, _ uint64) []byte { return chunk(c+99, wire.ChunkFlagDone, wire.ChunkNone, nil) },
		"data outside the request": func(c, _ uint64) []byte {
			return chunk(c, wire.ChunkFlagDone, wire.ChunkOffsetData, append(be.AppendUint64(nil, 1<<30), make([]byte, 16)...))
		},
		"huge error chunk": func(c, _ uint64) []byte { return chunk(c, wire.ChunkFlagDone, wire.ChunkError, make([]byte, 1<<20)) },
		"error message overrun": func(c, _ uint64) []byte {
			return chunk(c, wire.ChunkFlagDone, wire.ChunkError, append(be.AppendUint16(be.AppendUint32(nil, 5), 9999), 'x'))
		},
		"simple read reply after structured": func(c, _ uint64) []byte {
			return be.AppendUint64(be.AppendUint32(be.AppendUint32(nil, wire.MagicSimple), 0), c)
		},
		"unknown chunk type": func(c, _ uint64) []byte { return chunk(c, wire.ChunkFlagDone, 77, nil) },
		"hang up mid-reply": func(c, _ uint64) []byte {
			return chunk(c, 0, wire.ChunkOffsetData, be.AppendUint64(nil, 0))[:10]
		},
		// Under extended headers:
		"extended: reply names another offset": func(c, off uint64) []byte {
			return nbd.ExtChunk(c, off+4096, wire.ChunkFlagDone, wire.ChunkOffsetData, data(off))
		},
		"extended: a structured reply": func(c, off uint64) []byte {
			return chunk(c, wire.ChunkFlagDone, wire.ChunkOffsetData, data(off))
		},
		"extended: a simple reply": func(c, _ uint64) []byte {
			return be.AppendUint64(be.AppendUint32(be.AppendUint32(nil, wire.MagicSimple), 0), c)
		},
		"extended: a length past 32 bits": func(c, off uint64) []byte {
			b := nbd.ExtChunk(c, off, wire.ChunkFlagDone, wire.ChunkOffsetData, data(off))
			be.PutUint64(b[24:], 1<<32+4104)
			return b
		},
	}
	for name, reply := range cases {
		t.Run(name, func(t *testing.T) {
			img := open(t, fakeServer(t, strings.HasPrefix(name, "extended:"), reply), nbd.Options{})
			done := make(chan error, 1)
			go func() {
				_, err := img.ReadAt(context.Background(), make([]byte, 4096), 0)
				done <- err
			}()
			select {
			case err := <-done:
				if !errors.Is(err, syscall.EIO) {
					t.Fatalf("read: %v, want EIO", err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("the read hangs")
			}
		})
	}
}

// TestExtendedRepliesFromAnotherServer: a server of someone else's making
// (the fake, its bytes laid out from the spec) that takes extended headers
// gets 32-byte requests, and its extended chunks (a hole then data, out of
// order) are read into the right places.
func TestExtendedRepliesFromAnotherServer(t *testing.T) {
	be := binary.BigEndian
	uri := fakeServer(t, true, func(c, off uint64) []byte {
		hole := be.AppendUint32(be.AppendUint64(nil, off), 2048)
		data := append(be.AppendUint64(nil, off+2048), bytes.Repeat([]byte{0xab}, 2048)...)
		return append(nbd.ExtChunk(c, off, 0, wire.ChunkOffsetData, data), nbd.ExtChunk(c, off, wire.ChunkFlagDone, wire.ChunkOffsetHole, hole)...)
	})
	img := open(t, uri, nbd.Options{})
	if got := serverLine(img, "extended headers:"); got != "extended headers: yes" {
		t.Fatalf("negotiated %q", got)
	}
	got := bytes.Repeat([]byte{0xee}, 4096)
	if _, err := img.ReadAt(context.Background(), got, 8192); err != nil {
		t.Fatal(err)
	}
	want := append(make([]byte, 2048), bytes.Repeat([]byte{0xab}, 2048)...)
	if !bytes.Equal(got, want) {
		t.Fatalf("read %x...%x, want 2 KiB of zeroes then 2 KiB of 0xab", got[:8], got[2048:2056])
	}
}

// TestReconnectWithConnectionsReportsLoss: with several connections the
// client cannot replay (an old write could land after a newer one), so a
// reconnect with writes not yet flushed makes the next flush fail, once.
func TestReconnectWithConnectionsReportsLoss(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "disk.raw")
	randomFile(t, file, 1<<20, 6)
	sockPath := filepath.Join(dir, "s.sock")
	s := serve(t, sockPath, file, exportnbd.Options{Writable: true})
	img := open(t, "nbd+unix:///?socket="+sockPath, nbd.Options{Writable: true, Connections: 2, ReconnectTimeout: 10 * time.Second})
	ctx := context.Background()
	for i := range 4 { // both connections carry writes
		if _, err := img.WriteAt(ctx, []byte{byte(i)}, int64(i)); err != nil {
			t.Fatal(err)
		}
	}
	s.stop()
	serve(t, sockPath, file, exportnbd.Options{Writable: true})
	for i := range 4 {
		if _, err := img.WriteAt(ctx, []byte{9}, int64(100+i)); err != nil {
			t.Fatalf("a write after the reconnect: %v", err)
		}
	}
	if err := img.Flush(ctx); !errors.Is(err, syscall.EIO) {
		t.Fatalf("the first flush after a reconnect with unflushed writes: %v, want EIO", err)
	}
	if err := img.Flush(ctx); err != nil {
		t.Fatalf("the flush after that: %v", err)
	}
}

func TestCanonicalURI(t *testing.T) {
	for uri, want := range map[string]string{
		"nbd+unix:///?socket=/s":                    "nbd+unix://?socket=/s",
		"nbd+unix:///disk?socket=/s":                "nbd+unix:///disk?socket=/s",
		"nbd://h/e":                                 "nbd://h:10809/e",
		"nbd://127.0.0.1:99":                        "nbd://127.0.0.1:99",
		"nbds://h/a%20b?tls-certificates=/pki":      "nbds://h:10809/a%20b",
		"nbds+unix:///x?socket=/s&tls-hostname=srv": "nbds+unix:///x?socket=/s",
	} {
		a, err := nbd.ParseURI(uri)
		if err != nil || a.Canonical() != want {
			t.Errorf("%s: %q, %v; want %q", uri, a.Canonical(), err, want)
		}
	}
}

// TestLoopReadsCompletions: once a serve loop has taken the connections'
// sockets (CompletionFds), a waiting request leaves reading its reply to
// the loop: it does not complete while the loop does not serve, and does
// when it does. A lone request (one the loop itself runs) reads its own.
// Releasing hands reading back: a request left waiting then completes by
// itself. With the loop serving, many requests at once read right.
func TestLoopReadsCompletions(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "disk.raw")
	want := randomFile(t, file, 4<<20, 7)
	s := serve(t, filepath.Join(dir, "s.sock"), file, exportnbd.Options{Name: "disk"})
	img := open(t, "nbd+unix:///disk?socket="+s.sock, nbd.Options{})
	ctx := context.Background()
	var comp formats.Completions = img
	fds := comp.CompletionFds(nil)
	if len(fds) != 1 {
		t.Fatalf("CompletionFds: %v, want one socket", fds)
	}
	read := func(ctx context.Context, off int64) <-chan error {
		done := make(chan error, 1)
		go func() {
			got := make([]byte, 4096)
			_, err := img.ReadAt(ctx, got, off)
			if err == nil && !bytes.Equal(got, want[off:off+4096]) {
				err = errors.New("wrong data")
			}
			done <- err
		}()
		return done
	}
	// The loop does not serve: the request waits.
	waiting := read(ctx, 8192)
	select {
	case err := <-waiting:
		t.Fatalf("a request completed with nobody reading for it (%v)", err)
	case <-time.After(300 * time.Millisecond):
	}
	// A lone request reads its own reply (and maybe the other's).
	select {
	case err := <-read(coroutines.WithPath(ctx, coroutines.Lone), 4096):
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a lone request did not read its own reply")
	}
	// Serving once completes the one waiting, if the lone one did not.
	for deadline := time.Now().Add(10 * time.Second); ; {
		comp.ServeCompletions()
		select {
		case err := <-waiting:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(10 * time.Millisecond):
			if time.Now().Before(deadline) {
				continue
			}
			t.Fatal("serving completions did not complete the waiting request")
		}
		break
	}
	// The loop serves: 64 reads at once, all right.
	stop := make(chan struct{})
	loopDone := make(chan struct{})
	go func() {
		defer close(loopDone)
		for {
			select {
			case <-stop:
				return
			default:
			}
			var pfds []unix.PollFd
			for _, fd := range comp.CompletionFds(nil) {
				pfds = append(pfds, unix.PollFd{Fd: int32(fd), Events: unix.POLLIN})
			}
			unix.Poll(pfds, 20)
			comp.ServeCompletions()
		}
	}()
	var all []<-chan error
	for i := range 64 {
		all = append(all, read(ctx, int64(i)*4096*13%(4<<20-4096)))
	}
	for _, c := range all {
		select {
		case err := <-c:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a request the loop serves never completed")
		}
	}
	close(stop)
	<-loopDone
	// The loop has stopped: a request waits until the release.
	waiting = read(ctx, 12288)
	select {
	case err := <-waiting:
		t.Fatalf("a request completed with the loop stopped (%v)", err)
	case <-time.After(300 * time.Millisecond):
	}
	comp.ReleaseCompletions()
	select {
	case err := <-waiting:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a request left waiting at the release never completed")
	}
	if fds := comp.CompletionFds(nil); len(fds) != 0 {
		t.Fatalf("after the release, CompletionFds still lists %v", fds)
	}
	if err := <-read(ctx, 0); err != nil {
		t.Fatal(err)
	}
}
