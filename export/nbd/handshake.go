package nbd

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/blockexport/blockexport/formats/protocols/nbd/wire"
)

// negotiated is what the handshake settled.
type negotiated struct {
	structured bool          // structured replies
	extended   bool          // extended headers (structured is then set too)
	meta       metaSelection // the meta contexts SET_META_CONTEXT selected
}

var be = binary.BigEndian

// negotiate runs the fixed-newstyle negotiation until the client picks
// the export (GO or EXPORT_NAME). Malformed input ends the connection with
// an error; unknown options are answered "unsupported", as the spec asks.
// *rp becomes the reader the transmission phase reads from: a new one
// after STARTTLS.
func (c *conn) negotiate(rp **bufio.Reader) (negotiated, error) {
	var n negotiated
	r := *rp
	mode := c.srv.opts.TLSMode
	if c.srv.opts.TLS == nil {
		mode = TLSOff
	}
	encrypted := false
	noZeroes, err := c.greet(r)
	if err != nil {
		return n, err
	}
	for {
		id, data, body, err := readOption(r)
		if err != nil {
			return n, err
		}
		if body != nil {
			// A meta context option, read query by query as qemu-nbd
			// reads it: a thousand queries are no abuse.
			switch {
			case mode == TLSRequire && !encrypted:
				err = c.dropOption(id, body, wire.RepErrTLSReqd, "TLS is required: send NBD_OPT_STARTTLS first")
			case id == wire.OptSetMetaContext && !n.structured:
				err = c.dropOption(id, body, wire.RepErrInvalid, "SET_META_CONTEXT needs structured replies first")
			default:
				sel, code, merr := c.metaContext(id, body)
				if _, err = io.Copy(io.Discard, body); err == nil && merr != nil {
					c.optReply(id, code, []byte(merr.Error()))
				} else if err == nil && id == wire.OptSetMetaContext {
					n.meta = sel
				}
			}
			if err != nil {
				return n, fmt.Errorf("option %d: %w", id, err)
			}
			continue
		}
		if mode == TLSRequire && !encrypted && id != wire.OptStartTLS && id != wire.OptAbort {
			if id == wire.OptExportName {
				// It has no error reply: the spec says to hang up.
				return n, errors.New("client asked for an export in plain text; TLS is required")
			}
			c.optReply(id, wire.RepErrTLSReqd, []byte("TLS is required: send NBD_OPT_STARTTLS first"))
			continue
		}
		switch id {
		case wire.OptExportName:
			return n, c.exportName(data, n.extended, noZeroes)
		case wire.OptAbort:
			c.optReply(id, wire.RepAck, nil)
			return n, errAbort
		case wire.OptList:
			c.list(data)
		case wire.OptInfo, wire.OptGo:
			done, err := c.infoGo(id, data)
			if err != nil || done {
				return n, err
			}
		case wire.OptStructuredReply:
			switch {
			case len(data) != 0:
				c.optReply(id, wire.RepErrInvalid, []byte("STRUCTURED_REPLY takes no data"))
			case n.extended:
				c.optReply(id, wire.RepErrExtHdrReqd, []byte("extended headers are on; they cannot go back to structured replies"))
			default:
				n.structured = true
				c.optReply(id, wire.RepAck, nil)
			}
		case wire.OptExtendedHeaders:
			switch {
			case c.srv.opts.CompactHeaders:
				c.optReply(id, wire.RepErrUnsup, nil)
			case len(data) != 0:
				c.optReply(id, wire.RepErrInvalid, []byte("EXTENDED_HEADERS takes no data"))
			default:
				// Extended headers take the place of structured replies.
				n.extended, n.structured = true, true
				c.optReply(id, wire.RepAck, nil)
			}
		case wire.OptStartTLS:
			switch {
			case mode == TLSOff:
				c.optReply(id, wire.RepErrPolicy, []byte("TLS is not offered"))
			case encrypted:
				c.optReply(id, wire.RepErrInvalid, []byte("TLS is on already"))
			case len(data) != 0:
				c.optReply(id, wire.RepErrInvalid, []byte("STARTTLS takes no data"))
			default:
				c.optReply(id, wire.RepAck, nil)
				nr, err := c.startTLS(r)
				if err != nil {
					return n, err
				}
				r, *rp, encrypted = nr, nr, true
				// What was negotiated in plain text does not carry over
				// (the spec: a client must negotiate again).
				n = negotiated{}
			}
		default:
			c.optReply(id, wire.RepErrUnsup, nil)
		}
	}
}

