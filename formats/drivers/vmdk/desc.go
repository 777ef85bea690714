package vmdk

import (
	"fmt"
	"strconv"
	"strings"
)

// descSize is how much of a descriptor QEMU reads for CIDs and the parent
// hint (its DESC_SIZE: 20 sectors).
const descSize = 20 * 512

// maxDescFile is the most of a descriptor file read for extents, as QEMU
// reads it (vmdk_read_desc: under 1 MiB, the rest ignored).
const maxDescFile = 1<<20 - 1

// maxExtents bounds a descriptor's extent lines: each is an open file.
const maxExtents = 4096

// descriptor is what a VMDK text descriptor says of the chain.
type descriptor struct {
	cid, parentCID uint32
	parentHint     string
}

// extentLine is one extent of a descriptor: access sectors type "name" [offset].
type extentLine struct {
	sectors int64
	typ     string
	name    string
	offset  int64 // FLAT: sectors into the file
}

// parseCIDs reads CID, parentCID and parentFileNameHint from the first
// descSize bytes of text, as QEMU finds them (the first "CID", the first
// "parentCID", the text between the quotes after parentFileNameHint=).
func parseCIDs(text string, d *descriptor) error {
	if len(text) > descSize {
		text = text[:descSize]
	}
	if i := strings.IndexByte(text, 0); i >= 0 {
		text = text[:i]
	}
	var ok bool
	if d.cid, ok = hexAfter(text, "CID"); !ok {
		return fmt.Errorf("%w: descriptor has no CID", ErrCorrupt)
	}
	if d.parentCID, ok = hexAfter(text, "parentCID"); !ok {
		return fmt.Errorf("%w: descriptor has no parentCID", ErrCorrupt)
	}
	if i := strings.Index(text, "parentFileNameHint"); i >= 0 {
		rest := text[i+len("parentFileNameHint"):]
		if len(rest) < 2 {
			return fmt.Errorf("%w: parentFileNameHint without a name", ErrCorrupt)
		}
		rest = rest[2:] // `="`, as QEMU skips it
		end := strings.IndexByte(rest, '"')
		if end < 0 {
			return fmt.Errorf("%w: parentFileNameHint without its closing quote", ErrCorrupt)
		}
		if end > 4095 {
			return fmt.Errorf("%w: parentFileNameHint longer than 4095 bytes", ErrCorrupt)
		}
		d.parentHint = rest[:end]
	}
	return nil
}

// hexAfter parses the hexadecimal number after the first occurrence of
// key and one separator byte ("CID=fe7c6a70"), as sscanf %x would.
func hexAfter(text, key string) (uint32, bool) {
	i := strings.Index(text, key)
	if i < 0 {
		return 0, false
	}
	rest := text[i+len(key):]
	if len(rest) < 1 {
		return 0, false
	}
	rest = strings.TrimLeft(rest[1:], " \t\r\n")
	rest = strings.TrimPrefix(strings.TrimPrefix(rest, "0x"), "0X")
	n := 0
	for n < len(rest) && strings.IndexByte("0123456789abcdefABCDEF", rest[n]) >= 0 {
		n++
	}
	if n == 0 {
		return 0, false
	}
	v, err := strconv.ParseUint(rest[:n], 16, 64)
	if err != nil || v > 0xffffffff {
		return 0xffffffff, true // sscanf's %x saturates; a CID that long is nobody's
	}
	return uint32(v), true
}

// parseCreateType finds createType="..." as QEMU does.
func parseCreateType(text string) (string, error) {
	i := strings.Index(text, "createType")
	if i < 0 {
		return "", fmt.Errorf("%w: invalid VMDK image descriptor (no createType)", ErrCorrupt)
	}
	rest := text[i+len("createType"):]
	if len(rest) < 2 {
		return "", fmt.Errorf("%w: invalid VMDK image descriptor", ErrCorrupt)
	}
	rest = rest[2:]
	end := strings.IndexByte(rest, '"')
	if end < 0 || end > 127 {
		return "", fmt.Errorf("%w: invalid VMDK image descriptor (createType)", ErrCorrupt)
	}
	return rest[:end], nil
}

// parseExtents reads the extent lines of a descriptor file as QEMU's
// vmdk_parse_extents does: "RW sectors TYPE "name" [offset]"; lines of
// another access (RDONLY, NOACCESS) or not of that shape are skipped, a
// FLAT line without its offset or a line with a stray one is an error.
// ZERO extents (VMware's spec; QEMU skips them, shortening the disk) read
// as zeroes here.
func parseExtents(text string) ([]extentLine, error) {
	var out []extentLine
	for _, line := range strings.Split(text, "\n") {
		line = strings.TrimRight(line, "\r")
		f := strings.Fields(line)
		if len(f) < 4 || f[0] != "RW" {
			continue
		}
		sectors, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			continue
		}
		typ := f[2]
		// The name is quoted and may hold spaces.
		q1 := strings.IndexByte(line, '"')
		if q1 < 0 {
			continue
		}
		q2 := strings.IndexByte(line[q1+1:], '"')
		if q2 < 0 {
			continue
		}
		name := line[q1+1 : q1+1+q2]
		tail := strings.Fields(line[q1+1+q2+1:])
		e := extentLine{sectors: sectors, typ: typ, name: name, offset: -1}
		if len(tail) > 0 {
			if e.offset, err = strconv.ParseInt(tail[0], 10, 64); err != nil {
				e.offset = -1
				tail = nil
			}
		}
		if typ == "FLAT" && (len(tail) == 0 || e.offset < 0) || typ != "FLAT" && len(tail) != 0 {
			return nil, fmt.Errorf("%w: invalid extent line: %s", ErrCorrupt, line)
		}
		if typ == "VMFS" {
			e.offset = 0
		}
		if sectors <= 0 {
			continue
		}
		switch typ {
		case "FLAT", "VMFS", "SPARSE", "ZERO":
		case "VMFSSPARSE", "SESPARSE":
			return nil, fmt.Errorf("%w: %s extents are not read (convert the image with qemu-img)", ErrUnsupported, typ)
		default:
			continue
		}
		if sectors > maxSectors {
			return nil, fmt.Errorf("%w: extent of %d sectors: %s", ErrCorrupt, sectors, line)
		}
		if e.offset > maxSectors {
			return nil, fmt.Errorf("%w: extent offset %d sectors: %s", ErrCorrupt, e.offset, line)
		}
		if len(out) == maxExtents {
			return nil, fmt.Errorf("%w: more than %d extents", ErrCorrupt, maxExtents)
		}
		out = append(out, e)
	}
	return out, nil
}
