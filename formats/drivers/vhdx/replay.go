package vhdx

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/blockexport/blockexport/aio"
)

// ErrBadLog: the log's active sequence is not one that can be replayed
// safely (a descriptor or data sector that does not match its entry, a
// write outside the file or into the header section or the log): the
// file is left untouched.
var ErrBadLog = errors.New("vhdx: log cannot be replayed")

// logDesc is one descriptor of a log entry (MS-VHDX 2.3.1.2, 2.3.1.3).
type logDesc struct {
	zero     bool
	length   uint64 // zero descriptors: bytes of zeroes
	offset   uint64 // file offset written
	leading  [8]byte
	trailing [4]byte
	data     []byte // data descriptors: the sector's 4084 middle bytes
}

// logEntry is a checked entry of the active sequence.
type logEntry struct {
	seq     uint64
	flushed uint64 // flushed_file_offset
	descs   []logDesc
}

// logView reads the circular log of one file.
type logView struct {
	r      *reader
	off, n uint64
	guid   [16]byte
}

func (l *logView) sector(at uint64) ([]byte, error) { return l.r.read(l.off+at%l.n, logSector) }

// entryAt validates the entry whose header is at position at, as QEMU's
// vhdx_validate_log_entry does: the header's fields and its sequence
// number (prev+1 when prev > 0; else the next sector is where to go on),
// then its descriptors (one that is neither a data nor a zero descriptor
// of this sequence number, or not on a 4 KiB boundary, fails the whole
// search, as QEMU's open fails), then the checksum over the whole entry
// (else the walk goes on after the entry). A data sector that does not
// match its descriptor's entry is an error too (QEMU finds it while
// replaying, having written what came before). Every entry checksummed
// is counted against budget.
func (l *logView) entryAt(at, prev uint64, budget *uint64) (e logEntry, next uint64, ok bool, err error) {
	s, err := l.sector(at)
	if err != nil {
		return e, 0, false, err
	}
	le := binary.LittleEndian
	length := uint64(le.Uint32(s[8:]))
	e.seq = le.Uint64(s[16:])
	count := uint64(le.Uint32(s[24:]))
	e.flushed = le.Uint64(s[48:])
	if string(s[:4]) != "loge" || length > l.n || length%logSector != 0 || e.seq == 0 ||
		[16]byte(s[32:48]) != l.guid || count*32 > length || (prev > 0 && e.seq != prev+1) {
		return e, at + logSector, false, nil
	}
	descSectors := (count + 2 + 127) / 128
	if descSectors*logSector > length {
		// QEMU reads the descriptor sectors past the entry and checks
		// its checksum over them: never equal to an entry this short.
		return e, at + descSectors*logSector, false, nil
	}
	if length > *budget {
		return e, 0, false, fmt.Errorf("%w: its log has more candidate entries than can be checked", ErrBadLog)
	}
	*budget -= length
	descs := make([]byte, 0, descSectors*logSector)
	for i := range descSectors {
		b, err := l.sector(at + i*logSector)
		if err != nil {
			return e, 0, false, err
		}
		descs = append(descs, b...)
	}
	for i := range count {
		d := descs[64+32*i : 96+32*i]
		desc := logDesc{offset: le.Uint64(d[16:])}
		valid := le.Uint64(d[24:]) == e.seq && desc.offset%logSector == 0
		switch string(d[:4]) {
		case "zero":
			desc.zero, desc.length = true, le.Uint64(d[8:])
			valid = valid && desc.length%logSector == 0
		case "desc":
			copy(desc.trailing[:], d[4:8])
			copy(desc.leading[:], d[8:16])
		default:
			valid = false
		}
		if !valid {
			return e, 0, false, fmt.Errorf("%w: entry %d: descriptor %d is not a valid data or zero descriptor of it", ErrBadLog, e.seq, i)
		}
		e.descs = append(e.descs, desc)
	}
	ok, err = logEntryChecksumOK(func(a uint64, k int) ([]byte, error) { return l.r.read(l.off+a, k) }, l.n, at%l.n, length)
	if err != nil || !ok {
		return e, at + length, false, err
	}
	dataAt := at + descSectors*logSector
	for i := range e.descs {
		d := &e.descs[i]
		if d.zero {
			continue
		}
		if dataAt >= at+length {
			return e, 0, false, fmt.Errorf("%w: entry %d has more data descriptors than data sectors", ErrBadLog, e.seq)
		}
		ds, err := l.sector(dataAt)
		if err != nil {
			return e, 0, false, err
		}
		seq := uint64(le.Uint32(ds[4:]))<<32 | uint64(le.Uint32(ds[4092:]))
		if string(ds[:4]) != "data" || seq != e.seq {
			return e, 0, false, fmt.Errorf("%w: entry %d: a data sector whose signature or sequence number is not the entry's", ErrBadLog, e.seq)
		}
		d.data = ds[8:4092]
		dataAt += logSector
	}
	return e, at + length, true, nil
}

