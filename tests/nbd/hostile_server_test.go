package nbd

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// lyingNBDServer is an NBD server that lies: it serves a 1 MiB export of
// 0x5a bytes with structured replies, and answers each READ with what
// reply returns (nil: the truth). It takes any number of connections (the
// client reconnects after a reply it refused) and stops in t.Cleanup. It
// hangs up on every WRITE. accepted counts its connections.
func lyingNBDServer(t *testing.T, reply func(cookie, off, length uint64) []byte) (uri string, accepted *atomic.Int64) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "liar.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var conns sync.Map
	accepted = new(atomic.Int64)
	t.Cleanup(func() {
		l.Close()
		conns.Range(func(k, _ any) bool { k.(net.Conn).Close(); return true })
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			conns.Store(c, true)
			accepted.Add(1)
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer conns.Delete(c)
				defer c.Close()
				serveLies(c, reply)
			}()
		}
	}()
	return harness.NBDURI("", sock), accepted
}

const lyingSize = 1 << 20

// structuredChunk is a structured reply chunk (the NBD spec's layout).
func structuredChunk(cookie uint64, flags, typ uint16, payload []byte) []byte {
	be := binary.BigEndian
	b := be.AppendUint32(nil, 0x668e33ef)
	b = be.AppendUint16(b, flags)
	b = be.AppendUint16(b, typ)
	b = be.AppendUint64(b, cookie)
	b = be.AppendUint32(b, uint32(len(payload)))
	return append(b, payload...)
}

// Chunk types and the DONE flag, from the spec.
const (
	flagDone           = 1
	chunkNone          = 0
	chunkOffsetData    = 1
	chunkOffsetHole    = 2
	optGo              = 7
	optStructuredReply = 8
	repAck             = 1
)

func serveLies(c net.Conn, reply func(cookie, off, length uint64) []byte) {
	be := binary.BigEndian
	g := be.AppendUint64(nil, 0x4e42444d41474943) // NBDMAGIC
	g = be.AppendUint64(g, 0x49484156454f5054)    // IHAVEOPT
	c.Write(be.AppendUint16(g, 3))                // fixed newstyle, no zeroes
	if _, err := io.ReadFull(c, make([]byte, 4)); err != nil {
		return
	}
	optReply := func(opt, typ uint32, data []byte) {
		b := be.AppendUint64(nil, 0x3e889045565a9)
		b = be.AppendUint32(b, opt)
		b = be.AppendUint32(b, typ)
		b = be.AppendUint32(b, uint32(len(data)))
		c.Write(append(b, data...))
	}
	for done := false; !done; {
		var h [16]byte
		if _, err := io.ReadFull(c, h[:]); err != nil {
			return
		}
		opt, n := be.Uint32(h[8:]), be.Uint32(h[12:])
		if _, err := io.ReadFull(c, make([]byte, n)); err != nil {
			return
		}
		switch opt {
		case optStructuredReply:
			optReply(opt, repAck, nil)
		case optGo:
			info := be.AppendUint16(nil, 0) // INFO_EXPORT
			info = be.AppendUint64(info, lyingSize)
			optReply(opt, 3, be.AppendUint16(info, 1|4)) // HAS_FLAGS, SEND_FLUSH
			optReply(opt, repAck, nil)
			done = true
		default:
			optReply(opt, 1<<31|1, nil) // unsupported
		}
	}
	for {
		var h [28]byte
		if _, err := io.ReadFull(c, h[:]); err != nil {
			return
		}
		typ, cookie, off, length := be.Uint16(h[6:]), be.Uint64(h[8:]), be.Uint64(h[16:]), uint64(be.Uint32(h[24:]))
		switch typ {
		case 0: // READ
			r := reply(cookie, off, length)
			if r == nil {
				r = structuredChunk(cookie, flagDone, chunkOffsetData, append(be.AppendUint64(nil, off), bytes.Repeat([]byte{0x5a}, int(length))...))
			}
			c.Write(r)
		case 1: // WRITE: not offered
			return
		case 2: // DISC
			return
		default: // FLUSH and the rest: a simple success
			c.Write(be.AppendUint64(be.AppendUint64(nil, 0x67446698<<32), cookie))
		}
	}
}

// readDirect reads n bytes at off from path with O_DIRECT (the page
// cache would hide what the export answers) into a buffer that held
// 0xee: it returns what the read returned.
func readDirect(t *testing.T, path string, off int64, n int) (int, []byte, error) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Munmap(buf) })
	for i := range buf {
		buf[i] = 0xee
	}
	k, err := f.ReadAt(buf, off)
	return k, buf, err
}

