// Package vmdk reads, creates (create.go) and writes (write.go) VMDK
// images: a text descriptor file and
// its extents (FLAT, VMFS, SPARSE, ZERO), or a hosted sparse file with
// its embedded descriptor; createTypes monolithicSparse,
// twoGbMaxExtentSparse, monolithicFlat, twoGbMaxExtentFlat, vmfs and
// streamOptimized (deflate grains behind markers, the footer's grain
// directory), zeroed-grain entries, the redundant grain directory, and
// delta disks on a parent named by parentFileNameHint (its CID checked).
//
// QEMU's block/vmdk.c is the reference for what is read and how; where it
// reads wrong data without an error this package refuses: every grain
// directory and grain table entry is checked against the extent file
// before it is used, compressed grains whose lengths lie are refused, and
// files the image names are opened only through the caller's confined
// opener (the registry: inside the image's directory, regular files, no
// loops), never by this package.
//
// Grain tables are cached in a bounded LRU, and so are decompressed grains.
package vmdk

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/blockmap"
	"github.com/blockexport/blockexport/formats/internal/driver"
	"github.com/blockexport/blockexport/formats/internal/hostfile"
	"github.com/blockexport/blockexport/formats/internal/lru"
)

var (
	// ErrCorrupt: the image's metadata is inconsistent or hostile.
	ErrCorrupt = errors.New("vmdk: image is corrupt")
	// ErrUnsupported: a VMDK variant this package does not read.
	ErrUnsupported = errors.New("vmdk: not supported")
)

// DefaultGTCacheSize holds 4096 grain tables of 512 entries: 128 GiB of
// 64 KiB grains mapped.
const DefaultGTCacheSize = 8 << 20

// decodedCacheBytes bounds the cache of decompressed grains (an image's,
// whatever its extents): a random read of a stream-optimized image that
// misses inflates a whole grain (64 KiB for one 4 KiB read).
const decodedCacheBytes = 32 << 20

// storedCacheBytes bounds the cache of where stored-only grains lie
// (about 300 bytes a 64 KiB grain: 7 GiB of such grains mapped), which
// reads them in place, as a monolithicSparse grain is read.
const storedCacheBytes = 32 << 20

// maxParentDepth bounds a chain of delta disks.
const maxParentDepth = 64

// Options say how to open a VMDK image.
type Options struct {
	// Name is the image's path as given (relative names in the descriptor
	// are relative to its directory; info shows names built from it).
	Name string
	// OpenExtent opens a file the descriptor names as an extent, confined
	// as the registry confines it; it returns the file and its name as
	// QEMU shows it. nil: extents in other files are refused.
	OpenExtent func(name string) (aio.File, string, error)
	// OpenParent opens the image parentFileNameHint names, read-only, as
	// a vmdk image; it returns the image (nil when backing files are not
	// opened) and the name as QEMU shows it. nil: a delta disk is refused.
	OpenParent func(name string) (formats.Image, string, error)
	// GTCacheSize is the grain table cache in bytes; 0: the default.
	GTCacheSize int64
	// DecodedCacheSize is the cache of decompressed grains in bytes (the
	// image's, whatever its extents); 0: the default (decodedCacheBytes).
	DecodedCacheSize int64
	// Direct: the files are O_DIRECT (no page cache for the fast path).
	Direct bool
	// Writable: the image is written (its files opened writable, extents
	// through OpenExtent too); see write.go for what is refused.
	Writable bool
}

// Lock is what an open of a vmdk file locks: as qcow2's, nobody may write
// or resize a file whose metadata we read, and a writable open writes and
// resizes (grains are appended).
func Lock(writable, backing bool) aio.Lock { return driver.MetadataLock(writable, backing) }