// greet sends the server's greeting and reads the client's flags;
// noZeroes: the client takes EXPORT_NAME's reply without its padding.
func (c *conn) greet(r *bufio.Reader) (noZeroes bool, err error) {
	var hdr [18]byte
	be.PutUint64(hdr[0:], wire.MagicOldstyle)
	be.PutUint64(hdr[8:], wire.MagicOption)
	be.PutUint16(hdr[16:], wire.HandshakeFixed|wire.HandshakeNoZeroes)
	if _, err := c.sock.Write(hdr[:]); err != nil {
		return false, err
	}
	var cf [4]byte
	if _, err := io.ReadFull(r, cf[:]); err != nil {
		return false, fmt.Errorf("client flags: %w", err)
	}
	clientFlags := be.Uint32(cf[:])
	if clientFlags&^(wire.ClientFixed|wire.ClientNoZeroes) != 0 {
		return false, fmt.Errorf("unknown client flags %#x", clientFlags)
	}
	return clientFlags&wire.ClientNoZeroes != 0, nil
}

// readOption reads one option: its id and data, checked for magic and
// length. A LIST/SET_META_CONTEXT comes back unread as body instead, of
// any length, for the caller to read and then drain.
func readOption(r *bufio.Reader) (uint32, []byte, io.Reader, error) {
	var oh [16]byte
	if _, err := io.ReadFull(r, oh[:]); err != nil {
		return 0, nil, nil, fmt.Errorf("option header: %w", err)
	}
	id, n := be.Uint32(oh[8:]), be.Uint32(oh[12:])
	if magic := be.Uint64(oh[0:]); magic != wire.MagicOption {
		return 0, nil, nil, fmt.Errorf("bad option magic %#x", magic)
	}
	if id == wire.OptListMetaContext || id == wire.OptSetMetaContext {
		return id, nil, io.LimitReader(r, int64(n)), nil
	}
	if n > maxOptionLen {
		return 0, nil, nil, fmt.Errorf("option %d of %d bytes is too long", id, n)
	}
	data := make([]byte, n)
	if _, err := io.ReadFull(r, data); err != nil {
		return 0, nil, nil, fmt.Errorf("option %d: %w", id, err)
	}
	return id, data, nil, nil
}

// dropOption reads the rest of an option and answers it with an error.
func (c *conn) dropOption(id uint32, rest io.Reader, code uint32, msg string) error {
	if _, err := io.Copy(io.Discard, rest); err != nil {
		return err
	}
	c.optReply(id, code, []byte(msg))
	return nil
}

// exportName answers EXPORT_NAME, which ends the negotiation.
func (c *conn) exportName(name []byte, extended, noZeroes bool) error {
	if extended {
		// It has no error reply, and its answer no way to confirm the
		// headers: the spec forbids it here.
		return errors.New("client asked for an export with EXPORT_NAME after extended headers")
	}
	e, ok := c.srv.export(string(name))
	if !ok {
		return fmt.Errorf("client asked for unknown export %q", name)
	}
	c.srv.choose(c, e)
	reply := make([]byte, 10, 134)
	be.PutUint64(reply[0:], uint64(c.img.Size()))
	be.PutUint16(reply[8:], transmissionFlags(e.Writable))
	if !noZeroes {
		reply = append(reply, make([]byte, 124)...)
	}
	_, err := c.sock.Write(reply)
	return err
}

// list answers LIST: every export's name and description.
func (c *conn) list(data []byte) {
	if len(data) != 0 {
		c.optReply(wire.OptList, wire.RepErrInvalid, []byte("LIST takes no data"))
		return
	}
	for _, e := range c.srv.exports() {
		payload := be.AppendUint32(nil, uint32(len(e.Name)))
		payload = append(payload, e.Name...)
		payload = append(payload, e.Description...)
		c.optReply(wire.OptList, wire.RepServer, payload)
	}
	c.optReply(wire.OptList, wire.RepAck, nil)
}

