// Package inflate decodes a deflate (RFC 1951) or zlib (RFC 1950) stream
// that lies whole in memory into a buffer the caller gives: a vmdk
// streamOptimized grain or a qcow2 compressed cluster.
//
// Why not a library: compress/flate and klauspost's flate decode through
// a window of their own and an io.ByteReader, and a random read of a
// streamOptimized disk inflates a grain (docs/design.md, Stored grains and
// the inflater). Here the output buffer is the window, the input is read 8
// bytes at a time, and a symbol is one table load. Every length, distance
// and code is checked as zlib checks them; the fuzzer compares with
// compress/flate.
package inflate

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync"
)

// Errors a caller may branch on; the messages wrapping them say where.
var (
	// ErrCorrupt: the stream breaks deflate's or zlib's rules (or ends
	// before its last block does).
	ErrCorrupt = errors.New("corrupt deflate stream")
	// ErrTooLong: the stream holds more bytes than the output buffer.
	ErrTooLong = errors.New("deflate stream inflates past the buffer")
	// ErrChecksum: a zlib stream's Adler-32 does not match its bytes.
	ErrChecksum = errors.New("zlib checksum mismatch")
)

// decoders are reused: a decoder's tables take about 10 KiB.
var decoders = sync.Pool{New: func() any { return new(decoder) }}

// Zlib inflates the zlib stream at the start of in into out and returns
// how many bytes it held. The stream must end (its last block, then an
// Adler-32 that matches) within in; bytes after it are ignored. A stream
// with a preset dictionary is refused (as zlib's uncompress refuses it),
// and so is one that holds more than len(out) bytes.
func Zlib(out, in []byte) (int, error) {
	if len(in) < 2 {
		return 0, fmt.Errorf("%w: zlib header cut short", ErrCorrupt)
	}
	cmf, flg := in[0], in[1]
	switch {
	case cmf&0x0f != 8 || cmf>>4 > 7:
		return 0, fmt.Errorf("%w: zlib header %#02x%02x: not deflate with a window of at most 32 KiB", ErrCorrupt, cmf, flg)
	case (uint16(cmf)<<8|uint16(flg))%31 != 0:
		return 0, fmt.Errorf("%w: zlib header %#02x%02x: bad check bits", ErrCorrupt, cmf, flg)
	case flg&0x20 != 0:
		return 0, fmt.Errorf("%w: zlib stream asks for a preset dictionary", ErrCorrupt)
	}
	d := decoders.Get().(*decoder)
	defer decoders.Put(d)
	n, used, err := d.inflate(out, in[2:], false)
	if err != nil {
		return n, err
	}
	rest := in[2+used:]
	if len(rest) < 4 {
		return n, fmt.Errorf("%w: zlib checksum cut short", ErrCorrupt)
	}
	if want, got := binary.BigEndian.Uint32(rest), Adler32Update(1, out[:n]); want != got {
		return n, fmt.Errorf("%w: stream says %#08x, its %d bytes sum to %#08x", ErrChecksum, want, n, got)
	}
	return n, nil
}

// Fill inflates the raw deflate stream in into out until out is full, as
// QEMU reads a qcow2 compressed cluster (inflate with Z_FINISH, taken as
// read once the output is full): the stream may go on past that point,
// unread; a stream that ends first is an error, and so is one whose
// input runs out first.
func Fill(out, in []byte) error {
	d := decoders.Get().(*decoder)
	defer decoders.Put(d)
	n, _, err := d.inflate(out, in, true)
	if err != nil {
		return err
	}
	if n < len(out) {
		return fmt.Errorf("%w: stream ends after %d bytes of %d", ErrCorrupt, n, len(out))
	}
	return nil
}

// The tables. An entry is a uint32:
//
//	bits 0-5   the code's length in bits (for a subtable link: the
//	           primary table's bits); six bits, so that a shift by the
//	           entry itself (bits >>= e & 63) is one instruction on amd64,
//	           which masks a shift count to six bits
//	bits 6-8   its kind
//	bits 9-12  extra bits that follow the code (lengths and distances);
//	           for a link, the subtable's index bits
//	bits 16-31 the literal byte, the base length or distance, or for a
//	           link the subtable's start
//
// A code no longer than the primary table's bits fills every primary
// entry whose low bits are the code (bit-reversed, as deflate sends codes
// most significant bit first into a stream read from the least); a longer
// one lives in the subtable its low bits link to, indexed by the bits
// after them.
const (
	kindInvalid = 0 << 6 // no code has these bits (an incomplete code)
	kindLiteral = 1 << 6
	kindLength  = 2 << 6
	kindEnd     = 3 << 6 // end of block
	kindLink    = 4 << 6
	kindDist    = 5 << 6
	kindMask    = 7 << 6

	litBits  = 10 // primary index bits of the literal/length table
	distBits = 8
	preBits  = 7 // the code-length code: at most 7 bits, no subtables

	maxCodeLen = 15
	numLit     = 286 // literal/length codes a stream may use (of 288)
	numDist    = 30
)