// extent is one extent of the image.
type extent struct {
	f     aio.File // nil for ZERO
	owned bool     // closed by Close (not the descriptor file itself)
	name  string   // as QEMU shows it
	typ   string   // descriptor type ("" for a file opened directly)
	start int64    // virtual offset
	size  int64    // bytes

	flatOff int64 // FLAT/VMFS: byte offset in the file

	// sparse
	sparse     bool
	grain      int64
	gtes       int64
	gd         []uint32
	zeroGrain  bool
	compressed bool
	marker     bool
	usedRGD    bool
	fileEnd    atomic.Int64 // the file's size: grains are appended past it
	headerEnd  int64        // bytes of header no table or grain may lie in
	grainStart int64
	id         int64 // index in the image: cache keys are id<<40 | sector
	gtCache    *lru.Cache[[]uint32]
	grainCache *lru.Cache[[]byte]
	// storedCache holds where stored-only compressed grains lie
	// (stored.go); flight the loads under way. Both are the image's.
	storedCache *lru.Cache[*storedGrain]
	flight      *flight
	// tables orders grain table loads with the writes that change them
	// (the image's).
	tables *tableVersions
	// hdr is the sparse header as opened (the footer's, for a
	// stream-optimized file with its directory at the end); gdAtEnd says
	// it came from the footer.
	hdr     header
	gdAtEnd bool
	// Opened writable (write.go): the redundant directory (nil: none),
	// where the next grain goes, and the metadata a grain must not
	// overlap, sorted.
	rgd  []uint32
	next int64
	meta []hostRange
	// pend are the grains appended and not yet linked (write.go).
	pend pendingGrains
	// scratch holds the compressed bytes of a grain while it inflates,
	// or a stored grain's bytes across its blocks (*[]byte of a marker
	// and two grains), reused for the same reason.
	scratch sync.Pool
}

// Image is an open VMDK image.
type Image struct {
	blockmap.Map          // reads, tries, lends and extents, from locate
	f            aio.File // the file opened (descriptor or sparse)
	w            *writer  // nil: opened read-only (write.go)
	name         string
	direct       bool
	createType   string
	cid          uint32
	parentCID    uint32
	parentHint   string
	parentName   string
	parent       formats.Image
	extents      []*extent
	size         int64
}

