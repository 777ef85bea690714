package nbd

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/blockexport/blockexport/aio/sock"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/null"
	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
	"github.com/blockexport/blockexport/formats/registry"
)

// client is a minimal NBD client for protocol tests: it speaks the wire
// format by hand, so that it can also speak it wrong.
type client struct {
	t *testing.T
	c net.Conn
	r *bufio.Reader
}

func newPair(t *testing.T, writable bool) (*client, *Server) {
	t.Helper()
	img, _ := null.New("null", 1<<20, true)
	return newPairWith(t, img, writable)
}

// pipeStream is a net.Pipe end as a stream (it has no descriptor, so no
// sock: plain reads and writes).
func pipeStream(t *testing.T, c net.Conn) sock.Stream {
	t.Helper()
	s, err := sock.New(c, 0)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func newPairWith(t *testing.T, img formats.Image, writable bool) (*client, *Server) {
	t.Helper()
	s := New(img, Options{Name: "disk", Writable: writable})
	a, b := net.Pipe()
	cn := newConn(s, pipeStream(t, a), s.log)
	s.mu.Lock()
	s.conns[cn] = struct{}{} // as Serve does, so Shutdown sees it
	s.mu.Unlock()
	s.wg.Add(1)
	go func() { defer s.wg.Done(); cn.serve() }()
	t.Cleanup(func() { b.Close(); s.wg.Wait() })
	b.SetDeadline(time.Now().Add(10 * time.Second))
	return &client{t: t, c: b, r: bufio.NewReader(b)}, s
}

// openRaw opens a raw file for a test server, closed when the test ends.
func openRaw(t *testing.T, path string, writable bool) formats.Image {
	t.Helper()
	opened, err := registry.Open(path, registry.Options{Format: registry.Raw, Writable: writable, Backend: "threads"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { opened.Image.Close() })
	return opened.Image
}

func (c *client) read(n int) []byte {
	c.t.Helper()
	b := make([]byte, n)
	if _, err := io.ReadFull(c.r, b); err != nil {
		c.t.Fatalf("reading %d bytes: %v", n, err)
	}
	return b
}

func (c *client) write(b []byte) {
	c.t.Helper()
	if _, err := c.c.Write(b); err != nil {
		c.t.Fatalf("write: %v", err)
	}
}

// option sends an option and returns the replies up to the final one.
func (c *client) option(id uint32, data []byte) (types []uint32, payloads [][]byte) {
	c.t.Helper()
	h := be.AppendUint64(nil, wire.MagicOption)
	h = be.AppendUint32(h, id)
	h = be.AppendUint32(h, uint32(len(data)))
	c.write(append(h, data...))
	for {
		rh := c.read(20)
		if be.Uint64(rh) != wire.MagicReply || be.Uint32(rh[8:]) != id {
			c.t.Fatalf("bad option reply header %x", rh)
		}
		typ := be.Uint32(rh[12:])
		types = append(types, typ)
		payloads = append(payloads, c.read(int(be.Uint32(rh[16:]))))
		if typ == wire.RepAck || typ&(1<<31) != 0 {
			return
		}
	}
}

func (c *client) greet() {
	c.t.Helper()
	g := c.read(18)
	if be.Uint64(g) != wire.MagicOldstyle || be.Uint64(g[8:]) != wire.MagicOption {
		c.t.Fatalf("bad greeting %x", g)
	}
	c.write(be.AppendUint32(nil, wire.ClientFixed|wire.ClientNoZeroes))
}

// metaAllocation is SET_META_CONTEXT's data asking export for
// base:allocation.
func metaAllocation(export string) []byte {
	meta := be.AppendUint32(nil, uint32(len(export)))
	meta = append(meta, export...)
	meta = be.AppendUint32(meta, 1)
	meta = be.AppendUint32(meta, uint32(len(wire.BaseAllocation)))
	return append(meta, wire.BaseAllocation...)
}

func goData(name string) []byte {
	d := be.AppendUint32(nil, uint32(len(name)))
	d = append(d, name...)
	return be.AppendUint16(d, 0)
}

// request sends one command and returns the simple reply's error and data.
func (c *client) request(typ, flags uint16, handle, off uint64, length uint32, payload []byte) {
	h := be.AppendUint32(nil, wire.MagicRequest)
	h = be.AppendUint16(h, flags)
	h = be.AppendUint16(h, typ)
	h = be.AppendUint64(h, handle)
	h = be.AppendUint64(h, off)
	h = be.AppendUint32(h, length)
	c.write(append(h, payload...))
}

func (c *client) simpleReply(dataLen int) (uint64, uint32, []byte) {
	c.t.Helper()
	h := c.read(16)
	if be.Uint32(h) != wire.MagicSimple {
		c.t.Fatalf("bad simple reply magic %x", h)
	}
	code := be.Uint32(h[4:])
	var data []byte
	if code == 0 && dataLen > 0 {
		data = c.read(dataLen)
	}
	return be.Uint64(h[8:]), code, data
}

func TestNegotiationAndCommands(t *testing.T) {
	c, _ := newPair(t, false)
	c.greet()
	// Unknown option: unsupported, and the session goes on.
	if types, _ := c.option(99, nil); types[0] != wire.RepErrUnsup {
		t.Fatalf("unknown option answered %#x", types[0])
	}
	// LIST names the export.
	types, payloads := c.option(wire.OptList, nil)
	if types[0] != wire.RepServer || !bytes.Contains(payloads[0], []byte("disk")) || types[1] != wire.RepAck {
		t.Fatalf("LIST: %v %q", types, payloads)
	}
	// GO for a missing export: ERR_UNKNOWN.
	if types, _ := c.option(wire.OptGo, goData("nope")); types[len(types)-1] != wire.RepErrUnknown {
		t.Fatalf("GO nope: %v", types)
	}
	types, payloads = c.option(wire.OptGo, goData("disk"))
	var flags uint16
	var size uint64
	for i, p := range payloads {
		if types[i] == wire.RepInfo && be.Uint16(p) == wire.InfoExport {
			size, flags = be.Uint64(p[2:]), be.Uint16(p[10:])
		}
	}
	if size != 1<<20 || flags&wire.FlagReadOnly == 0 || flags&wire.FlagSendFlush == 0 || flags&wire.FlagSendTrim != 0 {
		t.Fatalf("GO: size %d flags %#x", size, flags)
	}
	// Simple replies: read, read past the end, write on a read-only export,
	// oversized read, unknown command.
	c.request(wire.CmdRead, 0, 1, 4096, 512, nil)
	if h, code, data := c.simpleReply(512); h != 1 || code != 0 || !bytes.Equal(data, make([]byte, 512)) {
		t.Fatalf("read: handle %d code %d", h, code)
	}
	c.request(wire.CmdRead, 0, 2, 1<<20-100, 512, nil)
	if _, code, _ := c.simpleReply(0); code != wire.EInval {
		t.Fatalf("read past the end: %d", code)
	}
	c.request(wire.CmdWrite, 0, 3, 0, 4, []byte("data"))
	if _, code, _ := c.simpleReply(0); code != wire.EPerm {
		t.Fatalf("write on a read-only export: %d", code)
	}
	c.request(wire.CmdRead, 0, 4, 0, maxRequest+1, nil)
	if _, code, _ := c.simpleReply(0); code != wire.EOverflow && code != wire.EInval {
		t.Fatalf("oversized read: %d", code)
	}
	c.request(42, 0, 5, 0, 0, nil)
	if _, code, _ := c.simpleReply(0); code != wire.EInval {
		t.Fatalf("unknown command: %d", code)
	}
	// A bad magic ends the connection; nothing panics.
	c.write(make([]byte, 28))
	if _, err := c.r.ReadByte(); err == nil {
		t.Fatal("connection still open after a bad request magic")
	}
}

func TestStructuredRepliesAndBlockStatus(t *testing.T) {
	c, _ := newPair(t, true)
	c.greet()
	// SET_META_CONTEXT before STRUCTURED_REPLY is refused.
	meta := metaAllocation("disk")
	if types, _ := c.option(wire.OptSetMetaContext, meta); types[0] != wire.RepErrInvalid {
		t.Fatalf("SET_META_CONTEXT before structured replies: %#x", types[0])
	}
	if types, _ := c.option(wire.OptStructuredReply, nil); types[0] != wire.RepAck {
		t.Fatal("STRUCTURED_REPLY refused")
	}
	types, payloads := c.option(wire.OptSetMetaContext, meta)
	if types[0] != wire.RepMetaContext || be.Uint32(payloads[0]) != baseAllocID {
		t.Fatalf("SET_META_CONTEXT: %v", types)
	}
	c.option(wire.OptGo, goData("disk"))
	c.request(wire.CmdBlockStatus, 0, 7, 0, 1<<20, nil)
	h := c.read(20)
	if be.Uint32(h) != wire.MagicStructured || be.Uint16(h[6:]) != wire.ChunkBlockStatus || be.Uint64(h[8:]) != 7 {
		t.Fatalf("block status chunk header %x", h)
	}
	p := c.read(int(be.Uint32(h[16:])))
	// A null device with zeroes: one hole+zero extent over everything.
	if be.Uint32(p) != baseAllocID || be.Uint32(p[4:]) != 1<<20 || be.Uint32(p[8:]) != wire.StateHole|wire.StateZero {
		t.Fatalf("block status payload %x", p)
	}
	// Success without data: a simple reply, as QEMU sends (the spec asks
	// structured replies only of reads and block status).
	c.request(wire.CmdWrite, wire.CmdFlagFUA, 8, 0, 3, []byte("abc"))
	if h, code, _ := c.simpleReply(0); h != 8 || code != 0 {
		t.Fatalf("write reply: handle %d code %d", h, code)
	}
	c.request(wire.CmdRead, 0, 9, 1<<20, 1, nil)
	h = c.read(20)
	p = c.read(int(be.Uint32(h[16:])))
	if be.Uint16(h[6:]) != wire.ChunkError || binary.BigEndian.Uint32(p) != wire.EInval {
		t.Fatalf("read past the end, structured: %x %x", h, p)
	}
	c.request(wire.CmdDisc, 0, 10, 0, 0, nil)
}

// chunk is one structured reply chunk as a test client sees it.
type chunk struct {
	flags, typ uint16
	off        uint64
	data       []byte // OFFSET_DATA content
	holeLen    uint32 // OFFSET_HOLE length
}

// readChunks reads the chunks of one structured reply, up to DONE.
func (c *client) readChunks(handle uint64) []chunk {
	c.t.Helper()
	var out []chunk
	for {
		h := c.read(20)
		if be.Uint32(h) != wire.MagicStructured || be.Uint64(h[8:]) != handle {
			c.t.Fatalf("chunk header %x", h)
		}
		ch := chunk{flags: be.Uint16(h[4:]), typ: be.Uint16(h[6:])}
		p := c.read(int(be.Uint32(h[16:])))
		switch ch.typ {
		case wire.ChunkOffsetData:
			ch.off, ch.data = be.Uint64(p), p[8:]
		case wire.ChunkOffsetHole:
			ch.off, ch.holeLen = be.Uint64(p), be.Uint32(p[8:])
		}
		out = append(out, ch)
		if ch.flags&wire.ChunkFlagDone != 0 {
			return out
		}
	}
}

// Reads send runs of zeroes as OFFSET_HOLE chunks (no payload), data as
// OFFSET_DATA; with DF the reply is one data chunk. Either way the client
// rebuilds exactly the image's bytes.
func TestSparseReads(t *testing.T) {
	path := filepath.Join(t.TempDir(), "img")
	want := make([]byte, 64<<10)
	copy(want[0:], bytes.Repeat([]byte("a"), 4096))         // data
	copy(want[3*4096:], bytes.Repeat([]byte("b"), 100))     // data at the start of a block
	want[6*4096-1] = 'c'                                    // one byte at the end of a block
	copy(want[12*4096:], bytes.Repeat([]byte("d"), 4*4096)) // data to the end
	if err := os.WriteFile(path, want, 0o644); err != nil {
		t.Fatal(err)
	}
	c, _ := newPairWith(t, openRaw(t, path, false), false)
	c.greet()
	c.option(wire.OptStructuredReply, nil)
	c.option(wire.OptGo, goData("disk"))

	rebuild := func(off uint64, n int, chunks []chunk) []byte {
		got := bytes.Repeat([]byte{0xee}, n) // no chunk may leave a gap
		for _, ch := range chunks {
			switch ch.typ {
			case wire.ChunkOffsetData:
				copy(got[ch.off-off:], ch.data)
			case wire.ChunkOffsetHole:
				clear(got[ch.off-off : ch.off-off+uint64(ch.holeLen)])
			default:
				t.Fatalf("unexpected chunk type %d", ch.typ)
			}
		}
		return got
	}
	// From offset 0, the whole image: blocks 0, 3, 5 and 12-15 hold data.
	c.request(wire.CmdRead, 0, 1, 0, uint32(len(want)), nil)
	chunks := c.readChunks(1)
	var kinds []uint16
	for _, ch := range chunks {
		kinds = append(kinds, ch.typ)
	}
	wantKinds := []uint16{wire.ChunkOffsetData, wire.ChunkOffsetHole, wire.ChunkOffsetData, wire.ChunkOffsetHole, wire.ChunkOffsetData, wire.ChunkOffsetHole, wire.ChunkOffsetData}
	if !slices.Equal(kinds, wantKinds) {
		t.Fatalf("chunk types %v, want %v", kinds, wantKinds)
	}
	if got := rebuild(0, len(want), chunks); !bytes.Equal(got, want) {
		t.Fatal("sparse read rebuilt other bytes than the image's")
	}
	// An unaligned read across a hole into data.
	off, n := uint64(5000), 3*4096+77
	c.request(wire.CmdRead, 0, 2, off, uint32(n), nil)
	if got := rebuild(off, n, c.readChunks(2)); !bytes.Equal(got, want[off:off+uint64(n)]) {
		t.Fatal("unaligned sparse read differs")
	}
	// All zeroes: one hole chunk.
	c.request(wire.CmdRead, 0, 3, 7*4096, 4*4096, nil)
	if ch := c.readChunks(3); len(ch) != 1 || ch[0].typ != wire.ChunkOffsetHole || ch[0].holeLen != 4*4096 || ch[0].off != 7*4096 {
		t.Fatalf("zero read: %+v", ch)
	}
	// DF: exactly one data chunk, zeroes included.
	c.request(wire.CmdRead, wire.CmdFlagDF, 4, 0, uint32(len(want)), nil)
	if ch := c.readChunks(4); len(ch) != 1 || ch[0].typ != wire.ChunkOffsetData || !bytes.Equal(ch[0].data, want) {
		t.Fatalf("DF read: %d chunks", len(ch))
	}
}

func TestZeroRun(t *testing.T) {
	z, d := make([]byte, holeGrain), bytes.Repeat([]byte{1}, holeGrain)
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	for _, tc := range []struct {
		name string
		p    []byte
		n    int
		zero bool
	}{
		{"short zero", make([]byte, 10), 10, true},
		{"short data", []byte{0, 0, 1}, 3, false},
		{"zeroes then data", cat(z, z, d), 2 * holeGrain, true},
		{"data then zeroes", cat(d, z), holeGrain, false},
		{"data, zero tail", cat(d, d, make([]byte, 5)), 2 * holeGrain, false},
		{"zeroes, data tail", cat(z, []byte{0, 7}), holeGrain, true},
	} {
		if n, zero := zeroRun(tc.p); n != tc.n || zero != tc.zero {
			t.Errorf("%s: zeroRun = %d, %v; want %d, %v", tc.name, n, zero, tc.n, tc.zero)
		}
	}
}

func TestShutdownFinishesAndCloses(t *testing.T) {
	c, s := newPair(t, true)
	c.greet()
	c.option(wire.OptGo, goData("disk"))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- s.Shutdown(ctx) }()
	if err := <-done; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if _, err := c.r.ReadByte(); err == nil {
		t.Fatal("connection still open after Shutdown")
	}
}

// FuzzServe feeds arbitrary client bytes to a connection: the handshake
// parser and request decoder must never panic or hang.
func FuzzServe(f *testing.F) {
	valid := be.AppendUint32(nil, wire.ClientFixed|wire.ClientNoZeroes)
	for _, opt := range [][]byte{
		append(append(be.AppendUint64(nil, wire.MagicOption), be.AppendUint32(be.AppendUint32(nil, wire.OptGo), 6)...), goData("")...),
		append(be.AppendUint64(nil, wire.MagicOption), be.AppendUint32(be.AppendUint32(nil, wire.OptList), 0)...),
	} {
		f.Add(append(append([]byte{}, valid...), opt...))
	}
	req := be.AppendUint32(nil, wire.MagicRequest)
	req = append(req, make([]byte, 24)...)
	f.Add(append(append(append([]byte{}, valid...), f2(goData(""))...), req...))
	// Extended headers, then a 32-byte write with its payload and a
	// block status of 64-bit length.
	ext := append(append([]byte{}, valid...), append(be.AppendUint64(nil, wire.MagicOption), be.AppendUint32(be.AppendUint32(nil, wire.OptExtendedHeaders), 0)...)...)
	ext = append(ext, f2(goData(""))...)
	for _, r := range []struct {
		typ, flags uint16
		length     uint64
		payload    string
	}{{wire.CmdWrite, wire.CmdFlagPayloadLen, 4, "data"}, {wire.CmdBlockStatus, 0, 1 << 40, ""}} {
		h := be.AppendUint32(nil, wire.MagicExtendedRequest)
		h = be.AppendUint16(be.AppendUint16(h, r.flags), r.typ)
		h = be.AppendUint64(be.AppendUint64(be.AppendUint64(h, 1), 0), r.length)
		ext = append(append(ext, h...), r.payload...)
	}
	f.Add(ext)
	// Meta contexts: structured replies, a LIST and a SET of queries
	// (exact, a namespace leaf, one unknown, one over NBD_MAX_STRING_SIZE
	// said to be short), then a block status of both contexts.
	meta := append([]byte{}, valid...)
	meta = append(meta, option(wire.OptStructuredReply, nil)...)
	meta = append(meta, option(wire.OptListMetaContext, metaQueries("", "qemu:"))...)
	meta = append(meta, option(wire.OptSetMetaContext, metaQueries("", "base:allocation", "qemu:dirty-bitmap:bm0", "qemu:allocation-depth", "nope:x"))...)
	meta = append(meta, f2(goData(""))...)
	bs := be.AppendUint32(nil, wire.MagicRequest)
	bs = be.AppendUint16(be.AppendUint16(bs, 0), wire.CmdBlockStatus)
	bs = be.AppendUint32(be.AppendUint64(be.AppendUint64(bs, 7), 4096), 1<<20-4096)
	f.Add(append(meta, bs...))
	lying := append([]byte{}, valid...)
	lying = append(lying, option(wire.OptSetMetaContext, be.AppendUint32(metaQueries("", "qemu:"), 1<<31))...)
	f.Add(lying)
	fuzzMeta := []MetaContext{
		{Name: "qemu:dirty-bitmap:bm0", Extent: func(_ context.Context, off, n int64) (int64, uint32, error) {
			return min(n, 65536-off%65536), uint32(off>>16) & 1, nil
		}},
		{Name: "qemu:allocation-depth", Extent: func(_ context.Context, off, n int64) (int64, uint32, error) { return n, 1, nil }},
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		img, _ := null.New("null", 1<<20, true)
		s := New(img, Options{Writable: true, Meta: fuzzMeta})
		a, b := net.Pipe()
		cn := newConn(s, pipeStream(t, a), s.log)
		done := make(chan struct{})
		go func() { cn.serve(); close(done) }()
		go io.Copy(io.Discard, b)
		b.SetDeadline(time.Now().Add(2 * time.Second))
		b.Write(in)
		b.Close()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatal("connection did not end after the client went away")
		}
	})
}

