package qcow2

import (
	"context"
	"encoding/binary"
	"fmt"

	"github.com/blockexport/blockexport/formats"
)

// SetBacking makes the header name backing (in format) as its backing
// file, as qemu-img rebase's last step; "" drops it (DropBacking). The
// caller has made the image read the same over the new backing file (or
// does not care: rebase -u) and has no request in flight. The old backing
// image stays open for this session's reads; the header changes in
// durable steps, each of which leaves a header that opens over the old
// chain or the new one: the new name is written where nothing points,
// then the 12 bytes that point at it (one sector) switch; a backing
// format that changes is dropped before the switch and written after it,
// so that no header ever pairs a name with the other's format (in between
// the format is probed, which finds what the file is).
func (q *Image) SetBacking(ctx context.Context, backing, format string) error {
	defer q.wrote()
	if backing == "" {
		return q.DropBacking(ctx)
	}
	if err := q.checkWritable("change the backing file"); err != nil {
		return err
	}
	if len(backing) > maxBackingNameLen {
		return fmt.Errorf("%w: a backing file name of %d bytes (at most %d)", ErrUnsupported, len(backing), maxBackingNameLen)
	}
	if len(format) > 16 {
		return fmt.Errorf("%w: backing format %q", ErrUnsupported, format)
	}
	if err := q.Flush(ctx); err != nil {
		return err
	}
	ctx = context.WithoutCancel(ctx) // the steps below must all happen
	cs := q.h.clusterSize
	head := make([]byte, cs)
	if _, err := q.f.ReadAt(ctx, head, 0); err != nil {
		return fmt.Errorf("qcow2: read the header cluster: %w", err)
	}
	hlen := int64(q.h.headerLength)
	if q.h.version < 3 {
		hlen = 72
	}
	be := binary.BigEndian
	oldOff, oldLen := int64(q.h.backingOffset), int64(q.h.backingSize)
	end := cs
	if oldOff != 0 && oldOff < end {
		end = oldOff
	}
	// The extensions as they are, the backing format's place noted.
	type ext struct {
		typ  uint32
		data []byte // with its padding
	}
	var exts []ext
	fmtAt := -1
	pos := hlen
	for pos+8 <= end {
		typ, n := be.Uint32(head[pos:]), int64(be.Uint32(head[pos+4:]))
		if typ == extEnd {
			break
		}
		next := pos + 8 + (n+7)&^7
		if next > end {
			return fmt.Errorf("%w: header extension %#x overruns the header cluster", ErrCorrupt, typ)
		}
		if typ == extBackingFmt {
			fmtAt = len(exts)
		}
		exts = append(exts, ext{typ, head[pos+8 : next]})
		pos = next
	}
	oldEnd := pos + 8 // past the end marker
	encode := func(withFormat bool) []byte {
		var b []byte
		placed := false
		add := func(e ext) {
			b = be.AppendUint32(b, e.typ)
			n := len(e.data)
			if e.typ == extBackingFmt {
				n = len(format)
			}
			b = be.AppendUint32(b, uint32(n))
			b = append(b, e.data...)
		}
		fmtExt := ext{extBackingFmt, append([]byte(format), make([]byte, (8-len(format)%8)%8)...)}
		for i, e := range exts {
			switch {
			case i == fmtAt && withFormat:
				add(fmtExt)
				placed = true
			case i != fmtAt:
				add(e)
			}
		}
		if withFormat && !placed {
			add(fmtExt)
		}
		return append(b, make([]byte, 8)...) // the end marker
	}
	final := encode(format != "")
	oldFormat := q.h.backingFormat
	if oldOff == 0 {
		oldFormat = ""
	}
	// The name goes past everything the old header or the new one uses.
	nameAt := max(oldEnd, hlen+int64(len(final)), oldOff+oldLen)
	nameAt = (nameAt + 7) &^ 7
	if nameAt+int64(len(backing)) > cs {
		return fmt.Errorf("%w: no room in the header cluster for the backing file name after the extensions (qemu-img rebase rewrites the header whole)", ErrUnsupported)
	}
	sync := func(what string) error {
		if err := q.f.Fdatasync(ctx); err != nil {
			return fmt.Errorf("qcow2: flush %s: %w", what, err)
		}
		return nil
	}
	writeExts := func(b []byte) error {
		if _, err := q.f.WriteAt(ctx, b, hlen); err != nil {
			return fmt.Errorf("qcow2: write header extensions: %w", err)
		}
		return sync("header extensions")
	}
	if fmtAt >= 0 && oldFormat != format {
		// Step 1: the old name without a format (probed), the same
		// length as before so that nothing past it moves.
		b := encode(false)
		b = append(b, make([]byte, max(0, oldEnd-hlen-int64(len(b))))...)
		if err := writeExts(b); err != nil {
			return err
		}
	}
	// Step 2: the new name where nothing points, then the pointer.
	if _, err := q.f.WriteAt(ctx, []byte(backing), nameAt); err != nil {
		return fmt.Errorf("qcow2: write the backing file name: %w", err)
	}
	if err := sync("the backing file name"); err != nil {
		return err
	}
	ptr := be.AppendUint64(nil, uint64(nameAt))
	ptr = be.AppendUint32(ptr, uint32(len(backing)))
	if _, err := q.f.WriteAt(ctx, ptr, hdrBackingOffset); err != nil {
		return fmt.Errorf("qcow2: point the header at the backing file name: %w", err)
	}
	if err := sync("header"); err != nil {
		return err
	}
	// Step 3: the new format (unless it was there all along), up to the
	// name; the old name's bytes are free once nothing points at them.
	if fmtAt < 0 || oldFormat != format {
		b := final
		if free := nameAt - hlen; int64(len(b)) < free {
			b = append(b, make([]byte, free-int64(len(b)))...)
		}
		if err := writeExts(b); err != nil {
			return err
		}
	}
	q.h.backingOffset, q.h.backingSize = uint64(nameAt), uint32(len(backing))
	q.h.backingFile, q.h.backingFormat = backing, format
	return nil
}

// Unallocate drops every cluster [off, off+n) touches from this layer,
// whatever its backing file holds, so that they read from the backing
// file again (qemu-img commit's emptying of the top image, whose block
// status may cut a cluster in two: its data and the zeroes of a host
// hole).
func (q *Image) Unallocate(ctx context.Context, off, n int64) error {
	cs := q.h.clusterSize
	a := off / cs * cs
	end := min((off+n+cs-1)/cs*cs, q.Size())
	return q.request(ctx, "unallocate", a, end-a, func() error {
		_, err := q.setClusters(ctx, a/cs, (end+cs-1)/cs, end, opDiscardAll)
		return err
	})
}

// BackingName is the backing file as the header names it, and its format.
func (q *Image) BackingName() (name, format string) { return q.h.backingFile, q.h.backingFormat }

var _ formats.Layered = (*Image)(nil)