// New opens the VMDK image of f, which it owns from now on (Close closes
// it; so does a failed New).
func New(ctx context.Context, f aio.File, o Options) (img *Image, err error) {
	im := &Image{f: f, name: cmp.Or(o.Name, f.Name()), direct: o.Direct}
	defer func() {
		var ro readOnlyHere
		if err != nil {
			im.Close()
			if errors.As(err, &ro) { // the registry names the image
				return
			}
			if errors.Is(err, ErrCorrupt) { // already says vmdk
				err = fmt.Errorf("%s: %w", im.name, err)
			} else {
				err = fmt.Errorf("vmdk: %s: %w", im.name, err)
			}
		}
	}()
	size, err := aio.FileSize(f)
	if err != nil {
		return nil, err
	}
	if size < 4 {
		return nil, fmt.Errorf("%w: file is too small, not a valid image", ErrCorrupt)
	}
	head := make([]byte, min(size, 512))
	if _, err := f.ReadAt(ctx, head, 0); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("read header: %w", err)
	}
	var d descriptor
	gtCache := o.GTCacheSize
	if gtCache <= 0 {
		gtCache = DefaultGTCacheSize
	}
	decoded := o.DecodedCacheSize
	if decoded <= 0 {
		decoded = decodedCacheBytes
	}
	if [4]byte(head[:4]) == magic {
		if size < 512 {
			return nil, fmt.Errorf("%w: sparse header cut short (%d bytes)", ErrCorrupt, size)
		}
		e := &extent{f: f, name: im.name}
		if err := openSparse(ctx, e, head, size); err != nil {
			return nil, err
		}
		im.extents = append(im.extents, e)
		im.createType = "monolithicSparse"
		if e.compressed {
			im.createType = "streamOptimized"
		}
		desc := make([]byte, min(descSize, max(size-sectorSize, 0)))
		if _, err := f.ReadAt(ctx, desc, sectorSize); err != nil && !errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("read descriptor: %w", err)
		}
		if err := parseCIDs(string(desc), &d); err != nil {
			return nil, err
		}
	} else if [4]byte(head[:4]) == [4]byte{'C', 'O', 'W', 'D'} {
		return nil, fmt.Errorf("%w: VMFS sparse (COWD) extents are not read (convert the image with qemu-img)", ErrUnsupported)
	} else {
		text := make([]byte, min(size, maxDescFile))
		if _, err := f.ReadAt(ctx, text, 0); err != nil && !errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("read descriptor: %w", err)
		}
		if i := strings.IndexByte(string(text), 0); i >= 0 {
			text = text[:i]
		}
		ct, err := parseCreateType(string(text))
		if err != nil {
			return nil, err
		}
		switch ct {
		case "monolithicFlat", "vmfs", "twoGbMaxExtentSparse", "twoGbMaxExtentFlat":
		case "vmfsSparse", "seSparse":
			return nil, fmt.Errorf("%w: createType %q", ErrUnsupported, ct)
		default:
			return nil, fmt.Errorf("%w: unsupported image type '%s'", ErrUnsupported, ct)
		}
		im.createType = ct
		if err := parseCIDs(string(text), &d); err != nil {
			return nil, err
		}
		lines, err := parseExtents(string(text))
		if err != nil {
			return nil, err
		}
		if err := im.openExtents(ctx, lines, o); err != nil {
			return nil, err
		}
	}
	im.cid, im.parentCID, im.parentHint = d.cid, d.parentCID, d.parentHint
	// One cache of each kind for the whole image, sized by its largest
	// table and grain, so that memory is bounded however many extents
	// the descriptor lists; keys carry the extent's index.
	var start, maxGT, maxGrain int64
	for i, e := range im.extents {
		e.start, e.id = start, int64(i)
		start += e.size
		if e.sparse {
			maxGT = max(maxGT, e.gtes*4+64)
			if e.compressed {
				maxGrain = max(maxGrain, e.grain)
			}
		}
	}
	if maxGT > 0 {
		gts := lru.New[[]uint32](int(max(gtCache/maxGT, 1)))
		var grains *lru.Cache[[]byte]
		var stored *lru.Cache[*storedGrain]
		if maxGrain > 0 {
			grains = lru.New[[]byte](int(max(decoded/maxGrain, 2)))
			stored = lru.New[*storedGrain](int(max(storedCacheBytes/storedEntryBytes(maxGrain), 2)))
		}
		fl, tv := &flight{}, &tableVersions{}
		for _, e := range im.extents {
			e.gtCache, e.grainCache, e.storedCache, e.flight, e.tables = gts, grains, stored, fl, tv
		}
	}
	im.size = start
	if im.parentHint != "" {
		if err := im.openParent(o); err != nil {
			return nil, err
		}
	}
	if o.Writable {
		if err := im.openWritable(ctx); err != nil {
			return nil, err
		}
	}
	im.Map = blockmap.Map{Format: "vmdk", End: im.size, Locate: im.locate, Backing: im.parent, File: f, Direct: im.direct,
		ReadOwn: func(ctx context.Context, r blockmap.Run, p []byte, off int64) error {
			_, err := im.readGrain(ctx, r, p, off, false)
			return err
		},
		TryOwn: func(r blockmap.Run, p []byte, off int64) bool {
			ok, err := im.readGrain(context.Background(), r, p, off, true)
			return ok && err == nil
		}}
	return im, nil
}

// openExtents opens the extents a descriptor file names.
func (im *Image) openExtents(ctx context.Context, lines []extentLine, o Options) error {
	for _, l := range lines {
		if l.typ == "ZERO" {
			im.extents = append(im.extents, &extent{typ: l.typ, size: l.sectors * sectorSize})
			continue
		}
		if o.OpenExtent == nil {
			return fmt.Errorf("%w: extent %q in another file, and nothing to open it with", ErrUnsupported, l.name)
		}
		f, shown, err := o.OpenExtent(l.name)
		if err != nil {
			return err
		}
		e := &extent{f: f, owned: true, name: shown, typ: l.typ}
		im.extents = append(im.extents, e)
		switch l.typ {
		case "FLAT", "VMFS":
			e.size = l.sectors * sectorSize
			e.flatOff = l.offset * sectorSize
		case "SPARSE":
			fs, err := aio.FileSize(f)
			if err != nil {
				return err
			}
			head := make([]byte, 512)
			if fs < 512 {
				return fmt.Errorf("%w: sparse extent %s of %d bytes", ErrCorrupt, shown, fs)
			}
			if _, err := f.ReadAt(ctx, head, 0); err != nil {
				return fmt.Errorf("read %s: %w", shown, err)
			}
			if [4]byte(head[:4]) != magic {
				return fmt.Errorf("%w: extent %s is not a VMDK sparse file", ErrCorrupt, shown)
			}
			if err := openSparse(ctx, e, head, fs); err != nil {
				return fmt.Errorf("extent %s: %w", shown, err)
			}
		}
	}
	var total int64
	for _, e := range im.extents {
		total += e.size
		if total > maxSectors*sectorSize {
			return fmt.Errorf("%w: extents add up to more than %d bytes", ErrCorrupt, int64(maxSectors*sectorSize))
		}
	}
	return nil
}