// Base values and extra bits of the length codes 257..285 and of the
// distance codes 0..29 (RFC 1951 3.2.5).
var (
	lengthBase = [29]uint16{3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31,
		35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258}
	lengthExtra = [29]uint8{0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2,
		3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0}
	distBase = [30]uint16{1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193,
		257, 385, 513, 769, 1025, 1537, 2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577}
	distExtra = [30]uint8{0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6,
		7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13}
	// preOrder is the order of the code-length code's lengths in a
	// dynamic block's header.
	preOrder = [19]uint8{16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15}
)

// decoder holds the tables of the block being decoded.
type decoder struct {
	lit, dist []uint32
	pre       [1 << preBits]uint32
	lens      [numLit + 2 + 32]uint8 // the 288 literal/length and 32 distance lengths
	// fixedLit and fixedDist are the fixed code's tables, made the first
	// time a fixed block is decoded.
	fixedLit, fixedDist []uint32
	// cut says the output filled inside a copy or a stored block (zlib
	// stops there), not at a symbol's end; final, in drain, that the
	// block read is the stream's last.
	cut, final bool
}

// bitReader reads the stream least significant bit first. bits holds
// nbits unread bits, and above them (as libdeflate keeps them) the first
// bits of in[pos:], which the next refill ORs in again. Past the end of
// in it reads zero bits, counting the bytes it made up in pos: a caller
// checks overrun before it trusts what it decoded.
type bitReader struct {
	in    []byte
	pos   int
	bits  uint64
	nbits uint
}

// refill makes nbits at least 56.
func (br *bitReader) refill() {
	if br.pos+8 <= len(br.in) {
		br.bits |= binary.LittleEndian.Uint64(br.in[br.pos:]) << br.nbits
		br.pos += int(63-br.nbits) >> 3
		br.nbits |= 56
		return
	}
	for br.nbits <= 56 {
		if br.pos < len(br.in) {
			br.bits |= uint64(br.in[br.pos]) << br.nbits
		}
		br.pos++
		br.nbits += 8
	}
}

// take removes and returns the next n (at most 32) bits; nbits must be at
// least n.
func (br *bitReader) take(n uint) uint32 {
	v := uint32(br.bits & (1<<n - 1))
	br.bits >>= n
	br.nbits -= n
	return v
}

// need refills when fewer than n bits are held.
func (br *bitReader) need(n uint) {
	if br.nbits < n {
		br.refill()
	}
}

// used is how many bytes of in the bits taken so far reach into.
func (br *bitReader) used() int { return br.pos - int(br.nbits>>3) }

// inflate decodes the raw deflate stream in into out: to the end of its
// last block, or with fill set only until out is full. It returns the
// bytes written and how many bytes of in the stream took.
func (d *decoder) inflate(out, in []byte, fill bool) (int, int, error) {
	br := bitReader{in: in}
	o := 0
	d.cut = false
	if fill && len(out) == 0 {
		return 0, 0, d.drain(&br, nil, nil, false)
	}
	for {
		br.need(3)
		final := br.take(1)
		var err error
		var lit, dist []uint32
		switch br.take(2) {
		case 0:
			o, err = d.stored(&br, out, o, fill)
		case 1:
			if d.fixedLit == nil {
				d.makeFixed()
			}
			lit, dist = d.fixedLit, d.fixedDist
			o, err = d.huffman(&br, out, o, lit, dist, fill)
		case 2:
			if err = d.dynamicTables(&br); err == nil {
				lit, dist = d.lit, d.dist
				o, err = d.huffman(&br, out, o, lit, dist, fill)
			}
		default:
			err = fmt.Errorf("%w: block type 3 at byte %d", ErrCorrupt, br.used())
		}
		// Made-up bits past the end of in decode as something: whatever
		// they decoded to is not the stream's.
		if br.used() > len(in) {
			return o, 0, fmt.Errorf("%w: stream cut short after %d bytes", ErrCorrupt, len(in))
		}
		if err != nil {
			return o, 0, err
		}
		if fill && o == len(out) {
			// Full in the middle of a copy or a stored block, zlib
			// stops there; full at a symbol's or a block's end, it
			// reads on first (drain).
			d.final = final == 1
			switch {
			case d.cut:
			case lit != nil:
				err = d.drain(&br, lit, dist, true)
			case final == 0:
				err = d.drain(&br, nil, nil, false)
			}
			return o, 0, err
		}
		if final == 1 {
			// The stream ends at the byte its last bit lies in.
			return o, br.used(), nil
		}
	}
}

