package nbd

import (
	"bufio"
	"io"
	"net"
	"testing"
	"time"

	"github.com/blockexport/blockexport/aio/sock"
	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
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
// to three requests in flight (a read at reqOff, a block status, a write)
// and then hangs up: every request must end, in an error or not, without
// a panic or a hang, and a read never gets more than it asked for.
//
// The seeds name offsets relative to the read's (reqOff plus values near
// 2^63, lengths near 2^32 and 2^63), so that mutations reach the range
// arithmetic: an offset of reqOff+2^63-1 once passed the range check by
// overflow and panicked.
func FuzzReplies(f *testing.F) {
	data := func(off uint64) []byte { return append(be.AppendUint64(nil, off), make([]byte, 4096)...) }
	hole := func(off uint64, n uint32) []byte { return be.AppendUint32(be.AppendUint64(nil, off), n) }
	f.Add(chunk(1, wire.ChunkFlagDone, wire.ChunkOffsetData, data(0)), false, uint64(0))
	f.Add(append(chunk(1, 0, wire.ChunkOffsetHole, hole(0, 4096)), chunk(1, wire.ChunkFlagDone, wire.ChunkNone, nil)...), false, uint64(0))
	f.Add(chunk(2, wire.ChunkFlagDone, wire.ChunkBlockStatus, be.AppendUint32(be.AppendUint32(be.AppendUint32(nil, 1), 4096), 3)), false, uint64(0))
	f.Add(be.AppendUint64(be.AppendUint32(be.AppendUint32(nil, wire.MagicSimple), 0), 3), false, uint64(0))
	f.Add(chunk(3, wire.ChunkFlagDone, wire.ChunkError, append(be.AppendUint16(be.AppendUint32(nil, 5), 2), "no"...)), false, uint64(0))
	// Offsets relative to a read elsewhere: in range, just past it, near
	// 2^63 past it, a hole of one byte at 2^63-1; a read answered short.
	const big = 1<<63 - 1
	for _, reqOff := range []uint64{0, 1 << 20, 1<<40 + 4096} {
		f.Add(chunk(1, wire.ChunkFlagDone, wire.ChunkOffsetData, data(reqOff)), false, reqOff)
		f.Add(chunk(1, wire.ChunkFlagDone, wire.ChunkOffsetData, data(reqOff+4096)), false, reqOff)
		f.Add(chunk(1, wire.ChunkFlagDone, wire.ChunkOffsetData, data(reqOff+big)), false, reqOff)
		f.Add(chunk(1, wire.ChunkFlagDone, wire.ChunkOffsetData, data(reqOff+big-4095)), false, reqOff)
		f.Add(chunk(1, wire.ChunkFlagDone, wire.ChunkOffsetHole, hole(big, 1)), false, reqOff)
		f.Add(chunk(1, wire.ChunkFlagDone, wire.ChunkOffsetHole, hole(reqOff+big, 1<<32-1)), false, reqOff)
		f.Add(chunk(1, wire.ChunkFlagDone, wire.ChunkOffsetHole, hole(reqOff+2048, 4096)), false, reqOff)
		f.Add(append(chunk(1, 0, wire.ChunkOffsetHole, hole(reqOff, 2048)), chunk(1, wire.ChunkFlagDone, wire.ChunkOffsetHole, hole(reqOff+1024, 2048))...), false, reqOff)
		f.Add(chunk(1, wire.ChunkFlagDone, wire.ChunkNone, nil), false, reqOff)
		f.Add(extChunk(1, reqOff, wire.ChunkFlagDone, wire.ChunkOffsetData, data(reqOff+big)), true, reqOff)
		f.Add(extChunk(1, reqOff, wire.ChunkFlagDone, wire.ChunkOffsetHole, hole(reqOff+big, 1)), true, reqOff)
		// 64-bit lengths near 2^63 and 2^64 in the extended header.
		b := extChunk(1, reqOff, wire.ChunkFlagDone, wire.ChunkOffsetData, data(reqOff))
		be.PutUint64(b[24:], 1<<63+8)
		f.Add(b, true, reqOff)
		b = extChunk(1, reqOff, wire.ChunkFlagDone, wire.ChunkOffsetData, data(reqOff))
		be.PutUint64(b[24:], 1<<64-1)
		f.Add(b, true, reqOff)
		// Block status descriptors of 2^63 and 2^64-1 bytes.
		f.Add(extChunk(2, 0, wire.ChunkFlagDone, wire.ChunkBlockStatusExt,
			be.AppendUint64(be.AppendUint64(be.AppendUint32(be.AppendUint32(nil, 1), 1), 1<<64-1), 3)), true, reqOff)
		f.Add(chunk(2, wire.ChunkFlagDone, wire.ChunkBlockStatus, be.AppendUint32(be.AppendUint32(be.AppendUint32(nil, 1), 1<<32-1), 3)), false, reqOff)
	}
	// Under extended headers: data, block status, a final NONE.
	f.Add(extChunk(1, 0, wire.ChunkFlagDone, wire.ChunkOffsetData, data(0)), true, uint64(0))
	f.Add(extChunk(2, 0, wire.ChunkFlagDone, wire.ChunkBlockStatusExt,
		be.AppendUint64(be.AppendUint64(be.AppendUint32(be.AppendUint32(nil, 1), 1), 4096), 3)), true, uint64(0))
	f.Add(extChunk(3, 0, wire.ChunkFlagDone, wire.ChunkNone, nil), true, uint64(0))
	f.Fuzz(func(t *testing.T, replies []byte, extended bool, reqOff uint64) {
		readOff := int64(reqOff & (1<<62 - 1)) // a request's offset is below the export's size
		a, b := net.Pipe()
		st, err := sock.New(a, 0)
		if err != nil {
			t.Fatal(err)
		}
		c := newConn(st, exportInfo{size: 1 << 62, structured: true, extended: extended, hasAlloc: true, allocCtx: 1,
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
			cl := call{cmd: wire.CmdRead, off: readOff, buf: buf}
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