// f2 wraps GO option data in an option header for the fuzz seeds.
// option is one option of the handshake's option phase.
func option(opt uint32, data []byte) []byte {
	h := be.AppendUint64(nil, wire.MagicOption)
	h = be.AppendUint32(h, opt)
	h = be.AppendUint32(h, uint32(len(data)))
	return append(h, data...)
}

// metaQueries is a LIST/SET_META_CONTEXT option's data: the export name,
// then the queries.
func metaQueries(export string, queries ...string) []byte {
	d := be.AppendUint32(nil, uint32(len(export)))
	d = append(d, export...)
	d = be.AppendUint32(d, uint32(len(queries)))
	for _, q := range queries {
		d = be.AppendUint32(d, uint32(len(q)))
		d = append(d, q...)
	}
	return d
}

func f2(data []byte) []byte { return option(wire.OptGo, data) }

// extRequest sends a request with the extended header: the numbers are
// the EXTENDED_HEADERS extension's (doc/proto.md on the NBD project's
// extension-ext-header branch), written out here rather than taken from
// wire, so that a wrong constant there fails this test.
func (c *client) extRequest(typ, flags uint16, cookie, off, length uint64, payload []byte) {
	c.t.Helper()
	h := be.AppendUint32(nil, 0x21e41c71)
	h = be.AppendUint16(h, flags)
	h = be.AppendUint16(h, typ)
	h = be.AppendUint64(h, cookie)
	h = be.AppendUint64(h, off)
	h = be.AppendUint64(h, length)
	c.write(append(h, payload...))
}