// TestNBDSourceLyingRepliesAreEIOThroughFUSE: a FUSE export of an NBD server whose
// READ replies lie: an OFFSET_DATA chunk 2^63-1 past the request (it
// killed the export: the mount went ENOTCONN), a hole of one byte as far, a read
// answered with NONE only or with half its data (the reader got stale
// bytes, FUSE request headers among them). Each read fails with EIO, the
// export lives on, and an honest read after it reads right.
func TestNBDSourceLyingRepliesAreEIOThroughFUSE(t *testing.T) {
	be := binary.BigEndian
	const lieAt = 64 << 10 // reads here get the lie; elsewhere the truth
	lies := map[string]func(cookie, off, length uint64) []byte{
		"data 2 to the 63 past the request": func(cookie, off, length uint64) []byte {
			return structuredChunk(cookie, flagDone, chunkOffsetData, append(be.AppendUint64(nil, off+1<<63-1), make([]byte, length)...))
		},
		"a hole of one byte 2 to the 63 less 1 past the request": func(cookie, off, _ uint64) []byte {
			return structuredChunk(cookie, flagDone, chunkOffsetHole, be.AppendUint32(be.AppendUint64(nil, off+1<<63-1), 1))
		},
		"NONE and DONE only": func(cookie, _, _ uint64) []byte {
			return structuredChunk(cookie, flagDone, chunkNone, nil)
		},
		"half the data": func(cookie, off, length uint64) []byte {
			return structuredChunk(cookie, flagDone, chunkOffsetData, append(be.AppendUint64(nil, off), bytes.Repeat([]byte{0x5a}, int(length/2))...))
		},
	}
	for name, lie := range lies {
		t.Run(name, func(t *testing.T) {
			uri, _ := lyingNBDServer(t, func(cookie, off, length uint64) []byte {
				if off <= lieAt && lieAt < off+length {
					return lie(cookie, off, length)
				}
				return nil
			})
			mnt := filepath.Join(t.TempDir(), "mnt")
			d := harness.StartExport(t, uri, mnt)
			// An honest read first: its bytes would be the stale ones.
			if n, got, err := readDirect(t, mnt, 0, 4096); err != nil || n != 4096 || !bytes.Equal(got, bytes.Repeat([]byte{0x5a}, 4096)) {
				t.Fatalf("an honest read: %d, %v", n, err)
			}
			n, got, err := readDirect(t, mnt, lieAt, 4096)
			if harness.ErrnoOf(err) != syscall.EIO {
				t.Fatalf("a read the server lied to: %d bytes (%x...), %v; want EIO", n, got[:16], err)
			}
			if n, got, err := readDirect(t, mnt, 8192, 4096); err != nil || n != 4096 || !bytes.Equal(got, bytes.Repeat([]byte{0x5a}, 4096)) {
				t.Fatalf("a read after the lie: %d, %v (the export died?)\n%s", n, err, d.Log())
			}
			d.StopClean()
		})
	}
}

// TestNBDSourceReconnectStormEndsInEIO: a server that completes every
// handshake and hangs up on every WRITE, behind `fuse -w
// --reconnect-timeout 1s`: a 4 KiB write fails with EIO in about that
// second, after a bounded number of reconnects, and the daemon logs the
// storm in a few lines (it retried 12,000 times in 20 s, never
// returning, and logged every reconnect).
func TestNBDSourceReconnectStormEndsInEIO(t *testing.T) {
	uri, accepted := lyingNBDServer(t, func(uint64, uint64, uint64) []byte { return nil })
	mnt := filepath.Join(t.TempDir(), "mnt")
	d := harness.StartExport(t, uri, mnt, "-w", "--reconnect-timeout", "1s")
	f, err := os.OpenFile(mnt, os.O_WRONLY|syscall.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf, err := syscall.Mmap(-1, 0, 4096, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(buf)
	before := accepted.Load()
	done := make(chan error, 1)
	began := time.Now()
	go func() {
		_, err := f.WriteAt(buf, 0)
		done <- err
	}()
	select {
	case err := <-done:
		if took := time.Since(began); harness.ErrnoOf(err) != syscall.EIO || took > 5*time.Second {
			t.Fatalf("a write to a server that hangs up on writes: %v after %v; want EIO after about 1s", err, took)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("the write never returned: %d connections so far\n%s", accepted.Load(), d.Log())
	}
	if n := accepted.Load() - before; n > 12 {
		t.Fatalf("the write made %d connections in about a second", n)
	}
	lines := 0
	for _, l := range strings.Split(d.Log(), "\n") {
		if strings.Contains(l, "NBD") {
			lines++
		}
	}
	if lines > 4 {
		t.Fatalf("the storm logged %d lines about NBD:\n%s", lines, d.Log())
	}
	d.StopClean()
}