// drain reads on past a full output as zlib's inflate does before it
// returns, which is how QEMU reads a qcow2 compressed cluster (one inflate
// with Z_FINISH): the block's next symbol (inBlock) and the headers of the
// blocks that follow, until something would need room in the output, the
// stream's end or the input's end, each of which leaves the cluster good;
// anything invalid on the way fails it, as in QEMU. Bits past the input's
// end are not the stream's (zlib would wait for them): no error.
func (d *decoder) drain(br *bitReader, lit, dist []uint32, inBlock bool) error {
	fail := func(err error) error {
		if br.used() > len(br.in) {
			return nil
		}
		return err
	}
	for {
		if inBlock {
			br.need(48)
			e := lit[br.bits&(1<<litBits-1)]
			if e&kindMask == kindLink {
				e = link(lit, e, br.bits, litBits)
			}
			br.take(uint(e & 63))
			switch e & kindMask {
			case kindLiteral:
				return nil
			case kindEnd:
				inBlock = false
				if d.final {
					return nil
				}
			case kindLength:
				br.take(uint(e >> 9 & 15))
				e = dist[br.bits&(1<<distBits-1)]
				if e&kindMask == kindLink {
					e = link(dist, e, br.bits, distBits)
				}
				br.take(uint(e & 63))
				if e&kindMask != kindDist {
					return fail(fmt.Errorf("%w: invalid distance code at byte %d, past the output's end", ErrCorrupt, br.used()))
				}
				// zlib reads the extra bits, then stops before the copy
				// (no check of the distance: the copy never happens).
				return nil
			default:
				return fail(fmt.Errorf("%w: invalid literal/length code at byte %d, past the output's end", ErrCorrupt, br.used()))
			}
			continue
		}
		br.need(3)
		d.final = br.take(1) == 1
		switch br.take(2) {
		case 0:
			n, err := br.storedHeader()
			if err != nil || n != 0 || d.final {
				return err // an overrun (n -1) is no error here
			}
		case 1:
			if d.fixedLit == nil {
				d.makeFixed()
			}
			lit, dist, inBlock = d.fixedLit, d.fixedDist, true
		case 2:
			if err := d.dynamicTables(br); err != nil {
				return fail(err)
			}
			lit, dist, inBlock = d.lit, d.dist, true
		default:
			return fail(fmt.Errorf("%w: block type 3 at byte %d, past the output's end", ErrCorrupt, br.used()))
		}
		if br.used() > len(br.in) {
			return nil
		}
	}
}

// storedHeader reads a stored block's header: to the byte boundary, then
// its length and the length's complement, which must match. It returns
// the length, or -1 where the input ends first (an overrun, in pos).
func (br *bitReader) storedHeader() (int, error) {
	br.take(br.nbits & 7)
	br.pos = br.used() // give back the whole bytes held
	br.bits, br.nbits = 0, 0
	if br.pos+4 > len(br.in) {
		br.pos = len(br.in) + 1
		return -1, nil
	}
	n := binary.LittleEndian.Uint16(br.in[br.pos:])
	if binary.LittleEndian.Uint16(br.in[br.pos+2:]) != ^n {
		return 0, fmt.Errorf("%w: stored block at byte %d: length %d does not match its complement", ErrCorrupt, br.pos, n)
	}
	br.pos += 4
	return int(n), nil
}

