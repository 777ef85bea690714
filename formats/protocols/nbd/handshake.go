package nbd

import (
	"bufio"
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/blockexport/blockexport/aio/sock"
	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
)

// exportInfo is what the handshake learnt about the export.
type exportInfo struct {
	size        int64
	flags       uint16 // transmission flags
	minBlock    uint32 // requests are aligned to this
	prefBlock   uint32
	maxBlock    uint32 // the largest payload
	structured  bool   // structured replies
	extended    bool   // extended headers: 64-bit lengths (structured too)
	allocCtx    uint32 // base:allocation's context id, when hasAlloc
	hasAlloc    bool
	description string
	tls         bool
}

var errTLSRequired = errors.New("the server requires TLS (use an nbds:// URI)")

// handshakeTimeout bounds a handshake a silent server would stall.
const handshakeTimeout = 30 * time.Second

// maxOptReply bounds an option reply's payload.
const maxOptReply = 64 << 10

// dialer opens connections to one export.
type dialer struct {
	addr Address
	tls  *tls.Config // nil: plain text
}

// dial connects and runs the fixed-newstyle handshake: STARTTLS first when
// TLS is asked for, then extended headers (else structured replies),
// base:allocation, and GO with the block sizes. The handshake runs through
// the netpoller with a deadline; the requests then use a sock.Stream.
func (d *dialer) dial(ctx context.Context) (sock.Stream, exportInfo, error) {
	var nd net.Dialer
	nc, err := nd.DialContext(ctx, d.addr.Network, d.addr.Addr)
	if err != nil {
		return nil, exportInfo{}, fmt.Errorf("nbd: connect to %s: %w", d.addr.URI, err)
	}
	deadline := time.Now().Add(handshakeTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	nc.SetDeadline(deadline)
	h := &handshaker{nc: nc, r: bufio.NewReader(nc), export: d.addr.Export}
	info, err := h.run(d.tls)
	if err == nil && h.r.Buffered() > 0 {
		err = errors.New("the server sent data after the handshake")
	}
	var s sock.Stream
	if err == nil {
		h.nc.SetDeadline(time.Time{})
		// Replies are read only while a request waits for one, so the
		// descriptor may block: one read(2) per wait instead of a read, a
		// poll and a read. No spinning: on 2 cores a spin took the CPU the
		// server needed (docs/design.md, NBD sources: a blocking socket).
		s, err = sock.NewBlocking(h.nc)
	}
	if err != nil {
		h.nc.Close()
		return nil, exportInfo{}, fmt.Errorf("nbd: %s: %w", d.addr.URI, err)
	}
	return s, info, nil
}

// handshaker is one handshake's state.
type handshaker struct {
	nc       net.Conn
	r        *bufio.Reader
	export   string
	noZeroes bool // the server leaves out EXPORT_NAME's 124 zero bytes
}

func (h *handshaker) run(tlsConf *tls.Config) (exportInfo, error) {
	var info exportInfo
	var greet [18]byte
	if _, err := io.ReadFull(h.r, greet[:]); err != nil {
		return info, fmt.Errorf("reading the greeting: %w", err)
	}
	if be.Uint64(greet[0:]) != wire.MagicOldstyle {
		return info, errors.New("not an NBD server (bad magic)")
	}
	if be.Uint64(greet[8:]) != wire.MagicOption {
		return info, errors.New("the server speaks the oldstyle protocol, which has no export names or TLS; fixed newstyle is required")
	}
	sflags := be.Uint16(greet[16:])
	if sflags&wire.HandshakeFixed == 0 {
		return info, errors.New("the server does not speak fixed newstyle")
	}
	cflags := wire.ClientFixed
	if sflags&wire.HandshakeNoZeroes != 0 {
		cflags |= wire.ClientNoZeroes
		h.noZeroes = true
	}
	if _, err := h.nc.Write(be.AppendUint32(nil, cflags)); err != nil {
		return info, err
	}
	if tlsConf != nil {
		if err := h.startTLS(tlsConf); err != nil {
			return info, err
		}
		info.tls = true
	}
	// Extended headers first: where the server has them they replace
	// structured replies, and zeroing, trimming and block status then
	// take a whole range in one request.
	for _, opt := range []uint32{wire.OptExtendedHeaders, wire.OptStructuredReply} {
		typ, _, err := h.option(opt, nil)
		if err != nil {
			return info, err
		}
		if typ == wire.RepErrTLSReqd {
			return info, errTLSRequired
		}
		if typ == wire.RepAck {
			info.extended, info.structured = opt == wire.OptExtendedHeaders, true
			break
		}
	}
	if info.structured {
		if err := h.metaContext(&info); err != nil {
			return info, err
		}
	}
	return info, h.goExport(&info)
}

// startTLS asks for TLS and runs the TLS handshake over the connection;
// everything after it is encrypted.
func (h *handshaker) startTLS(conf *tls.Config) error {
	typ, msg, err := h.option(wire.OptStartTLS, nil)
	if err != nil {
		return err
	}
	if typ != wire.RepAck {
		return fmt.Errorf("the server refused TLS (%s)", repError(typ, msg))
	}
	if h.r.Buffered() > 0 {
		return errors.New("the server sent data before the TLS handshake")
	}
	tc := tls.Client(h.nc, conf)
	if err := tc.Handshake(); err != nil {
		return fmt.Errorf("TLS handshake: %w", err)
	}
	h.nc, h.r = tc, bufio.NewReader(tc)
	return nil
}

// named is an option's payload that begins with the export's name.
func (h *handshaker) named() []byte {
	return append(be.AppendUint32(nil, uint32(len(h.export))), h.export...)
}

// metaContext selects base:allocation, if the server has it.
func (h *handshaker) metaContext(info *exportInfo) error {
	p := be.AppendUint32(h.named(), 1)
	p = be.AppendUint32(p, uint32(len(wire.BaseAllocation)))
	p = append(p, wire.BaseAllocation...)
	if err := h.send(wire.OptSetMetaContext, p); err != nil {
		return err
	}
	for {
		typ, data, err := h.reply(wire.OptSetMetaContext)
		if err != nil {
			return err
		}
		switch {
		case typ == wire.RepMetaContext:
			if len(data) >= 4 && string(data[4:]) == wire.BaseAllocation {
				info.allocCtx, info.hasAlloc = be.Uint32(data), true
			}
		case typ == wire.RepAck, typ&wire.RepFlagError != 0:
			return nil // without it, everything reads as data
		default:
			return fmt.Errorf("unexpected reply %#x to SET_META_CONTEXT", typ)
		}
	}
}

// goExport picks the export with GO (EXPORT_NAME on servers without it).
func (h *handshaker) goExport(info *exportInfo) error {
	p := be.AppendUint16(h.named(), 2)
	p = be.AppendUint16(p, wire.InfoBlockSize)
	p = be.AppendUint16(p, wire.InfoDescription)
	if err := h.send(wire.OptGo, p); err != nil {
		return err
	}
	info.minBlock, info.prefBlock, info.maxBlock = 1, wire.DefaultPrefBlock, wire.DefaultMaxBlock
	gotExport := false
	for {
		typ, data, err := h.reply(wire.OptGo)
		if err != nil {
			return err
		}
		switch {
		case typ == wire.RepInfo:
			if err := parseInfo(info, data, &gotExport); err != nil {
				return err
			}
		case typ == wire.RepAck:
			if !gotExport {
				return errors.New("the server finished GO without the export's size")
			}
			return checkBlockSizes(info)
		case typ == wire.RepErrUnsup && !info.extended:
			return h.exportName(info)
		case typ == wire.RepErrUnsup:
			return errors.New("the server agreed to extended headers but has no GO, which they require")
		case typ == wire.RepErrUnknown:
			return fmt.Errorf("no export named %q on the server (%s)", h.export, repError(typ, data))
		case typ == wire.RepErrTLSReqd:
			return errTLSRequired
		case typ&wire.RepFlagError != 0:
			return fmt.Errorf("the server refused export %q: %s", h.export, repError(typ, data))
		default:
			return fmt.Errorf("unexpected reply %#x to GO", typ)
		}
	}
}

// parseInfo takes one NBD_REP_INFO.
func parseInfo(info *exportInfo, data []byte, gotExport *bool) error {
	if len(data) < 2 {
		return errors.New("short INFO reply")
	}
	switch be.Uint16(data) {
	case wire.InfoExport:
		if len(data) != 12 {
			return errors.New("bad INFO_EXPORT reply")
		}
		size := be.Uint64(data[2:])
		if size > 1<<62 {
			return fmt.Errorf("export size %d is absurd", size)
		}
		info.size, info.flags, *gotExport = int64(size), be.Uint16(data[10:]), true
	case wire.InfoBlockSize:
		if len(data) != 14 {
			return errors.New("bad INFO_BLOCK_SIZE reply")
		}
		info.minBlock, info.prefBlock, info.maxBlock = be.Uint32(data[2:]), be.Uint32(data[6:]), be.Uint32(data[10:])
	case wire.InfoDescription:
		info.description = string(data[2:min(len(data), 2+wire.MaxStringLen)])
	}
	return nil
}

// checkBlockSizes refuses constraints the spec rules out: powers of two,
// minimum at most 64 KiB, preferred at least the minimum, maximum a
// multiple of the minimum.
func checkBlockSizes(info *exportInfo) error {
	pow2 := func(v uint32) bool { return v != 0 && v&(v-1) == 0 }
	if !pow2(info.minBlock) || info.minBlock > 64<<10 || !pow2(info.prefBlock) || info.prefBlock < info.minBlock ||
		info.maxBlock < info.minBlock || info.maxBlock%info.minBlock != 0 {
		return fmt.Errorf("the server's block sizes make no sense: minimum %d, preferred %d, maximum %d",
			info.minBlock, info.prefBlock, info.maxBlock)
	}
	if info.size%int64(info.minBlock) != 0 {
		return fmt.Errorf("export size %d is not a multiple of its minimum block size %d", info.size, info.minBlock)
	}
	return nil
}

// exportName is the old way to pick an export: no reply on failure (the
// server just closes), the size and flags on success.
func (h *handshaker) exportName(info *exportInfo) error {
	if err := h.send(wire.OptExportName, []byte(h.export)); err != nil {
		return err
	}
	var b [10]byte
	if _, err := io.ReadFull(h.r, b[:]); err != nil {
		return fmt.Errorf("the server closed the connection on export %q (no such export?): %w", h.export, err)
	}
	info.size, info.flags = int64(be.Uint64(b[:])), be.Uint16(b[8:])
	if !h.noZeroes {
		if _, err := io.CopyN(io.Discard, h.r, 124); err != nil {
			return fmt.Errorf("reading EXPORT_NAME's padding: %w", err)
		}
	}
	if info.size < 0 {
		return fmt.Errorf("export size %d is absurd", uint64(info.size))
	}
	return nil
}

// option sends an option that has one reply and returns it.
func (h *handshaker) option(opt uint32, data []byte) (uint32, []byte, error) {
	if err := h.send(opt, data); err != nil {
		return 0, nil, err
	}
	return h.reply(opt)
}

func (h *handshaker) send(opt uint32, data []byte) error {
	b := be.AppendUint32(be.AppendUint32(be.AppendUint64(nil, wire.MagicOption), opt), uint32(len(data)))
	_, err := h.nc.Write(append(b, data...))
	return err
}

// reply reads one option reply to opt.
func (h *handshaker) reply(opt uint32) (uint32, []byte, error) {
	var hdr [20]byte
	if _, err := io.ReadFull(h.r, hdr[:]); err != nil {
		return 0, nil, fmt.Errorf("reading the reply to option %d: %w", opt, err)
	}
	if be.Uint64(hdr[0:]) != wire.MagicReply {
		return 0, nil, fmt.Errorf("bad option reply magic %#x", be.Uint64(hdr[0:]))
	}
	if got := be.Uint32(hdr[8:]); got != opt {
		return 0, nil, fmt.Errorf("reply to option %d while waiting for %d", got, opt)
	}
	typ, n := be.Uint32(hdr[12:]), be.Uint32(hdr[16:])
	if n > maxOptReply {
		return 0, nil, fmt.Errorf("option reply of %d bytes", n)
	}
	data := make([]byte, n)
	if _, err := io.ReadFull(h.r, data); err != nil {
		return 0, nil, fmt.Errorf("reading the reply to option %d: %w", opt, err)
	}
	return typ, data, nil
}

// repError words an option error reply.
func repError(typ uint32, msg []byte) string {
	name := map[uint32]string{
		wire.RepErrUnsup: "unsupported", wire.RepErrPolicy: "refused by policy", wire.RepErrInvalid: "invalid",
		wire.RepErrPlatform: "not on this platform", wire.RepErrTLSReqd: "TLS required", wire.RepErrUnknown: "unknown export",
		wire.RepErrShutdown: "shutting down", wire.RepErrBlockReqd: "block size required", wire.RepErrTooBig: "too big",
	}[typ]
	name = cmp.Or(name, fmt.Sprintf("reply %#x", typ))
	if len(msg) > 0 {
		return fmt.Sprintf("%s: %.200s", name, msg)
	}
	return name
}