// infoGo answers INFO and GO. It returns done when GO succeeded.
func (c *conn) infoGo(id uint32, data []byte) (bool, error) {
	if len(data) < 6 {
		c.optReply(id, wire.RepErrInvalid, []byte("short INFO/GO request"))
		return false, nil
	}
	nameLen := be.Uint32(data)
	if uint64(nameLen)+6 > uint64(len(data)) {
		c.optReply(id, wire.RepErrInvalid, []byte("bad name length"))
		return false, nil
	}
	name := string(data[4 : 4+nameLen])
	rest := data[4+nameLen:]
	nreq := int(be.Uint16(rest))
	if len(rest) != 2+2*nreq {
		c.optReply(id, wire.RepErrInvalid, []byte("bad information request list"))
		return false, nil
	}
	e, ok := c.srv.export(name)
	if !ok {
		c.optReply(id, wire.RepErrUnknown, []byte(fmt.Sprintf("no export named %q", name)))
		return false, nil
	}
	wants := map[uint16]bool{}
	for i := 0; i < nreq; i++ {
		wants[be.Uint16(rest[2+2*i:])] = true
	}
	if wants[wire.InfoName] {
		c.optReply(id, wire.RepInfo, append(be.AppendUint16(nil, wire.InfoName), name...))
	}
	if wants[wire.InfoDescription] && e.Description != "" {
		c.optReply(id, wire.RepInfo, append(be.AppendUint16(nil, wire.InfoDescription), e.Description...))
	}
	// Block sizes are always sent: they are constraints we rely on.
	p := be.AppendUint16(nil, wire.InfoBlockSize)
	p = be.AppendUint32(p, minBlock)
	p = be.AppendUint32(p, preferredBlock)
	p = be.AppendUint32(p, maxRequest)
	c.optReply(id, wire.RepInfo, p)
	p = be.AppendUint16(nil, wire.InfoExport)
	p = be.AppendUint64(p, uint64(e.Image.Size()))
	p = be.AppendUint16(p, transmissionFlags(e.Writable))
	c.optReply(id, wire.RepInfo, p)
	if id == wire.OptGo {
		// Before the ACK: once the client has it, Server.Remove must
		// see it as the export's user.
		c.srv.choose(c, e)
	}
	c.optReply(id, wire.RepAck, nil)
	return id == wire.OptGo, nil
}

// metaContext answers LIST/SET_META_CONTEXT as qemu-nbd does
// (matchQuery), reading the option's data from r one query at a time, so
// that memory does not grow with the option; it returns what was
// selected, or the error reply's code and message. On an error the
// caller drains r.
func (c *conn) metaContext(id uint32, r io.Reader) (metaSelection, uint32, error) {
	var sel metaSelection
	var word [4]byte
	u32 := func() (uint32, bool) {
		if _, err := io.ReadFull(r, word[:]); err != nil {
			return 0, false
		}
		return be.Uint32(word[:]), true
	}
	nameLen, ok := u32()
	if !ok {
		return sel, wire.RepErrInvalid, fmt.Errorf("short meta context request")
	}
	if nameLen > maxQueryLen {
		return sel, wire.RepErrInvalid, fmt.Errorf("bad export name length")
	}
	name := make([]byte, nameLen)
	if _, err := io.ReadFull(r, name); err != nil {
		return sel, wire.RepErrInvalid, fmt.Errorf("bad export name length")
	}
	exportName := string(name)
	e, ok := c.srv.export(exportName)
	if !ok {
		return sel, wire.RepErrUnknown, fmt.Errorf("export %q not present", exportName)
	}
	nq, ok := u32()
	if !ok {
		return sel, wire.RepErrInvalid, fmt.Errorf("short meta context request")
	}
	metas := e.Meta
	sel.extra = make([]bool, len(metas))
	list := id == wire.OptListMetaContext
	if list && nq == 0 {
		// List everything we have.
		sel.base = true
		for i := range sel.extra {
			sel.extra[i] = true
		}
	}
	q := make([]byte, maxQueryLen)
	for i := uint32(0); i < nq; i++ {
		l, ok := u32()
		if !ok {
			return sel, wire.RepErrInvalid, fmt.Errorf("bad query %d", i)
		}
		if l > maxQueryLen {
			// Too long to name anything: skipped, as qemu-nbd skips it.
			if n, _ := io.CopyN(io.Discard, r, int64(l)); n != int64(l) {
				return sel, wire.RepErrInvalid, fmt.Errorf("bad query %d", i)
			}
			continue
		}
		if _, err := io.ReadFull(r, q[:l]); err != nil {
			return sel, wire.RepErrInvalid, fmt.Errorf("bad query %d", i)
		}
		matchQuery(string(q[:l]), list, metas, &sel)
	}
	if n, _ := r.Read(word[:1]); n != 0 {
		return sel, wire.RepErrInvalid, fmt.Errorf("trailing bytes after the queries")
	}
	ids, names := metaNames(sel, metas)
	for i, name := range names {
		c.optReply(id, wire.RepMetaContext, append(be.AppendUint32(nil, ids[i]), name...))
	}
	c.optReply(id, wire.RepAck, nil)
	return sel, 0, nil
}

// optReply sends one option reply; write errors surface on the next read.
func (c *conn) optReply(id, typ uint32, data []byte) {
	b := be.AppendUint64(nil, wire.MagicReply)
	b = be.AppendUint32(b, id)
	b = be.AppendUint32(b, typ)
	b = be.AppendUint32(b, uint32(len(data)))
	c.sock.Write(append(b, data...))
}