// stored copies a stored block.
func (d *decoder) stored(br *bitReader, out []byte, o int, fill bool) (int, error) {
	n, err := br.storedHeader()
	if n < 0 || err != nil {
		return o, err
	}
	if n > len(out)-o {
		if !fill {
			return o, fmt.Errorf("%w: a stored block of %d bytes at %d, %d bytes of room", ErrTooLong, n, o, len(out)-o)
		}
		// zlib copies what fits and stops there: the rest of the
		// block need not be in the input.
		n = len(out) - o
		d.cut = true
	}
	if n > len(br.in)-br.pos {
		br.pos = len(br.in) + 1 // an overrun
		return o, nil
	}
	copy(out[o:], br.in[br.pos:br.pos+n])
	br.pos += n
	return o + n, nil
}

// huffman decodes a block coded with the tables lit and dist.
//
// The bit reader's state is held in locals for the loop (a literal costs
// a few instructions, and through br every store to out would make the
// compiler load them again), and put back in br when the block ends.
func (d *decoder) huffman(br *bitReader, out []byte, o int, lit, dist []uint32, fill bool) (int, error) {
	in, pos, bits, nbits := br.in, br.pos, br.bits, br.nbits
	// The primary tables as arrays: their lookups need no bounds check.
	litTab := (*[1 << litBits]uint32)(lit)
	distTab := (*[1 << distBits]uint32)(dist)
	var err error
loop:
	for {
		// The most one symbol takes: a 15-bit length code, 5 extra bits,
		// a 15-bit distance code, 13 extra bits.
		if nbits < 48 {
			if pos+8 <= len(in) {
				// br.refill's fast path, inline.
				bits |= binary.LittleEndian.Uint64(in[pos:]) << nbits
				pos += int(63-nbits) >> 3
				nbits |= 56
			} else {
				br.pos, br.bits, br.nbits = pos, bits, nbits
				br.refill()
				pos, bits, nbits = br.pos, br.bits, br.nbits
			}
		}
		e := litTab[bits&(1<<litBits-1)]
		// Literals run on without a refill while the bits held cover a
		// literal's code (at most 15 bits; longer ones are links).
		for e&kindMask == kindLiteral {
			bits >>= e & 63
			nbits -= uint(e & 63)
			if o >= len(out) {
				err = fmt.Errorf("%w: %d bytes", ErrTooLong, len(out))
				break loop
			}
			out[o] = byte(e >> 16)
			o++
			if fill && o == len(out) {
				break loop
			}
			if nbits < maxCodeLen {
				continue loop
			}
			e = litTab[bits&(1<<litBits-1)]
		}
		if nbits < 48 {
			continue // what follows may take 48 bits: refill, look up again
		}
		if e&kindMask == kindLink {
			e = link(lit, e, bits, litBits)
		}
		bits >>= e & 63
		nbits -= uint(e & 63)
		switch e & kindMask {
		case kindLiteral:
			// A literal longer than litBits (a link), written here
			// rather than in the loop above: a link check there, on
			// every literal, measured 2-5% slower a grain.
			if o >= len(out) {
				err = fmt.Errorf("%w: %d bytes", ErrTooLong, len(out))
				break loop
			}
			out[o] = byte(e >> 16)
			o++
			if fill && o == len(out) {
				break loop
			}
			continue
		case kindEnd:
			break loop
		case kindLength:
		default:
			err = fmt.Errorf("%w: invalid literal/length code at byte %d", ErrCorrupt, pos-int(nbits>>3))
			break loop
		}
		n := uint(e >> 9 & 15)
		length := int(e>>16) + int(uint32(bits)&(1<<n-1))
		bits >>= n
		nbits -= n
		e = distTab[bits&(1<<distBits-1)]
		if e&kindMask == kindLink {
			e = link(dist, e, bits, distBits)
		}
		bits >>= e & 63
		nbits -= uint(e & 63)
		if e&kindMask != kindDist {
			err = fmt.Errorf("%w: invalid distance code at byte %d", ErrCorrupt, pos-int(nbits>>3))
			break loop
		}
		n = uint(e >> 9 & 15)
		distance := int(e>>16) + int(uint32(bits)&(1<<n-1))
		bits >>= n
		nbits -= n
		if distance > o {
			err = fmt.Errorf("%w: distance %d at output byte %d reaches before the start", ErrCorrupt, distance, o)
			break loop
		}
		if length > len(out)-o {
			if !fill {
				err = fmt.Errorf("%w: %d bytes", ErrTooLong, len(out))
				break loop
			}
			length = len(out) - o
			d.cut = true
		}
		// A copy may overlap its source (distance < length): the source
		// is then periodic, and each copy doubles the run it reads from.
		from, end := o-distance, o+length
		for o < end {
			o += copy(out[o:end], out[from:o])
		}
		if fill && o == len(out) {
			break loop
		}
	}
	br.pos, br.bits, br.nbits = pos, bits, nbits
	return o, err
}

