package nbd

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"net"
	"net/url"
	"path/filepath"
	"sync"
	"testing"

	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
)

// fakeInfo is what a fake server's connection negotiates.
type fakeInfo struct {
	flags                 uint16 // transmission flags (HAS_FLAGS added)
	min, pref, max        uint32 // block sizes; 0: none sent
	extended, structured  bool
	alloc                 bool // base:allocation
	size                  uint64
	hangUpAfterHandshake  bool
	rejectExtendedHeaders bool
	// silent: the server accepts and never greets (a stalled server).
	silent bool
}

// fakeReq is one request a fake server took.
type fakeReq struct {
	conn                int // which connection, from 0
	flags, cmd          uint16
	cookie, off, length uint64
	payload             []byte
}

// fakeNBD is an NBD server that serves memory, negotiates what info says
// for each connection, and lets a test lie, hold or hang up per request.
type fakeNBD struct {
	t    *testing.T
	path string
	l    net.Listener

	mu    sync.Mutex
	data  []byte
	conns int
	reqs  []fakeReq
	// info says what connection n negotiates.
	info func(n int) fakeInfo
	// handle, if set, answers a request: the reply's bytes (nil: the
	// default one, which also applies writes) and whether to hang up
	// instead of answering.
	handle func(r fakeReq, info fakeInfo) (reply []byte, hangUp bool)
}

func newFakeNBD(t *testing.T, size int, info func(n int) fakeInfo) *fakeNBD {
	t.Helper()
	f := &fakeNBD{t: t, path: filepath.Join(t.TempDir(), "fake.sock"), data: make([]byte, size), info: info}
	l, err := net.Listen("unix", f.path)
	if err != nil {
		t.Fatal(err)
	}
	f.l = l
	var wg sync.WaitGroup
	var open sync.Map
	t.Cleanup(func() {
		l.Close()
		open.Range(func(k, _ any) bool { k.(net.Conn).Close(); return true })
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
			f.mu.Lock()
			n := f.conns
			f.conns++
			f.mu.Unlock()
			open.Store(c, true)
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer open.Delete(c)
				defer c.Close()
				f.serve(c, n)
			}()
		}
	}()
	return f
}

func (f *fakeNBD) uri() string { return "nbd+unix:///?socket=" + url.QueryEscape(f.path) }

// open opens the fake's export with o (a quiet logger unless o has one).
func (f *fakeNBD) open(o Options) *Image {
	f.t.Helper()
	a, err := ParseURI(f.uri())
	if err != nil {
		f.t.Fatal(err)
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	img, err := Open(context.Background(), a, o)
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { img.Close() })
	return img
}

func (f *fakeNBD) requests() []fakeReq {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]fakeReq(nil), f.reqs...)
}