// extReply reads one extended reply chunk: flags, type, offset, payload.
func (c *client) extReply(cookie uint64) (flags, typ uint16, off uint64, payload []byte) {
	c.t.Helper()
	h := c.read(32)
	if be.Uint32(h) != 0x6e8a278c || be.Uint64(h[8:]) != cookie {
		c.t.Fatalf("extended reply header %x (cookie %d)", h, cookie)
	}
	n := be.Uint64(h[24:])
	if n > 1<<20 {
		c.t.Fatalf("extended reply of %d bytes", n)
	}
	return be.Uint16(h[4:]), be.Uint16(h[6:]), be.Uint64(h[16:]), c.read(int(n))
}

// TestExtendedHeaders: NBD_OPT_EXTENDED_HEADERS (11) is taken; from then
// on requests have 32-byte headers with 64-bit lengths, and every reply,
// success without data included, is an extended chunk that repeats the
// request's offset. Block status comes as BLOCK_STATUS_EXT (6) with 64-bit
// descriptors, so one extent can cover more than 4 GiB; a WRITE must carry
// PAYLOAD_LEN (1<<5), and structured replies cannot be asked for after.
func TestExtendedHeaders(t *testing.T) {
	const size = 8 << 30
	path := filepath.Join(t.TempDir(), "img")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(size)
	f.Close()
	c, _ := newPairWith(t, openRaw(t, path, true), true)
	c.greet()
	if types, _ := c.option(11, []byte{1}); types[0] != wire.RepErrInvalid {
		t.Fatalf("EXTENDED_HEADERS with data: %#x", types[0])
	}
	if types, _ := c.option(11, nil); types[0] != wire.RepAck {
		t.Fatalf("EXTENDED_HEADERS: %#x", types[0])
	}
	if types, _ := c.option(wire.OptStructuredReply, nil); types[0] != 10|1<<31 {
		t.Fatalf("STRUCTURED_REPLY after extended headers: %#x, want NBD_REP_ERR_EXT_HEADER_REQD", types[0])
	}
	meta := metaAllocation("disk")
	if types, _ := c.option(wire.OptSetMetaContext, meta); types[0] != wire.RepMetaContext {
		t.Fatalf("SET_META_CONTEXT under extended headers: %#x", types[0])
	}
	c.option(wire.OptGo, goData("disk"))

	// A write at 5 GiB: its length is the payload's, flagged so.
	c.extRequest(wire.CmdWrite, 1<<5, 1, 5<<30, 4, []byte("data"))
	if flags, typ, off, p := c.extReply(1); flags&wire.ChunkFlagDone == 0 || typ != wire.ChunkNone || off != 5<<30 || len(p) != 0 {
		t.Fatalf("write reply: flags %d type %d offset %d payload %x", flags, typ, off, p)
	}
	c.extRequest(wire.CmdRead, 0, 2, 5<<30, 4, nil)
	if flags, typ, off, p := c.extReply(2); flags&wire.ChunkFlagDone == 0 || typ != wire.ChunkOffsetData || off != 5<<30 ||
		be.Uint64(p) != 5<<30 || string(p[8:]) != "data" {
		t.Fatalf("read reply: flags %d type %d offset %d payload %q", flags, typ, off, p)
	}
	// A WRITE without PAYLOAD_LEN has no payload to read: refused, and
	// the stream stays in step.
	c.extRequest(wire.CmdWrite, 0, 3, 0, 4, nil)
	if _, typ, _, p := c.extReply(3); typ != wire.ChunkError || be.Uint32(p) != wire.EInval {
		t.Fatalf("WRITE without PAYLOAD_LEN: type %d payload %x", typ, p)
	}
	// A payload on a command that takes none is skipped, then refused.
	c.extRequest(wire.CmdFlush, 1<<5, 4, 0, 3, []byte("xyz"))
	if _, typ, _, p := c.extReply(4); typ != wire.ChunkError || be.Uint32(p) != wire.EInval {
		t.Fatalf("FLUSH with a payload: type %d payload %x", typ, p)
	}
	// Block status from 0: one hole of 5 GiB, in one 64-bit descriptor.
	c.extRequest(wire.CmdBlockStatus, wire.CmdFlagReqOne, 5, 0, size, nil)
	_, typ, _, p := c.extReply(5)
	if typ != 6 || len(p) != 8+16 || be.Uint32(p) != baseAllocID || be.Uint32(p[4:]) != 1 {
		t.Fatalf("block status: type %d payload %x", typ, p)
	}
	if l, st := be.Uint64(p[8:]), be.Uint64(p[16:]); l != 5<<30 || st&uint64(wire.StateHole) == 0 {
		t.Fatalf("block status extent: %d bytes, status %#x; want a 5 GiB hole", l, st)
	}
	// Zeroing all 8 GiB in one request: a 64-bit effect length.
	c.extRequest(wire.CmdWriteZeroes, 0, 6, 0, size, nil)
	if _, typ, off, _ := c.extReply(6); typ != wire.ChunkNone || off != 0 {
		t.Fatalf("WRITE_ZEROES of 8 GiB: type %d offset %d", typ, off)
	}
	c.extRequest(wire.CmdRead, 0, 7, 5<<30, 4, nil)
	if _, typ, _, p := c.extReply(7); typ != wire.ChunkOffsetHole || be.Uint32(p[8:]) != 4 {
		t.Fatalf("read after zeroing: type %d payload %x", typ, p)
	}
	// A compact header now (padded to the 32 bytes read) is out of
	// step: the server hangs up.
	c.request(wire.CmdFlush, 0, 8, 0, 0, make([]byte, 4))
	c.c.SetDeadline(time.Now().Add(2 * time.Second))
	if b, err := c.r.ReadByte(); err != io.EOF {
		t.Fatalf("a compact request under extended headers: read %#x, %v; want the server to hang up", b, err)
	}
}

