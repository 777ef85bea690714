package nbd

import (
	"bufio"
	"io"
	"net"
	"testing"
	"time"

	"github.com/blockexport/blockexport/aio/sock"
	"github.com/blockexport/blockexport/formats/nbd/wire"
)

// extChunk is an extended reply chunk as a server sends it, laid out as
// the EXTENDED_HEADERS extension says (its magic written out: a wrong
// constant in wire fails the tests that use this).
func extChunk(cookie, off uint64, flags, typ uint16, payload []byte) []byte {
	b := be.AppendUint32(nil, 0x6e8a278c)
	b = be.AppendUint16(b, flags)
	b = be.AppendUint16(b, typ)
	b = be.AppendUint64(b, cookie)
	b = be.AppendUint64(b, off)
	b = be.AppendUint64(b, uint64(len(payload)))
	return append(b, payload...)
}

// chunk is a structured reply chunk as a server sends it.
func chunk(cookie uint64, flags, typ uint16, payload []byte) []byte {
	b := be.AppendUint32(nil, wire.MagicStructured)
	b = be.AppendUint16(b, flags)
	b = be.AppendUint16(b, typ)
	b = be.AppendUint64(b, cookie)
	b = be.AppendUint32(b, uint32(len(payload)))
	return append(b, payload...)
}

// FuzzReplies feeds arbitrary bytes to the client as a server's replies
// to three requests in flight (a read, a block status, a write) and then
// hangs up: every request must end, in an error or not, without a panic
// or a hang, and a read never gets more than it asked for.
func FuzzReplies(f *testing.F) {
	f.Add(chunk(1, wire.ChunkFlagDone, wire.ChunkOffsetData, append(be.AppendUint64(nil, 0), make([]byte, 4096)...)), false)
	f.Add(append(chunk(1, 0, wire.ChunkOffsetHole, be.AppendUint32(be.AppendUint64(nil, 0), 4096)), chunk(1, wire.ChunkFlagDone, wire.ChunkNone, nil)...), false)
	f.Add(chunk(2, wire.ChunkFlagDone, wire.ChunkBlockStatus, be.AppendUint32(be.AppendUint32(be.AppendUint32(nil, 1), 4096), 3)), false)
	f.Add(be.AppendUint64(be.AppendUint32(be.AppendUint32(nil, wire.MagicSimple), 0), 3), false)
	f.Add(chunk(3, wire.ChunkFlagDone, wire.ChunkError, append(be.AppendUint16(be.AppendUint32(nil, 5), 2), "no"...)), false)
	// Under extended headers: data, block status, a final NONE.
	f.Add(extChunk(1, 0, wire.ChunkFlagDone, wire.ChunkOffsetData, append(be.AppendUint64(nil, 0), make([]byte, 4096)...)), true)
	f.Add(extChunk(2, 0, wire.ChunkFlagDone, wire.ChunkBlockStatusExt,
		be.AppendUint64(be.AppendUint64(be.AppendUint32(be.AppendUint32(nil, 1), 1), 4096), 3)), true)
	f.Add(extChunk(3, 0, wire.ChunkFlagDone, wire.ChunkNone, nil), true)
	f.Fuzz(func(t *testing.T, replies []byte, extended bool) {
		a, b := net.Pipe()
		st, err := sock.New(a, 0)
		if err != nil {
			t.Fatal(err)
		}
		c := newConn(st, exportInfo{size: 1 << 20, structured: true, extended: extended, hasAlloc: true, allocCtx: 1,
			minBlock: 1, prefBlock: 4096, maxBlock: 1 << 20})
		go func() { // the server: takes the requests, sends the replies, hangs up
			r := bufio.NewReader(b)
			for range 3 {
				var h [wire.ExtendedRequestSize]byte
				n := wire.RequestSize
				if extended {
					n = wire.ExtendedRequestSize
				}
				if _, err := io.ReadFull(r, h[:n]); err != nil {
					break
				}
			}
			b.SetDeadline(time.Now().Add(2 * time.Second))
			b.Write(replies)
			b.Close()
		}()
		buf := make([]byte, 4096)
		done := make(chan struct{}, 3)
		go func() {
			cl := call{cmd: wire.CmdRead, off: 0, buf: buf}
			c.do(&cl, 0, 4096, nil)
			done <- struct{}{}
		}()
		go func() {
			cl := call{cmd: wire.CmdBlockStatus, off: 0}
			c.do(&cl, wire.CmdFlagReqOne, 4096, nil)
			done <- struct{}{}
		}()
		go func() {
			cl := call{cmd: wire.CmdWrite, off: 0}
			c.do(&cl, 0, 16, make([]byte, 16))
			done <- struct{}{}
		}()
		for range 3 {
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("a request never ended")
			}
		}
		c.close()
	})
}