// openParent opens the delta disk's parent and checks its CID.
func (im *Image) openParent(o Options) error {
	if o.OpenParent == nil {
		return fmt.Errorf("%w: delta disk (parent %q) and nothing to open the parent with", ErrUnsupported, im.parentHint)
	}
	p, shown, err := o.OpenParent(im.parentHint)
	im.parentName = shown
	if err != nil {
		return fmt.Errorf("parent %s: %w", im.parentHint, err)
	}
	if p == nil {
		return nil // backing files not opened (inspection)
	}
	im.parent = p
	pv, ok := p.(*Image)
	if !ok {
		return fmt.Errorf("%w: parent %s is not a vmdk image", ErrCorrupt, shown)
	}
	if pv.cid != im.parentCID {
		return fmt.Errorf("%w: parent %s has CID %08x, the delta disk was made on parentCID %08x: the parent changed since (its data would be wrong)", ErrCorrupt, shown, pv.cid, im.parentCID)
	}
	if depth(p) > maxParentDepth {
		return fmt.Errorf("%w: chain of delta disks deeper than %d", ErrCorrupt, maxParentDepth)
	}
	return nil
}

func depth(img formats.Image) int {
	n := 0
	for v, ok := img.(*Image); ok && v != nil; v, ok = v.parent.(*Image) {
		n++
	}
	return n
}

// find returns the extent holding virtual offset off.
func (im *Image) find(off int64) *extent {
	i := sort.Search(len(im.extents), func(i int) bool { return off < im.extents[i].start+im.extents[i].size })
	if i < len(im.extents) && off >= im.extents[i].start {
		return im.extents[i]
	}
	return nil
}

// locate says where the bytes at off lie, to the end of their grain
// (sparse) or extent: a flat extent's file bytes (whose holes QEMU asks
// the file about), a ZERO extent's or zeroed grain's zeroes, an
// allocated grain in its extent file (a compressed one read by
// readGrain), an unallocated one as the parent (zeroes from nowhere
// without one or past its end). try: grain tables from the cache only.
func (im *Image) locate(ctx context.Context, off, n int64, try bool) (blockmap.Run, bool, error) {
	e := im.find(off)
	if e == nil {
		return blockmap.Run{}, true, fmt.Errorf("vmdk: %s: offset %d: %w", im.name, off, formats.ErrOutOfRange)
	}
	rel := off - e.start
	r := blockmap.Run{Kind: blockmap.Zero, N: min(n, e.size-rel), File: e.f, Name: e.name}
	switch {
	case e.f == nil: // ZERO
		return r, true, nil
	case !e.sparse:
		r.Kind, r.Host, r.Raw = blockmap.Data, e.flatOff+rel, true
		return r, true, nil
	}
	inG := rel % e.grain
	r.N = min(r.N, e.grain-inG)
	st, sector, ok, err := e.lookupGrain(ctx, rel, try)
	if err != nil {
		return r, true, fmt.Errorf("vmdk: %s: %w", im.name, err)
	}
	switch {
	case !ok:
		return r, false, nil
	case st == grainUnalloc && im.parent != nil && off < im.parent.Size():
		r.Kind = blockmap.Backing
	case st == grainUnalloc:
		r.Kind = blockmap.Hole
	case st == grainData && e.compressed:
		r.Kind, r.Host, r.Tag = blockmap.Own, int64(sector), e
	case st == grainData:
		r.Kind, r.Host = blockmap.Data, int64(sector)*sectorSize+inG
	}
	return r, true, nil
}

// readGrain reads p at off from the compressed grain r locates.
func (im *Image) readGrain(ctx context.Context, r blockmap.Run, p []byte, off int64, try bool) (bool, error) {
	e := r.Tag.(*extent)
	rel := off - e.start
	return e.readCompressed(ctx, uint32(r.Host), rel/e.grain, p, rel%e.grain, try)
}

