package vmdk

import (
	"context"
	"encoding/binary"
	"fmt"

	"github.com/blockexport/blockexport/formats/internal/inflate"
)

// A stream-optimized grain of incompressible data is, as zlib writes it,
// a zlib stream of stored deflate blocks: the grain's bytes as they are,
// in runs of about 16 KiB with a 5-byte block header between them. Such a
// grain is read in place, as a monolithicSparse grain is (one pread of
// the bytes asked for), once its stream has been walked and its checksum
// checked (docs/design.md, Stored grains and the inflater).

// storedRun is one stored block: the grain's bytes from out on lie in the
// file at host (until the next run's out, or the grain's end).
type storedRun struct {
	out  int64
	host int64
}

// storedGrain is where a stored-only grain's bytes lie in the file.
type storedGrain struct {
	n    int64 // bytes the grain inflates to
	runs []storedRun
}

// storedRunsMax is how many blocks a grain may have for its runs to be
// kept (a grain of tiny or empty stored blocks is inflated instead): zlib
// writes a block per 16 KiB of input at its default memory level.
func storedRunsMax(grain int64) int { return int(max(8, grain/(8<<10))) }

// storedEntryBytes is what one cached storedGrain may cost, map and list
// included, for sizing the cache.
func storedEntryBytes(grain int64) int64 { return 160 + 16*int64(storedRunsMax(grain)) }

// parseStored walks the zlib stream in buf, which lies in the file at
// host: if it is a zlib header, stored blocks only (at most maxRuns
// non-empty ones) inflating to at most maxOut bytes, and an Adler-32 that
// matches them, it returns where the bytes lie. Anything else (a Huffman
// block, a lie in a length, a bad checksum) returns nil: the caller
// inflates the grain, and inflate reports what is wrong.
func parseStored(buf []byte, host, maxOut int64, maxRuns int) *storedGrain {
	if len(buf) < 2 || buf[0]&0x0f != 8 || buf[0]>>4 > 7 || buf[1]&0x20 != 0 ||
		(uint16(buf[0])<<8|uint16(buf[1]))%31 != 0 {
		return nil
	}
	g := &storedGrain{}
	sum := uint32(1)
	pos := 2
	for {
		if len(buf)-pos < 5 {
			return nil
		}
		h := buf[pos]
		if h>>1&3 != 0 {
			return nil
		}
		n := int(binary.LittleEndian.Uint16(buf[pos+1:]))
		if binary.LittleEndian.Uint16(buf[pos+3:]) != ^uint16(n) || len(buf)-pos-5 < n {
			return nil
		}
		pos += 5
		if n > 0 {
			if g.n+int64(n) > maxOut || len(g.runs) == maxRuns {
				return nil
			}
			g.runs = append(g.runs, storedRun{out: g.n, host: host + int64(pos)})
			sum = inflate.Adler32Update(sum, buf[pos:pos+n])
			g.n += int64(n)
		}
		pos += n
		if h&1 != 0 {
			break
		}
	}
	if len(buf)-pos < 4 || binary.BigEndian.Uint32(buf[pos:]) != sum {
		return nil
	}
	return g
}

// span is the file range holding the grain's bytes [at, at+n) (n > 0,
// at+n <= g.n): start, length, and whether block headers lie inside it
// (the read then crosses runs and its bytes are not contiguous).
func (g *storedGrain) span(at, n int64) (start, length int64, crosses bool) {
	i := g.run(at)
	j := g.run(at + n - 1)
	start = g.runs[i].host + at - g.runs[i].out
	end := g.runs[j].host + at + n - g.runs[j].out
	return start, end - start, i != j
}

// run is the index of the run holding byte at.
func (g *storedGrain) run(at int64) int {
	lo, hi := 0, len(g.runs)
	for hi-lo > 1 {
		m := (lo + hi) / 2
		if g.runs[m].out <= at {
			lo = m
		} else {
			hi = m
		}
	}
	return lo
}

// gather copies the grain's bytes [at, at+len(b)) into b from raw, which
// holds the file from host start on (span's range).
func (g *storedGrain) gather(b, raw []byte, at, start int64) {
	for done := int64(0); done < int64(len(b)); {
		r := g.run(at + done)
		end := g.n
		if r+1 < len(g.runs) {
			end = g.runs[r+1].out
		}
		src := g.runs[r].host + at + done - g.runs[r].out - start
		done += int64(copy(b[done:min(int64(len(b)), end-at)], raw[src:]))
	}
}

// readStored fills b with the grain's bytes from inG on; try: from the
// page cache only (false when it would wait).
func (e *extent) readStored(ctx context.Context, g *storedGrain, b []byte, inG int64, try bool) (bool, error) {
	if inG+int64(len(b)) > g.n {
		return false, fmt.Errorf("%w: %s: compressed grain holds %d bytes, %d read", ErrCorrupt, e.name, g.n, inG+int64(len(b)))
	}
	if len(b) == 0 {
		return true, nil
	}
	start, length, crosses := g.span(inG, int64(len(b)))
	dst := b
	if crosses {
		// One read of the blocks' bytes and the headers between them,
		// rather than a read per block.
		scratch := e.scratchBuf()
		defer e.scratch.Put(scratch)
		dst = (*scratch)[:length]
	}
	if try {
		if !e.f.TryReadAt(dst, start) {
			return false, nil
		}
	} else if _, err := e.f.ReadAt(ctx, dst, start); err != nil {
		return false, fmt.Errorf("vmdk: %s: read %d bytes of a stored grain at %d: %w", e.name, length, start, err)
	}
	if crosses {
		g.gather(b, dst, inG, start)
	}
	return true, nil
}