// activeSequence finds the log's active sequence as QEMU's
// vhdx_log_search walks the log: from its start, a run of valid entries
// with consecutive sequence numbers (from the third on, as QEMU checks)
// where one begins, going on where the
// run (or the invalid entry) ends, until the walk wraps; of the runs,
// the one whose first entry has the highest sequence number.
func (l *logView) activeSequence() ([]logEntry, error) {
	budget := uint64(logHashBudget) * l.n
	var best []logEntry
	for at := uint64(0); at < l.n; {
		first, next, ok, err := l.entryAt(at, 0, &budget)
		if err != nil {
			return nil, err
		}
		if !ok {
			at = next
			continue
		}
		run := []logEntry{first}
		// QEMU checks a continuation's sequence number against the one
		// before it from the third entry on: its search starts the
		// number it compares with at 0 (no check) and sets it only after
		// the second entry. Mimicked, so that both replay the same run.
		var prev uint64
		for next-at < l.n {
			e, n2, ok, err := l.entryAt(next, prev, &budget)
			if err != nil {
				return nil, err
			}
			if !ok {
				next = n2
				break
			}
			if n2-at > l.n {
				break
			}
			run, next, prev = append(run, e), n2, e.seq
		}
		if best == nil || first.seq > best[0].seq {
			best = run
		}
		at = next
	}
	return best, nil
}

// Replay replays the dirty log of the VHDX image in f, opened writable,
// as QEMU 7.2 does at a read-write open (block/vhdx-log.c): it finds the
// active sequence of valid entries under the active header's log GUID,
// writes each data and zero descriptor of each entry in order, makes
// them durable, and then empties the log by writing both headers, the
// inactive one first, each with a higher sequence number and a zero log
// GUID, each made durable before the next (a crash anywhere leaves
// either the dirty log, which replays again to the same bytes, or a
// clean header). Unlike QEMU, the whole sequence is checked before the
// first write: a data sector that does not match its entry, a flushed
// offset past the end of the file, or a write outside the file, into the
// header section or into the log refuses the replay with the file
// untouched (QEMU writes what comes before such a descriptor, and writes
// wherever a descriptor points, growing the file). The data write GUID
// is kept (differencing children link to it; no guest data changes
// here), the file write GUID renewed. It says whether a log was
// replayed. f stays open.
func Replay(ctx context.Context, f aio.File) (bool, error) {
	r, h, err := readHeaders(ctx, f, nil)
	if err != nil {
		return false, err
	}
	if h.logGUID == ([16]byte{}) || h.logLength == 0 {
		return false, nil
	}
	if h.logVersion != 0 {
		return false, fmt.Errorf("%w: %s: log version %d (want 0)", ErrUnsupported, r.name, h.logVersion)
	}
	logLen, logOff := uint64(h.logLength), h.logOffset
	if logLen%mib != 0 || logOff%mib != 0 || logOff < headerSection || logOff > r.size || logLen > r.size-logOff {
		return false, fmt.Errorf("%w: %s: log [%d, +%d) is not whole MiB inside the file (%d bytes)", ErrCorrupt, r.name, logOff, logLen, r.size)
	}
	l := &logView{r: r, off: logOff, n: logLen, guid: h.logGUID}
	seq, err := l.activeSequence()
	if err != nil {
		return false, fmt.Errorf("%s: %w", r.name, err)
	}
	if len(seq) == 0 {
		return false, nil // a log GUID but no valid entry: nothing to replay (as QEMU)
	}
	for _, e := range seq {
		if e.flushed > r.size {
			return false, fmt.Errorf("%w: %s: entry %d says the file was %d bytes, but it has %d (truncated?)", ErrBadLog, r.name, e.seq, e.flushed, r.size)
		}
		for _, d := range e.descs {
			n := uint64(logSector)
			if d.zero {
				n = d.length
			}
			switch {
			case d.offset < headerSection:
				return false, fmt.Errorf("%w: %s: entry %d writes at %#x, inside the header section", ErrBadLog, r.name, e.seq, d.offset)
			case d.offset > r.size || n > r.size-d.offset:
				return false, fmt.Errorf("%w: %s: entry %d writes [%#x, +%d), past the end of the file (%d bytes)", ErrBadLog, r.name, e.seq, d.offset, n, r.size)
			case d.offset < logOff+logLen && logOff < d.offset+n:
				return false, fmt.Errorf("%w: %s: entry %d writes [%#x, +%d), into the log", ErrBadLog, r.name, e.seq, d.offset, n)
			}
		}
	}
	// Checked: now write.
	sector := make([]byte, logSector)
	zeroes := make([]byte, mib)
	for _, e := range seq {
		for _, d := range e.descs {
			if !d.zero {
				copy(sector, d.leading[:])
				copy(sector[8:], d.data)
				copy(sector[4092:], d.trailing[:])
				if _, err := f.WriteAt(ctx, sector, int64(d.offset)); err != nil {
					return false, fmt.Errorf("vhdx: %s: replaying the log: %w", r.name, err)
				}
				continue
			}
			for done := uint64(0); done < d.length; {
				k := min(d.length-done, mib)
				if _, err := f.WriteAt(ctx, zeroes[:k], int64(d.offset+done)); err != nil {
					return false, fmt.Errorf("vhdx: %s: replaying the log: %w", r.name, err)
				}
				done += k
			}
		}
	}
	if err := f.Fsync(ctx); err != nil {
		return false, fmt.Errorf("vhdx: %s: replaying the log: %w", r.name, err)
	}
	if err := r.clearLogGUID(); err != nil {
		return false, err
	}
	return true, nil
}

// clearLogGUID writes both headers with a zero log GUID and a new file
// write GUID: the inactive slot first, with the next sequence number,
// then the other with the one after, each made durable before the next.
func (r *reader) clearLogGUID() error {
	h, err := r.headers()
	if err != nil {
		return err
	}
	p, err := readHeaderPair(r, h.seq)
	if err != nil {
		return err
	}
	fileWrite, err := newGUID()
	if err != nil {
		return fmt.Errorf("%s: %w", r.name, err)
	}
	return p.update(r.ctx, r.f, r.name, true, func(h []byte) {
		copy(h[16:32], fileWrite[:])
		clear(h[48:64])
	})
}