// dynamicTables reads a dynamic block's header and builds its tables.
func (d *decoder) dynamicTables(br *bitReader) error {
	br.need(14)
	nlit := int(br.take(5)) + 257
	ndist := int(br.take(5)) + 1
	npre := int(br.take(4)) + 4
	if nlit > numLit || ndist > numDist {
		return fmt.Errorf("%w: dynamic block with %d literal/length and %d distance codes", ErrCorrupt, nlit, ndist)
	}
	var preLens [19]uint8
	for i := 0; i < npre; i++ {
		br.need(3)
		preLens[preOrder[i]] = uint8(br.take(3))
	}
	// zlib takes no incomplete code-length code, not even the one code
	// of one bit it takes for the other two codes (d.pre has room for
	// its table: codes of at most preBits bits have no subtables).
	if _, ok := buildTable(d.pre[:], preLens[:], preBits, preEntry, false); !ok {
		return fmt.Errorf("%w: bad code-length code at byte %d", ErrCorrupt, br.used())
	}
	if slices.Max(preLens[:]) == 0 {
		// No code-length code at all: zlib decodes every length as 0
		// from one bit each, then fails on the missing end-of-block
		// code. The bits are read as it reads them, so that a stream
		// that ends first is cut short (or, past a full cluster, no
		// error), as with zlib.
		for range nlit + ndist {
			br.need(1)
			br.take(1)
		}
		return fmt.Errorf("%w: dynamic block without an end-of-block code", ErrCorrupt)
	}
	lens := d.lens[:nlit+ndist]
	for i := 0; i < len(lens); {
		br.need(16)
		e := d.pre[br.bits&(1<<preBits-1)]
		if e&kindMask != kindLiteral {
			return fmt.Errorf("%w: invalid code-length code at byte %d", ErrCorrupt, br.used())
		}
		br.take(uint(e & 63))
		sym := e >> 16
		if sym < 16 {
			lens[i] = uint8(sym)
			i++
			continue
		}
		var rep int
		var v uint8
		switch sym {
		case 16:
			if i == 0 {
				return fmt.Errorf("%w: a repeat of no code length at byte %d", ErrCorrupt, br.used())
			}
			v, rep = lens[i-1], 3+int(br.take(2))
		case 17:
			rep = 3 + int(br.take(3))
		default:
			rep = 11 + int(br.take(7))
		}
		if rep > len(lens)-i {
			return fmt.Errorf("%w: code lengths repeat past the %d codes at byte %d", ErrCorrupt, len(lens), br.used())
		}
		for end := i + rep; i < end; i++ {
			lens[i] = v
		}
	}
	if lens[256] == 0 {
		return fmt.Errorf("%w: dynamic block without an end-of-block code", ErrCorrupt)
	}
	var ok bool
	if d.lit, ok = buildTable(d.lit, lens[:nlit], litBits, litEntry, true); !ok {
		return fmt.Errorf("%w: bad literal/length code at byte %d", ErrCorrupt, br.used())
	}
	if d.dist, ok = buildTable(d.dist, lens[nlit:], distBits, distEntry, true); !ok {
		return fmt.Errorf("%w: bad distance code at byte %d", ErrCorrupt, br.used())
	}
	return nil
}

// makeFixed builds the fixed code's tables (RFC 1951 3.2.6). Its
// literal/length code has 288 codes, 286 and 287 never valid in a
// stream, and its distance code 32, 30 and 31 never valid.
func (d *decoder) makeFixed() {
	var lens [288 + 32]uint8
	for i := range 288 {
		switch {
		case i < 144:
			lens[i] = 8
		case i < 256:
			lens[i] = 9
		case i < 280:
			lens[i] = 7
		default:
			lens[i] = 8
		}
	}
	for i := 288; i < len(lens); i++ {
		lens[i] = 5
	}
	d.fixedLit, _ = buildTable(nil, lens[:288], litBits, litEntry, true)
	d.fixedDist, _ = buildTable(nil, lens[288:], distBits, distEntry, true)
}