func (f *fakeNBD) serve(c net.Conn, n int) {
	info := f.info(n)
	if info.size == 0 {
		info.size = uint64(len(f.data))
	}
	if info.silent {
		io.Copy(io.Discard, c) // until the client hangs up
		return
	}
	r := bufio.NewReader(c)
	var wmu sync.Mutex
	w := func(b []byte) {
		wmu.Lock()
		defer wmu.Unlock()
		c.Write(b)
	}
	g := be.AppendUint64(nil, wire.MagicOldstyle)
	g = be.AppendUint64(g, wire.MagicOption)
	w(be.AppendUint16(g, wire.HandshakeFixed|wire.HandshakeNoZeroes))
	if _, err := io.ReadFull(r, make([]byte, 4)); err != nil {
		return
	}
	optReply := func(opt, typ uint32, data []byte) {
		b := be.AppendUint64(nil, wire.MagicReply)
		b = be.AppendUint32(b, opt)
		b = be.AppendUint32(b, typ)
		b = be.AppendUint32(b, uint32(len(data)))
		w(append(b, data...))
	}
	for done := false; !done; {
		var h [16]byte
		if _, err := io.ReadFull(r, h[:]); err != nil {
			return
		}
		opt, size := be.Uint32(h[8:]), be.Uint32(h[12:])
		if _, err := io.ReadFull(r, make([]byte, size)); err != nil {
			return
		}
		switch {
		case opt == wire.OptExtendedHeaders && info.extended:
			optReply(opt, wire.RepAck, nil)
		case opt == wire.OptStructuredReply && info.structured:
			optReply(opt, wire.RepAck, nil)
		case opt == wire.OptSetMetaContext && info.alloc:
			// A different context id on each connection: the client must
			// use each connection's own.
			optReply(opt, wire.RepMetaContext, append(be.AppendUint32(nil, uint32(7+n)), wire.BaseAllocation...))
			optReply(opt, wire.RepAck, nil)
		case opt == wire.OptGo:
			ie := be.AppendUint16(nil, wire.InfoExport)
			ie = be.AppendUint64(ie, info.size)
			optReply(opt, wire.RepInfo, be.AppendUint16(ie, info.flags|wire.FlagHasFlags))
			if info.min != 0 {
				bs := be.AppendUint16(nil, wire.InfoBlockSize)
				bs = be.AppendUint32(bs, info.min)
				bs = be.AppendUint32(bs, info.pref)
				optReply(opt, wire.RepInfo, be.AppendUint32(bs, info.max))
			}
			optReply(opt, wire.RepAck, nil)
			done = true
		default:
			optReply(opt, wire.RepErrUnsup, nil)
		}
	}
	if info.hangUpAfterHandshake {
		return
	}
	for {
		hdr := make([]byte, wire.RequestSize)
		if info.extended {
			hdr = make([]byte, wire.ExtendedRequestSize)
		}
		if _, err := io.ReadFull(r, hdr); err != nil {
			return
		}
		q := fakeReq{conn: n, flags: be.Uint16(hdr[4:]), cmd: be.Uint16(hdr[6:]), cookie: be.Uint64(hdr[8:]), off: be.Uint64(hdr[16:])}
		if info.extended {
			q.length = be.Uint64(hdr[24:])
		} else {
			q.length = uint64(be.Uint32(hdr[24:]))
		}
		if q.cmd == wire.CmdDisc {
			return
		}
		if q.cmd == wire.CmdWrite {
			q.payload = make([]byte, q.length)
			if _, err := io.ReadFull(r, q.payload); err != nil {
				return
			}
		}
		f.mu.Lock()
		f.reqs = append(f.reqs, q)
		f.mu.Unlock()
		var reply []byte
		hangUp := false
		if f.handle != nil {
			reply, hangUp = f.handle(q, info)
		}
		if hangUp {
			return
		}
		if reply == nil {
			reply = f.apply(q, info)
		}
		w(reply)
	}
}

// apply carries out a request on the memory and returns its reply.
func (f *fakeNBD) apply(q fakeReq, info fakeInfo) []byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	end := q.off + q.length
	if end > uint64(len(f.data)) || end < q.off {
		return f.reply(q, info, wire.EInval)
	}
	switch q.cmd {
	case wire.CmdRead:
		data := append(be.AppendUint64(nil, q.off), f.data[q.off:end]...)
		switch {
		case info.extended:
			return extChunk(q.cookie, q.off, wire.ChunkFlagDone, wire.ChunkOffsetData, data)
		case info.structured:
			return chunk(q.cookie, wire.ChunkFlagDone, wire.ChunkOffsetData, data)
		}
		return append(simpleReply(q.cookie, 0), f.data[q.off:end]...)
	case wire.CmdWrite:
		copy(f.data[q.off:], q.payload)
	case wire.CmdWriteZeroes, wire.CmdTrim:
		clear(f.data[q.off:end])
	case wire.CmdBlockStatus:
		// All of it data, under this connection's context id.
		ctxID := uint32(7 + q.conn)
		if info.extended {
			d := be.AppendUint64(be.AppendUint64(be.AppendUint32(be.AppendUint32(nil, ctxID), 1), q.length), 0)
			return extChunk(q.cookie, q.off, wire.ChunkFlagDone, wire.ChunkBlockStatusExt, d)
		}
		d := be.AppendUint32(be.AppendUint32(be.AppendUint32(nil, ctxID), uint32(q.length)), 0)
		return chunk(q.cookie, wire.ChunkFlagDone, wire.ChunkBlockStatus, d)
	}
	return f.reply(q, info, 0)
}

// reply is a reply without data: an extended NONE chunk or error chunk
// under extended headers, a simple reply otherwise.
func (f *fakeNBD) reply(q fakeReq, info fakeInfo, code uint32) []byte {
	if info.extended {
		if code != 0 {
			return extChunk(q.cookie, q.off, wire.ChunkFlagDone, wire.ChunkError, be.AppendUint16(be.AppendUint32(nil, code), 0))
		}
		return extChunk(q.cookie, q.off, wire.ChunkFlagDone, wire.ChunkNone, nil)
	}
	return simpleReply(q.cookie, code)
}

func simpleReply(cookie uint64, code uint32) []byte {
	return be.AppendUint64(be.AppendUint32(be.AppendUint32(nil, wire.MagicSimple), code), cookie)
}
