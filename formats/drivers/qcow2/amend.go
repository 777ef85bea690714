package qcow2

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"slices"
	"strconv"
	"strings"

	"github.com/blockexport/blockexport/aio"
)

// Amend: qemu-img amend's options for qcow2 (QEMU 7.2's
// qcow2_amend_options), applied in QEMU's order: upgrade, refcount width,
// backing file (refused unless unchanged), lazy refcounts, size,
// downgrade. Each step leaves the image consistent if the process is
// killed (see refcountorder.go, zeroexpand.go, amendheader.go).

// AmendOptions are the options amend changes; nil and zero leave one as
// it is.
type AmendOptions struct {
	Version       uint32 // 2 or 3; 0: unchanged
	RefcountBits  int64  // 0: unchanged
	LazyRefcounts *bool
	// BackingFile and BackingFormat, where given, must name the image's
	// own (QEMU 7.2 refuses to change them here).
	BackingFile, BackingFormat *string
	Size                       int64 // 0: unchanged
}

// AmendError is a refusal in qemu-img amend's words: a message and, on
// the lines after it, a hint.
type AmendError struct{ Lines []string }

func (e *AmendError) Error() string { return strings.Join(e.Lines, "\n") }

func amendRefusal(lines ...string) error { return &AmendError{Lines: lines} }

// AmendOpenError is a failure to open the image for amending (qemu-img's
// "Could not open").
type AmendOpenError struct{ Err error }

func (e *AmendOpenError) Error() string { return e.Err.Error() }
func (e *AmendOpenError) Unwrap() error { return e.Err }

// Options amend takes, and those only create takes (qemu-img names
// these "only supported for image creation").
var (
	amendKeys = []string{"backing_file", "backing_fmt", "compat", "data_file", "data_file_raw",
		"encrypt.iter-time", "encrypt.keyslot", "encrypt.new-secret", "encrypt.old-secret", "encrypt.state",
		"lazy_refcounts", "refcount_bits", "size"}
	createOnlyKeys = []string{"cluster_size", "compression_type", "encrypt.cipher-alg", "encrypt.cipher-mode",
		"encrypt.format", "encrypt.hash-alg", "encrypt.ivgen-alg", "encrypt.ivgen-hash-alg", "encrypt.key-secret",
		"encryption", "extended_l2", "extent_size_hint", "nocow", "preallocation"}
)

// AmendHelp is qemu-img amend -o help's list for qcow2.
const AmendHelp = `Amend options for 'qcow2':
  backing_file=<str>     - File name of a base image
  backing_fmt=<str>      - Image format of the base image
  compat=<str>           - Compatibility level (v2 [0.10] or v3 [1.1])
  data_file=<str>        - File name of an external data file
  data_file_raw=<bool (on/off)> - The external data file must stay valid as a raw image
  encrypt.iter-time=<num> - Time to spend in PBKDF in milliseconds
  encrypt.keyslot=<num>  - Select a single keyslot to modify explicitly
  encrypt.new-secret=<str> - New secret to set in the matching keyslots. Empty string to erase
  encrypt.old-secret=<str> - Select all keyslots that match this password
  encrypt.state=<str>    - Select new state of affected keyslots (active/inactive)
  lazy_refcounts=<bool (on/off)> - Postpone refcount updates
  refcount_bits=<num>    - Width of a reference count entry in bits
  size=<size>            - Virtual disk size
`