// litEntry, distEntry and preEntry give the table entry of a code's
// symbol, its length n in the low bits.
func litEntry(sym int, n uint32) uint32 {
	switch {
	case sym < 256:
		return uint32(sym)<<16 | kindLiteral | n
	case sym == 256:
		return kindEnd | n
	case sym < 286:
		return uint32(lengthBase[sym-257])<<16 | uint32(lengthExtra[sym-257])<<9 | kindLength | n
	}
	return kindInvalid | n // 286, 287: codes a stream may not use
}

func distEntry(sym int, n uint32) uint32 {
	if sym < numDist {
		return uint32(distBase[sym])<<16 | uint32(distExtra[sym])<<9 | kindDist | n
	}
	return kindInvalid | n
}

func preEntry(sym int, n uint32) uint32 { return uint32(sym)<<16 | kindLiteral | n }

// buildTable checks the code lengths and builds their table into t
// (grown when it has too little room): a primary table indexed by bits
// bits, and a subtable per primary entry that longer codes share, as
// long as the longest of them needs. It returns the table, and false
// when the lengths make no code: over-subscribed, or incomplete but for
// the cases zlib takes: no code at all (its every entry invalid: a block
// that uses no distance is all literals), and, where oneCode says (the
// literal/length and distance codes, not the code-length code), one
// code of one bit.
func buildTable(t []uint32, lens []uint8, bits uint, entry func(int, uint32) uint32, oneCode bool) ([]uint32, bool) {
	var count [maxCodeLen + 1]int
	for _, l := range lens {
		count[l]++
	}
	count[0] = 0
	left, maxLen := 1, 0
	for l := 1; l <= maxCodeLen; l++ {
		left = left<<1 - count[l]
		if left < 0 {
			return t, false // over-subscribed
		}
		if count[l] > 0 {
			maxLen = l
		}
	}
	if left > 0 && maxLen != 0 && !(oneCode && maxLen == 1 && count[1] == 1) {
		return t, false // incomplete
	}
	// next[l] is the first code of length l, in canonical order.
	var next [maxCodeLen + 1]int
	for l, code := 1, 0; l <= maxCodeLen; l++ {
		code = (code + count[l-1]) << 1
		next[l] = code
	}
	// The subtables: each primary prefix (a long code's first bits) gets
	// one, sized for the longest code under it, which is its last in
	// canonical order; they follow the primary table in prefix order.
	var subBits [1 << litBits]uint8
	var subStart [1 << litBits]uint32
	for l := int(bits) + 1; l <= maxLen; l++ {
		for c := next[l]; c < next[l]+count[l]; c++ {
			subBits[reverse(uint32(c>>(l-int(bits))), bits)] = uint8(l - int(bits))
		}
	}
	size := uint32(1 << bits)
	for p, s := range subBits[:1<<bits] {
		if s > 0 {
			subStart[p] = size
			size += 1 << s
		}
	}
	if uint32(cap(t)) < size {
		t = make([]uint32, size)
	}
	t = t[:size]
	// Entries no code reaches (an incomplete code) are invalid and take
	// one bit, as zlib's are: past the input's end zlib would wait for
	// that bit, not fail.
	for i := range t {
		t[i] = kindInvalid | 1
	}
	for p, s := range subBits[:1<<bits] {
		if s > 0 {
			t[p] = subStart[p]<<16 | uint32(s)<<9 | kindLink | uint32(bits)
		}
	}
	for sym, l := range lens {
		if l == 0 {
			continue
		}
		c := next[l]
		next[l]++
		r := reverse(uint32(c), uint(l))
		e := entry(sym, uint32(l))
		if uint(l) <= bits {
			for i := r; i < 1<<bits; i += 1 << l {
				t[i] = e
			}
			continue
		}
		p := r & (1<<bits - 1)
		for i := r >> bits; i < 1<<subBits[p]; i += 1 << (uint(l) - bits) {
			t[subStart[p]+i] = e
		}
	}
	return t, true
}

// link gives the entry a primary entry e links to: the subtable entry of
// the bits after the primary table's n.
func link(t []uint32, e uint32, bits uint64, n uint) uint32 {
	return t[e>>16+uint32(bits>>n)&(1<<(e>>9&15)-1)]
}

// reverse returns the low n bits of c in reverse order.
func reverse(c uint32, n uint) uint32 {
	var r uint32
	for range n {
		r = r<<1 | c&1
		c >>= 1
	}
	return r
}