// TestExportNameAfterExtendedHeaders: EXPORT_NAME cannot confirm the
// headers, and the spec forbids it once they are on: the server hangs up
// rather than enter transmission.
func TestExportNameAfterExtendedHeaders(t *testing.T) {
	c, _ := newPair(t, false)
	c.greet()
	c.option(11, nil)
	h := be.AppendUint64(nil, wire.MagicOption)
	h = be.AppendUint32(h, wire.OptExportName)
	h = be.AppendUint32(h, 4)
	c.write(append(h, "disk"...))
	c.c.SetDeadline(time.Now().Add(2 * time.Second))
	if b, err := c.r.ReadByte(); err != io.EOF {
		t.Fatalf("EXPORT_NAME after extended headers: read %#x, %v; want the server to hang up", b, err)
	}
}

// TestReplyFormatOptionsRefused: STRUCTURED_REPLY with data is invalid,
// and a server with CompactHeaders turns EXTENDED_HEADERS down; either
// way the negotiation goes on and structured replies can still be had.
func TestReplyFormatOptionsRefused(t *testing.T) {
	c, s := newPair(t, false)
	s.opts.CompactHeaders = true // before the first option reaches the server
	c.greet()
	if types, payloads := c.option(wire.OptStructuredReply, []byte{1}); types[0] != wire.RepErrInvalid ||
		string(payloads[0]) != "STRUCTURED_REPLY takes no data" {
		t.Fatalf("STRUCTURED_REPLY with data: %#x %q", types[0], payloads[0])
	}
	if types, _ := c.option(wire.OptExtendedHeaders, nil); types[0] != wire.RepErrUnsup {
		t.Fatalf("EXTENDED_HEADERS with CompactHeaders: %#x, want NBD_REP_ERR_UNSUP", types[0])
	}
	if types, _ := c.option(wire.OptStructuredReply, nil); types[0] != wire.RepAck {
		t.Fatalf("STRUCTURED_REPLY after the refusals: %#x", types[0])
	}
}