// ParseAmendOptions reads the options of qemu-img amend -o other than
// size and the backing file (keys), refusing as qemu-img does what amend
// cannot change. The image-independent checks come first, as there.
func ParseAmendOptions(keys map[string]string) (AmendOptions, error) {
	var o AmendOptions
	names := slices.Sorted(func(yield func(string) bool) {
		for k := range keys {
			if !yield(k) {
				return
			}
		}
	})
	for _, k := range names {
		if !slices.Contains(amendKeys, k) {
			if slices.Contains(createOnlyKeys, k) {
				return o, amendRefusal(fmt.Sprintf("Invalid parameter '%s'", k), "This option is only supported for image creation")
			}
			return o, amendRefusal(fmt.Sprintf("Invalid parameter '%s'", k))
		}
	}
	// Values are parsed with the option list, before any is acted on.
	if v, ok := keys["lazy_refcounts"]; ok {
		switch v {
		case "on", "yes", "true", "y":
			o.LazyRefcounts = new(true)
		case "off", "no", "false", "n":
			o.LazyRefcounts = new(false)
		default:
			return o, amendRefusal("Parameter 'lazy_refcounts' expects 'on' or 'off'")
		}
	}
	if v, ok := keys["data_file_raw"]; ok && !slices.Contains([]string{"on", "yes", "true", "y", "off", "no", "false", "n"}, v) {
		return o, amendRefusal("Parameter 'data_file_raw' expects 'on' or 'off'")
	}
	var width uint64
	if v, ok := keys["refcount_bits"]; ok {
		n, err := strconv.ParseUint(strings.TrimPrefix(v, "-"), 0, 64)
		if err != nil {
			return o, amendRefusal("Parameter 'refcount_bits' expects a number")
		}
		if strings.HasPrefix(v, "-") {
			n = -n
		}
		width = n
	}
	// qcow2_amend_options' own checks, in its option order.
	if v, ok := keys["compat"]; ok {
		switch v {
		case "0.10", "v2":
			o.Version = 2
		case "1.1", "v3":
			o.Version = 3
		default:
			return o, amendRefusal("Unknown compatibility level " + v)
		}
	}
	if _, ok := keys["data_file"]; ok {
		return o, amendRefusal("data-file can only be set for images that use an external data file")
	}
	if v, ok := keys["data_file_raw"]; ok && (v == "on" || v == "yes" || v == "true" || v == "y") {
		return o, amendRefusal("data-file-raw cannot be set on existing images")
	}
	for _, k := range names {
		if strings.HasPrefix(k, "encrypt.") {
			return o, amendRefusal("Can't amend encryption options - encryption not present")
		}
	}
	if _, ok := keys["refcount_bits"]; ok {
		if width == 0 || width > 64 || bits.OnesCount64(width) != 1 {
			return o, amendRefusal("Refcount width must be a power of two and may not exceed 64 bits")
		}
		o.RefcountBits = int64(width)
	}
	return o, nil
}

// Resizer changes the image's virtual size: the caller's, since the
// writer that does it opens the image as an Image of its own.
type Resizer func(ctx context.Context, size int64) error

// PrepareAmend checks the qcow2 image in f (open for writing, under the
// writer's lock) as QEMU's open for writing does before amend: a corrupt
// image is refused, and one not closed cleanly (lazy refcounts) has its
// refcounts repaired, whose findings it returns, as QEMU prints them.
func PrepareAmend(ctx context.Context, f aio.File) ([]string, error) {
	h, _, err := readHeader(ctx, f)
	if err != nil {
		return nil, &AmendOpenError{err}
	}
	switch {
	case h.incompatible&incCorrupt != 0:
		return nil, &AmendOpenError{errors.New("qcow2: Image is corrupt; cannot be opened read/write")}
	case h.incompatible&incDirty != 0:
		res, err := checkOnce(ctx, f, RepairAll)
		if err == nil && (res.Corruptions > 0 || res.CheckErrors > 0) {
			err = fmt.Errorf("%w: %d corruptions remain", ErrCorrupt, res.Corruptions)
		}
		if err != nil {
			return res.Messages, &AmendOpenError{fmt.Errorf("Could not repair dirty image: %w", err)}
		}
		return res.Messages, nil
	}
	return nil, nil
}

