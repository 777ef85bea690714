package vhdx

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"
	"unicode/utf16"

	"github.com/blockexport/blockexport/formats"
)

// Differencing images (MS-VHDX 2.6.2.6, 3.2): a sector of a PARTIALLY_PRESENT
// block comes from this file where its chunk's sector bitmap has its bit,
// else from the parent; NOT_PRESENT and UNDEFINED blocks come from the
// parent whole. QEMU 7.2 refuses these images; the parent is opened here
// by the name the parent locator gives, through the confined opener.

// maxLocatorSize bounds the parent locator read into memory.
const maxLocatorSize = 64 << 10

// guidParentVHDX is the locator type of a VHDX parent.
var guidParentVHDX = msGUID(0xb04aefb7, 0xd19e, 0x4a81, 0xb7, 0x89, 0x25, 0xb8, 0xe9, 0x44, 0x59, 0x13)

// parseLocator returns the key-value pairs of a parent locator.
func parseLocator(b []byte) (map[string]string, error) {
	if len(b) < 20 {
		return nil, errors.New("parent locator shorter than its header")
	}
	if [16]byte(b[:16]) != guidParentVHDX {
		return nil, fmt.Errorf("%w: parent locator of type %x, not a VHDX parent", ErrUnsupported, b[:16])
	}
	n := int(binary.LittleEndian.Uint16(b[18:]))
	if 20+12*n > len(b) {
		return nil, fmt.Errorf("parent locator has %d entries; its %d bytes hold %d", n, len(b), (len(b)-20)/12)
	}
	kv := make(map[string]string, n)
	str := func(off uint32, length uint16) (string, error) {
		if length%2 != 0 || uint64(off)+uint64(length) > uint64(len(b)) {
			return "", fmt.Errorf("parent locator string [%d, +%d) outside its %d bytes", off, length, len(b))
		}
		u := make([]uint16, length/2)
		for i := range u {
			u[i] = binary.LittleEndian.Uint16(b[int(off)+2*i:])
		}
		return string(utf16.Decode(u)), nil
	}
	for i := range n {
		e := b[20+12*i:]
		k, err := str(binary.LittleEndian.Uint32(e[0:]), binary.LittleEndian.Uint16(e[8:]))
		if err != nil {
			return nil, err
		}
		v, err := str(binary.LittleEndian.Uint32(e[4:]), binary.LittleEndian.Uint16(e[10:]))
		if err != nil {
			return nil, err
		}
		if _, dup := kv[k]; dup {
			return nil, fmt.Errorf("parent locator names %q twice", k)
		}
		kv[k] = v
	}
	return kv, nil
}

// guidString is a GUID as the parent locator writes one: {8-4-4-4-12}.
func guidString(g [16]byte) string {
	return fmt.Sprintf("{%08x-%04x-%04x-%x-%x}", binary.LittleEndian.Uint32(g[0:]), binary.LittleEndian.Uint16(g[4:]),
		binary.LittleEndian.Uint16(g[6:]), g[8:10], g[10:16])
}

