package vhdx

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
	"slices"

	"github.com/blockexport/blockexport/aio"
)

// Writing through the log (MS-VHDX 2.3; QEMU 7.2's vhdx_log_write_and_flush):
// a change to the BAT or a sector bitmap is written first as a log entry,
// then, once the entry is durable, to its place. A crash at any point
// leaves either the entry, which a replay (ours at a writable open or
// check -r all, QEMU's at a read-write open) writes again to the same
// bytes, or a torn entry whose checksum fails, next to metadata that has
// not been touched yet.

// headerPair is the two headers as last written, and which is active.
type headerPair struct {
	raw [2][]byte
	cur int
	seq uint64
}

// readHeaderPair reads both headers; the active one is the one the reader
// picked (seq), by its sequence number.
func readHeaderPair(r *reader, seq uint64) (headerPair, error) {
	var p headerPair
	for i, off := range []uint64{header1Offset, header2Offset} {
		b, err := r.read(off, headerSize)
		if err != nil {
			return p, err
		}
		p.raw[i] = b
	}
	if v := p.raw[1]; string(v[:4]) == "head" && checksumOK(v) && binary.LittleEndian.Uint64(v[8:]) == seq {
		p.cur = 1
	}
	p.seq = seq
	return p, nil
}

// update writes the active header changed by change into both slots, the
// inactive one first, each with the next sequence number and made durable
// (sync) before the next, as QEMU's vhdx_update_headers does: a crash
// leaves the old header or the new one active, never a torn one (its
// checksum fails and the other wins).
func (p *headerPair) update(ctx context.Context, f aio.File, name string, sync bool, change func(h []byte)) error {
	next := bytes.Clone(p.raw[p.cur])
	change(next)
	for _, slot := range []int{1 - p.cur, p.cur} {
		p.seq++
		binary.LittleEndian.PutUint64(next[8:], p.seq)
		putChecksum(next)
		off := []int64{header1Offset, header2Offset}[slot]
		if _, err := f.WriteAt(ctx, next, off); err != nil {
			return fmt.Errorf("vhdx: %s: write header %d: %w", name, slot+1, err)
		}
		if sync {
			if err := f.Fsync(ctx); err != nil {
				return fmt.Errorf("vhdx: %s: write header %d: %w", name, slot+1, err)
			}
		}
		p.raw[slot] = bytes.Clone(next)
	}
	return nil
}

// newGUID is a random GUID (version 4, as the spec's writers make them).
func newGUID() ([16]byte, error) {
	var g [16]byte
	if _, err := io.ReadFull(rand.Reader, g[:]); err != nil {
		return g, fmt.Errorf("vhdx: a new GUID: %w", err)
	}
	g[7] = g[7]&0x0f | 0x40 // the version nibble of the third field (little-endian)
	g[8] = g[8]&0x3f | 0x80
	return g, nil
}

// logEntrySectors is how many data sectors fit one entry in a log of n
// bytes: the entry's header and descriptors (32 bytes each, two slots
// taken by the header) take whole sectors before them.
func logEntrySectors(n int64) int {
	total := int(n / logSector)
	k := total - 1
	for k > 0 && (k+2+127)/128+k > total {
		k--
	}
	return k
}

// buildLogEntry lays out the entry that writes the 4 KiB sectors of
// sectors (by file offset, offs sorted) with sequence number seq: the
// header, the data descriptors, then the data sectors, each sector's
// first 8 and last 4 bytes in its descriptor and the sequence number in
// their place. fileSize is the file's size, durable, when the entry is
// written (its flushed and last file offsets).
func buildLogEntry(guid [16]byte, seq uint64, fileSize uint64, offs []int64, sectors map[int64][]byte) []byte {
	le := binary.LittleEndian
	descSectors := (len(offs) + 2 + 127) / 128
	e := make([]byte, (descSectors+len(offs))*logSector)
	copy(e, "loge")
	le.PutUint32(e[8:], uint32(len(e)))
	le.PutUint32(e[12:], 0) // tail: the entry itself, at the log's start
	le.PutUint64(e[16:], seq)
	le.PutUint32(e[24:], uint32(len(offs)))
	copy(e[32:48], guid[:])
	le.PutUint64(e[48:], fileSize)
	le.PutUint64(e[56:], fileSize)
	for i, off := range offs {
		s := sectors[off]
		d := e[64+32*i:]
		copy(d, "desc")
		copy(d[4:8], s[4092:])
		copy(d[8:16], s[:8])
		le.PutUint64(d[16:], uint64(off))
		le.PutUint64(d[24:], seq)
		ds := e[(descSectors+i)*logSector:]
		copy(ds, "data")
		le.PutUint32(ds[4:], uint32(seq>>32))
		copy(ds[8:4092], s[8:4092])
		le.PutUint32(ds[4092:], uint32(seq))
	}
	le.PutUint32(e[4:], crc32.Checksum(e, castagnoli))
	return e
}

// sortedOffsets are the keys of sectors in order.
func sortedOffsets(sectors map[int64][]byte) []int64 {
	offs := make([]int64, 0, len(sectors))
	for off := range sectors {
		offs = append(offs, off)
	}
	slices.Sort(offs)
	return offs
}