// Amend applies o to the qcow2 image in f (open for writing, under the
// writer's lock, prepared by PrepareAmend, and left open), as qemu-img
// amend does.
func Amend(ctx context.Context, f aio.File, o AmendOptions, resize Resizer) error {
	h, head, err := readHeader(ctx, f)
	if err != nil {
		return &AmendOpenError{err}
	}
	oldVersion, newVersion := h.version, h.version
	if o.Version != 0 {
		newVersion = o.Version
	}
	if newVersion > oldVersion {
		if err := upgrade(ctx, f, h, head); err != nil {
			return err
		}
		if h, head, err = readHeader(ctx, f); err != nil {
			return err
		}
	}
	if o.RefcountBits != 0 && o.RefcountBits != int64(1)<<h.refcountOrder {
		if newVersion < 3 && o.RefcountBits != 16 {
			return amendRefusal("Refcount widths other than 16 bits require compatibility level 1.1 or above (use compat=1.1 or greater)")
		}
		if err := changeRefcountOrder(ctx, f, uint32(bits.TrailingZeros64(uint64(o.RefcountBits)))); err != nil {
			return err
		}
		if h, head, err = readHeader(ctx, f); err != nil {
			return err
		}
	}
	if o.BackingFile != nil || o.BackingFormat != nil {
		if deref(o.BackingFile) != h.backingFile || deref(o.BackingFormat) != h.backingFormat {
			return amendRefusal("Cannot amend the backing file", "You can use 'qemu-img rebase' instead.")
		}
	}
	if o.LazyRefcounts != nil && *o.LazyRefcounts != (h.compatible&compatLazyRefcounts != 0) {
		if *o.LazyRefcounts && newVersion < 3 {
			return amendRefusal("Lazy refcounts only supported with compatibility level 1.1 and above (use compat=1.1 or greater)")
		}
		// Off: the image is clean (repaired above if it was dirty).
		if err := writeHeaderField(ctx, f, hdrCompatible, h.compatible^compatLazyRefcounts); err != nil {
			return fmt.Errorf("Failed to update the image header: %w", err)
		}
	}
	if o.Size != 0 {
		if err := resize(ctx, o.Size); err != nil {
			return err
		}
		if h, head, err = readHeader(ctx, f); err != nil {
			return err
		}
	}
	if newVersion < oldVersion {
		return downgrade(ctx, f, h, head)
	}
	return nil
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// readHeader reads and parses f's header.
func readHeader(ctx context.Context, f aio.File) (*header, []byte, error) {
	size, head, err := readHead(ctx, f)
	if err != nil {
		return nil, nil, err
	}
	h, err := parseHeader(head, size)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", f.Name(), err)
	}
	return h, head, nil
}

// upgrade makes a version 2 image version 3 (QEMU's qcow2_upgrade).
func upgrade(ctx context.Context, f aio.File, h *header, head []byte) error {
	c, err := imageTables(ctx, f)
	if err != nil {
		return err
	}
	for i, raw := range c.snapRaw {
		if len(raw.extra) < 16 {
			// QEMU rewrites such a table with the extra data version 3
			// requires; this writer does not.
			return fmt.Errorf("%w: snapshot %s lacks the extra data version 3 requires", ErrUnsupported, c.snaps[i].ID)
		}
	}
	n := *h
	n.version, n.incompatible, n.compatible, n.autoclear = 3, 0, 0, 0
	n.refcountOrder, n.compressionType, n.headerLength = 4, compressionZlib, v2HeaderLen
	return rewriteHeader(ctx, f, &n, head)
}

// downgrade makes a version 3 image version 2 (QEMU's qcow2_downgrade).
func downgrade(ctx context.Context, f aio.File, h *header, head []byte) error {
	if h.refcountOrder != 4 {
		return amendRefusal("compat=0.10 requires refcount_bits=16")
	}
	c, err := imageTables(ctx, f)
	if err != nil {
		return err
	}
	for _, raw := range c.snapRaw {
		// A snapshot without the sizes version 3 adds has the image's
		// size and a 32-bit VM state, as QEMU reads it.
		vmState, disk := uint64(binary.BigEndian.Uint32(raw.hdr[32:])), h.size
		if len(raw.extra) >= 8 {
			vmState = binary.BigEndian.Uint64(raw.extra[0:])
		}
		if len(raw.extra) >= 16 {
			disk = binary.BigEndian.Uint64(raw.extra[8:])
		}
		if vmState > 1<<32-1 || disk != h.size {
			return amendRefusal("Internal snapshots prevent downgrade of image")
		}
	}
	if rest := h.incompatible &^ incCompressionTyp; rest != 0 {
		return amendRefusal(fmt.Sprintf("Cannot downgrade an image with incompatible features 0x%x set", rest))
	}
	if h.incompatible&incCompressionTyp != 0 {
		compressed, err := hasCompressedClusters(ctx, f)
		if err != nil {
			return err
		}
		if compressed {
			return amendRefusal("Cannot downgrade an image with zstd compression type and existing compressed clusters")
		}
	}
	if err := expandZeroClusters(ctx, f); err != nil {
		return fmt.Errorf("Failed to turn zero into data clusters: %w", err)
	}
	// The refcount table may have moved: the header as it is now.
	if h, head, err = readHeader(ctx, f); err != nil {
		return err
	}
	n := *h
	n.version, n.incompatible, n.compatible, n.autoclear = 2, 0, 0, 0
	n.compressionType = compressionZlib
	return rewriteHeader(ctx, f, &n, head)
}