// AllocatedSize is the host allocation of the image's files (the
// descriptor and every extent file), as qemu-img's actual-size sums them.
func (im *Image) AllocatedSize(ctx context.Context) (int64, error) {
	seen := map[int]bool{}
	var total int64
	add := func(f aio.File) error {
		if f == nil || seen[f.Fd()] {
			return nil
		}
		seen[f.Fd()] = true
		a, err := hostfile.Allocated(f.Fd())
		if err != nil {
			return fmt.Errorf("vmdk: stat %s: %w", f.Name(), err)
		}
		total += a
		return nil
	}
	if err := add(im.f); err != nil {
		return 0, err
	}
	for _, e := range im.extents {
		if err := add(e.f); err != nil {
			return 0, err
		}
	}
	return total, nil
}

// ExtentInfo is one extent in info's format-specific data, with
// qemu-img's names.
type ExtentInfo struct {
	Compressed  bool   `json:"compressed,omitempty"`
	VirtualSize int64  `json:"virtual-size"`
	Filename    string `json:"filename"`
	ClusterSize int64  `json:"cluster-size,omitempty"`
	Format      string `json:"format"`
}

// SpecificInfo is the vmdk object of qemu-img info's format-specific.
type SpecificInfo struct {
	CID        uint32       `json:"cid"`
	ParentCID  uint32       `json:"parent-cid"`
	CreateType string       `json:"create-type"`
	Extents    []ExtentInfo `json:"extents"`
}

func (im *Image) Info() formats.Info {
	actual, err := im.AllocatedSize(context.Background())
	if err != nil {
		actual = -1
	}
	in := formats.Info{Format: "vmdk", Filename: im.name, VirtualSize: im.size, ActualSize: actual, RequestAlignment: 1}
	spec := SpecificInfo{CID: im.cid, ParentCID: im.parentCID, CreateType: im.createType}
	for _, e := range im.extents {
		x := ExtentInfo{Compressed: e.compressed, VirtualSize: e.size, Filename: e.name, Format: e.typ}
		if e.sparse {
			x.ClusterSize = e.grain
		}
		spec.Extents = append(spec.Extents, x)
	}
	lines := extentLines(spec)
	in.ClusterSize = im.clusterSize()
	if im.parentHint != "" {
		in.BackingFilename = im.parentHint
		in.FullBackingFilename = im.parentName
		in.BackingFilenameFormat = "vmdk"
	}
	in.FormatSpecific = &formats.FormatSpecific{Type: "vmdk", Data: spec, Lines: lines}
	return in
}

// clusterSize is info's cluster size as QEMU's vmdk_get_info gives it:
// the first extent's grain when it is sparse and every extent is of its
// kind (flat or sparse, compressed or not, the same grain); else none.
func (im *Image) clusterSize() int64 {
	if len(im.extents) == 0 || !im.extents[0].sparse {
		return 0
	}
	first := im.extents[0]
	for _, e := range im.extents[1:] {
		if e.sparse != first.sparse || e.compressed != first.compressed || e.grain != first.grain {
			return 0
		}
	}
	return first.grain
}

// extentLines are info's human lines for spec, as qemu-img words them.
func extentLines(s SpecificInfo) []string {
	l := []string{fmt.Sprintf("cid: %d", s.CID), fmt.Sprintf("parent cid: %d", s.ParentCID), "create type: " + s.CreateType, "extents:"}
	for i, x := range s.Extents {
		l = append(l, fmt.Sprintf("    [%d]:", i))
		if x.Compressed {
			l = append(l, "        compressed: true")
		}
		l = append(l, fmt.Sprintf("        virtual size: %d", x.VirtualSize), "        filename: "+x.Filename)
		if x.ClusterSize != 0 {
			l = append(l, fmt.Sprintf("        cluster size: %d", x.ClusterSize))
		}
		l = append(l, "        format: "+x.Format)
	}
	return l
}

// Backing is the parent of a delta disk, or nil.
func (im *Image) Backing() formats.Image { return im.parent }

func (im *Image) Size() int64 { return im.size }

// Close links the grains still pending (write.go) and closes the
// image's files and its parent.
func (im *Image) Close() error {
	var first error
	keep := func(err error) { first = cmp.Or(first, err) }
	if im.w != nil {
		keep(im.linkPending(context.Background()))
	}
	for _, e := range im.extents {
		if e.owned && e.f != nil {
			keep(e.f.Close())
		}
	}
	if im.parent != nil {
		keep(im.parent.Close())
	}
	if im.f != nil {
		keep(im.f.Close())
	}
	return first
}