// parentNames are the paths to try, in the spec's order, in this host's
// form: backslashes as slashes; a Win32 absolute path without its drive
// (the opener confines it to the image's directory, as any name).
func parentNames(kv map[string]string) []string {
	var names []string
	if p := kv["relative_path"]; p != "" {
		names = append(names, strings.ReplaceAll(p, `\`, "/"))
	}
	if p := kv["absolute_win32_path"]; p != "" {
		p = strings.TrimPrefix(p, `\\?\`)
		if len(p) >= 2 && p[1] == ':' {
			p = p[2:]
		}
		names = append(names, strings.ReplaceAll(p, `\`, "/"))
	}
	return names
}

// openParent opens the parent the locator names and checks it is the
// image this one was made on: its data write GUID is the locator's
// parent_linkage (or parent_linkage2).
func (img *Image) openParent(locator []byte, open func(string) (formats.Image, string, error)) error {
	kv, err := parseLocator(locator)
	if err != nil {
		if errors.Is(err, ErrUnsupported) {
			return fmt.Errorf("%s: %w", img.path, err)
		}
		return fmt.Errorf("%w: %s: %v", ErrCorrupt, img.path, err)
	}
	link := kv["parent_linkage"]
	if link == "" {
		return fmt.Errorf("%w: %s: parent locator has no parent_linkage", ErrCorrupt, img.path)
	}
	names := parentNames(kv)
	if len(names) == 0 {
		return fmt.Errorf("%w: %s: parent locator has no relative_path or absolute_win32_path", ErrCorrupt, img.path)
	}
	var errs []error
	for _, name := range names {
		p, shown, err := open(name)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		img.parentName = shown
		if p == nil {
			return nil // parents not opened (info without the chain)
		}
		pv, ok := p.(*Image)
		if !ok {
			p.Close()
			return fmt.Errorf("%w: %s: parent %s is not a VHDX image", ErrCorrupt, img.path, shown)
		}
		got := guidString(pv.dataWriteGUID)
		if !strings.EqualFold(got, link) && !strings.EqualFold(got, kv["parent_linkage2"]) {
			p.Close()
			return fmt.Errorf("%w: %s: parent %s has data write GUID %s, but the image was made on %s (the parent changed since)", ErrCorrupt, img.path, shown, got, link)
		}
		img.parent = p
		return nil
	}
	return fmt.Errorf("%s: parent: %w", img.path, errors.Join(errs...))
}

// fromParent says whether a block in state reads from the parent.
func (img *Image) fromParent(state uint64) bool {
	return img.diff && (state == blockNotPresent || state == blockUndefined)
}

// readPartial reads p at off, inside one PARTIALLY_PRESENT block whose
// bytes lie at blockHost: run by run of sectors with one bitmap bit.
func (img *Image) readPartial(ctx context.Context, p []byte, off, blockHost int64) error {
	ls := int64(img.logicalSector)
	first, last := off/ls, (off+int64(len(p))-1)/ls
	chunkSectors := int64(sectorsPerChunk)
	s0, s1 := first%chunkSectors, last%chunkSectors // one block: one chunk
	bits := make([]byte, s1/8-s0/8+1)
	if err := img.readBitmap(ctx, bits, first/chunkSectors, s0/8); err != nil {
		return err
	}
	bit := func(sec int64) bool {
		i := sec%chunkSectors - s0/8*8
		return bits[i/8]&(1<<(i%8)) != 0
	}
	blockStart := off - off%img.blockSize
	for pos := off; pos < off+int64(len(p)); {
		sec := pos / ls
		here := bit(sec)
		next := sec + 1
		for next <= last && bit(next) == here {
			next++
		}
		end := min(off+int64(len(p)), next*ls)
		q := p[pos-off : end-off]
		if here {
			if _, err := img.f.ReadAt(ctx, q, blockHost+pos-blockStart); err != nil {
				return fmt.Errorf("vhdx: read %d bytes at %d: %w", len(q), pos, err)
			}
		} else if err := img.ReadBacking(ctx, q, pos); err != nil {
			return err
		}
		pos = end
	}
	return nil
}

// Backing is the parent of a differencing image, or nil.
func (img *Image) Backing() formats.Image { return img.parent }

// readBitmap reads p from byte off of chunk c's sector bitmap: the file's
// bytes (zeroes past its end: a block a writer has just allocated), under
// the sectors a writer changed and has not written yet. Both are read
// under mu, so that a writer's commit, which drops its pending sectors
// once they are in place, is seen whole or not at all.
func (img *Image) readBitmap(ctx context.Context, p []byte, c, off int64) error {
	img.mu.RLock()
	defer img.mu.RUnlock()
	at := int64(img.bitmaps[c]&batOffsetMask) + off
	got, err := img.f.ReadAt(ctx, p, at)
	if err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("vhdx: read the sector bitmap at %d: %w", at, err)
	}
	clear(p[got:])
	for s := at &^ (logSector - 1); s < at+int64(len(p)); s += logSector {
		if b, ok := img.pending[s]; ok {
			lo, hi := max(s, at), min(s+logSector, at+int64(len(p)))
			copy(p[lo-at:hi-at], b[lo-s:hi-s])
		}
	}
	return nil
}
