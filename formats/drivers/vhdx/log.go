package vhdx

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
)

// Log layout (MS-VHDX 2.3): a circular buffer of entries, each a multiple
// of 4 KiB, starting with a 64-byte header whose CRC-32C covers the whole
// entry.
const (
	logSector = 4 << 10
	// logHashBudget bounds the bytes checksummed while looking for valid
	// entries, in multiples of the log's length: a log of headers that
	// each claim the whole log would otherwise cost its length squared.
	// Past the budget the log counts as dirty: refused, never read around.
	logHashBudget = 16
)

// checkLog refuses an image whose log holds entries to replay (QEMU's
// vhdx_parse_log: a non-zero log GUID and at least one valid entry).
// A read-only open does not write, so it cannot replay them (a writable
// open has replayed them before it gets here), and reading around them
// would serve stale metadata; QEMU, opened read-only, refuses the same
// way.
func (r *reader) checkLog(h header) error {
	if h.logGUID == ([16]byte{}) {
		return nil
	}
	if h.logVersion != 0 {
		return fmt.Errorf("%w: %s: log version %d (want 0)", ErrUnsupported, r.name, h.logVersion)
	}
	length, off := uint64(h.logLength), h.logOffset
	if length == 0 || length%mib != 0 || off%mib != 0 || off < headerSection || off > r.size || length > r.size-off {
		return fmt.Errorf("%w: %s: log [%d, +%d) is not whole MiB inside the file (%d bytes)", ErrCorrupt, r.name, off, length, r.size)
	}
	// The log is read a MiB at a time (its length may be up to 4 GiB):
	// headers are looked for on every 4 KiB, an entry's checksum is
	// computed over reads of its own.
	read := func(at uint64, n int) ([]byte, error) { return r.read(off+at, n) }
	dirty, err := dirtyLog(read, length, h.logGUID)
	if err != nil {
		return fmt.Errorf("%s: %w", r.name, err)
	}
	if dirty {
		return fmt.Errorf("%w: %s: VHDX image opened read-only, but its log has entries that need to be replayed; replay them once with: blockexport check -r all %s (or qemu-img check -r all %s)", ErrDirtyLog, r.name, r.name, r.name)
	}
	return nil
}

// dirtyLog says whether the log of n bytes (read through read) holds a
// valid entry of this log GUID.
func dirtyLog(read func(at uint64, n int) ([]byte, error), n uint64, guid [16]byte) (bool, error) {
	budget := logHashBudget * n
	for chunk := uint64(0); chunk < n; chunk += mib {
		buf, err := read(chunk, int(min(mib, n-chunk)))
		if err != nil {
			return false, err
		}
		for in := uint64(0); in < uint64(len(buf)); in += logSector {
			e := buf[in : in+64]
			if string(e[:4]) != "loge" || [16]byte(e[32:48]) != guid {
				continue
			}
			length := uint64(binary.LittleEndian.Uint32(e[8:]))
			seq := binary.LittleEndian.Uint64(e[16:])
			descs := uint64(binary.LittleEndian.Uint32(e[24:]))
			if length == 0 || length%logSector != 0 || length > n || seq == 0 || 64+32*descs > length {
				continue
			}
			if length > budget {
				return false, fmt.Errorf("%w: its log has more candidate entries than can be checked; replay it once with: qemu-img check -r all", ErrDirtyLog)
			}
			budget -= length
			ok, err := logEntryChecksumOK(read, n, chunk+in, length)
			if err != nil || ok {
				return ok, err
			}
		}
	}
	return false, nil
}

// logEntryChecksumOK checks the CRC-32C of the entry of length bytes at
// pos, which may wrap around the end of the circular log.
func logEntryChecksumOK(read func(at uint64, n int) ([]byte, error), n, pos, length uint64) (bool, error) {
	var want uint32
	c := uint32(0)
	for done := uint64(0); done < length; {
		at := (pos + done) % n
		k := min(length-done, n-at, mib)
		b, err := read(at, int(k))
		if err != nil {
			return false, err
		}
		if done == 0 {
			// The checksum field counts as zero.
			want = binary.LittleEndian.Uint32(b[4:])
			c = crc32.Update(c, castagnoli, b[:4])
			c = crc32.Update(c, castagnoli, []byte{0, 0, 0, 0})
			b = b[8:]
		}
		c = crc32.Update(c, castagnoli, b)
		done += k
	}
	return c == want, nil
}
