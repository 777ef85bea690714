// Package vmdk reads VMDK images (read-only): a text descriptor file and
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
// opener (package probe: inside the image's directory, regular files, no
// loops), never by this package.
//
// Grain tables are cached in a bounded LRU, and so are decompressed grains.
// Writes are refused (formats.ErrReadOnly); the design keeps extents
// separate so that in-place writes can come later.
package vmdk

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
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
	// as package probe confines it; it returns the file and its name as
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
}

// Lock is what an open of a vmdk file locks: as qcow2's, nobody may write
// or resize a file whose metadata we read. Nothing writes one (a check's
// -r repairs nothing), so it asks for no more than a reader.
func Lock(_, _ bool) aio.Lock {
	return aio.Lock{Perm: aio.PermConsistentRead, Unshared: aio.PermWrite | aio.PermResize}
}

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
	fileSize   int64
	headerEnd  int64 // bytes of header no table or grain may lie in
	grainStart int64
	id         int64 // index in the image: cache keys are id<<40 | sector
	gtCache    *lru.Cache[[]uint32]
	grainCache *lru.Cache[[]byte]
	// storedCache holds where stored-only compressed grains lie
	// (stored.go); flight the loads under way. Both are the image's.
	storedCache *lru.Cache[*storedGrain]
	flight      *flight
	// scratch holds the compressed bytes of a grain while it inflates,
	// or a stored grain's bytes across its blocks (*[]byte of a marker
	// and two grains), reused for the same reason.
	scratch sync.Pool
}

// Image is an open VMDK image.
type Image struct {
	formats.NoFastPath          // no write fast path, no features; TryReadAt is its own
	formats.ReadOnly            // writes refused: write through a qcow2 overlay
	f                  aio.File // the file opened (descriptor or sparse)
	name               string
	direct             bool
	createType         string
	cid                uint32
	parentCID          uint32
	parentHint         string
	parentName         string
	parent             formats.Image
	extents            []*extent
	size               int64
}

// New opens the VMDK image of f, which it owns from now on (Close closes
// it; so does a failed New).
func New(ctx context.Context, f aio.File, o Options) (img *Image, err error) {
	im := &Image{f: f, name: o.Name, direct: o.Direct}
	if im.name == "" {
		im.name = f.Name()
	}
	defer func() {
		if err != nil {
			im.Close()
			err = fmt.Errorf("vmdk: %s: %w", im.name, err)
		}
	}()
	size, err := fileSize(f)
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
		h := parseHeader(head)
		if h.capacity == 0 && h.descOffset != 0 {
			// QEMU then reads the embedded descriptor as a descriptor
			// file, whose extents may name this very file: it recurses
			// without bound. Such a file is refused.
			return nil, fmt.Errorf("%w: sparse file of capacity 0 whose embedded descriptor is the image (QEMU recurses on it): refused", ErrCorrupt)
		}
		e := &extent{f: f, name: im.name, headerEnd: sectorSize}
		if _, err := openSparse(ctx, e, head, size); err != nil {
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
		fl := &flight{}
		for _, e := range im.extents {
			e.gtCache, e.grainCache, e.storedCache, e.flight = gts, grains, stored, fl
		}
	}
	im.size = start
	if im.parentHint != "" {
		if err := im.openParent(o); err != nil {
			return nil, err
		}
	}
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
			fs, err := fileSize(f)
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
			if h := parseHeader(head); h.capacity == 0 && h.descOffset != 0 {
				return fmt.Errorf("%w: sparse extent %s of capacity 0 with a descriptor of its own: refused", ErrCorrupt, shown)
			}
			e.headerEnd = sectorSize
			if _, err := openSparse(ctx, e, head, fs); err != nil {
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

func fileSize(f aio.File) (int64, error) {
	if !aio.HasFd(f) {
		return aio.FileSize(f) // a remote object
	}
	var st unix.Stat_t
	if err := unix.Fstat(f.Fd(), &st); err != nil {
		return 0, fmt.Errorf("stat %s: %w", f.Name(), err)
	}
	if st.Mode&unix.S_IFMT == unix.S_IFBLK {
		n, err := unix.Seek(f.Fd(), 0, io.SeekEnd)
		if err != nil {
			return 0, fmt.Errorf("size of %s: %w", f.Name(), err)
		}
		return n, nil
	}
	return st.Size, nil
}

// find returns the extent holding virtual offset off.
func (im *Image) find(off int64) *extent {
	lo, hi := 0, len(im.extents)
	for lo < hi {
		m := (lo + hi) / 2
		e := im.extents[m]
		if off < e.start {
			hi = m
		} else if off >= e.start+e.size {
			lo = m + 1
		} else {
			return e
		}
	}
	return nil
}

// piece is a run of the image with one source.
type piece struct {
	kind   int // grainUnalloc, grainZero, grainData
	e      *extent
	host   int64 // grainData, not compressed: byte offset in e.f
	sector uint32
	gidx   int64 // compressed: grain index; inGrain: offset in the grain
	inG    int64
	n      int64
}

// at describes the run at off of at most n bytes: up to the end of its
// grain (sparse) or extent. try: from cache only; ok false otherwise.
func (im *Image) at(ctx context.Context, off, n int64, try bool) (p piece, ok bool, err error) {
	e := im.find(off)
	if e == nil {
		return p, true, fmt.Errorf("offset %d: %w", off, formats.ErrOutOfRange)
	}
	rel := off - e.start
	p.e = e
	switch {
	case e.f == nil: // ZERO
		p.kind, p.n = grainZero, min(n, e.size-rel)
		return p, true, nil
	case !e.sparse:
		p.kind, p.host, p.n = grainData, e.flatOff+rel, min(n, e.size-rel)
		return p, true, nil
	}
	p.inG = rel % e.grain
	p.n = min(n, e.grain-p.inG, e.size-rel)
	p.gidx = rel / e.grain
	st, sector, ok, err := e.lookupGrain(ctx, rel, try)
	if err != nil || !ok {
		return p, ok, err
	}
	p.kind, p.sector = st, sector
	if st == grainData && !e.compressed {
		p.host = int64(sector)*sectorSize + p.inG
	}
	return p, true, nil
}

// ReadAt fills p from off.
func (im *Image) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	if off < 0 || off+int64(len(p)) > im.size {
		return 0, fmt.Errorf("vmdk: read %d bytes at %d: %w", len(p), off, formats.ErrOutOfRange)
	}
	done := 0
	for done < len(p) {
		pc, _, err := im.at(ctx, off+int64(done), int64(len(p)-done), false)
		if err != nil {
			return done, fmt.Errorf("vmdk: %s: %w", im.name, err)
		}
		// Merge following pieces that continue this one in the same file.
		if pc.kind == grainData && !pc.e.compressed {
			for done+int(pc.n) < len(p) {
				nx, _, err := im.at(ctx, off+int64(done)+pc.n, int64(len(p)-done)-pc.n, false)
				if err != nil || nx.kind != grainData || nx.e != pc.e || nx.e.compressed || nx.host != pc.host+pc.n {
					break
				}
				pc.n += nx.n
			}
		}
		if err := im.readPiece(ctx, pc, p[done:done+int(pc.n)], off+int64(done)); err != nil {
			return done, err
		}
		done += int(pc.n)
	}
	return len(p), nil
}

func (im *Image) readPiece(ctx context.Context, pc piece, b []byte, off int64) error {
	switch pc.kind {
	case grainZero:
		clear(b)
	case grainUnalloc:
		// A parent shorter than the delta reads as zeroes past its end,
		// as QEMU reads a short backing file.
		n := im.fromParent(off, len(b))
		if n > 0 {
			if _, err := im.parent.ReadAt(ctx, b[:n], off); err != nil {
				return fmt.Errorf("vmdk: %s: parent: %w", im.name, err)
			}
		}
		clear(b[n:])
	case grainData:
		if pc.e.compressed {
			_, err := pc.e.readCompressed(ctx, pc.sector, pc.gidx, b, pc.inG, false)
			return err
		}
		n, err := pc.e.f.ReadAt(ctx, b, pc.host)
		if errors.Is(err, io.EOF) {
			clear(b[n:]) // a flat extent shorter than it says: zeroes, as QEMU reads it
			return nil
		}
		if err != nil {
			return fmt.Errorf("vmdk: %s: read %d bytes at %d: %w", pc.e.name, len(b), pc.host, err)
		}
	}
	return nil
}

// fromParent is how many of the n bytes at off the parent holds: none
// without a parent or past its end.
func (im *Image) fromParent(off int64, n int) int {
	if im.parent == nil {
		return 0
	}
	return int(max(0, min(int64(n), im.parent.Size()-off)))
}

// TryReadAt fills p if every grain table it needs is cached and every
// byte is in the page cache (or a decompressed grain cached).
func (im *Image) TryReadAt(p []byte, off int64) bool {
	if off < 0 || off+int64(len(p)) > im.size || im.direct {
		return false
	}
	ctx := context.Background()
	done := 0
	for done < len(p) {
		pc, ok, err := im.at(ctx, off+int64(done), int64(len(p)-done), true)
		if err != nil || !ok {
			return false
		}
		b := p[done : done+int(pc.n)]
		switch pc.kind {
		case grainZero:
			clear(b)
		case grainUnalloc:
			n := im.fromParent(off+int64(done), len(b))
			if n > 0 && !im.parent.TryReadAt(b[:n], off+int64(done)) {
				return false
			}
			clear(b[n:])
		case grainData:
			if pc.e.compressed {
				if ok, err := pc.e.readCompressed(ctx, pc.sector, pc.gidx, b, pc.inG, true); !ok || err != nil {
					return false
				}
			} else if !pc.e.f.TryReadAt(b, pc.host) {
				return false
			}
		}
		done += int(pc.n)
	}
	return true
}

// TryLendAt is TryReadAt lending the extents' pages (formats.PageLender):
// not for compressed grains, which are decompressed into a buffer.
func (im *Image) TryLendAt(off, n int64, v [][]byte) ([][]byte, bool) {
	if off < 0 || n <= 0 || off+n > im.size || im.direct {
		return v, false
	}
	ctx := context.Background()
	ok := true
	for done := int64(0); done < n && ok; {
		at := off + done
		pc, found, err := im.at(ctx, at, n-done, true)
		if err != nil || !found || pc.n <= 0 {
			return v, false
		}
		switch pc.kind {
		case grainZero:
			v, ok = formats.LendZeroes(im.f, v, pc.n)
		case grainUnalloc:
			k := int64(im.fromParent(at, int(pc.n)))
			if k > 0 {
				v, ok = formats.TryLend(im.parent, at, k, v)
			}
			if ok && k < pc.n {
				v, ok = formats.LendZeroes(im.f, v, pc.n-k)
			}
		case grainData:
			if pc.e.compressed {
				return v, false
			}
			v, ok = formats.LendFile(pc.e.f, v, pc.host, pc.n)
		}
		done += pc.n
	}
	return v, ok
}

// Extent describes the run at off as qemu-img map shows it.
func (im *Image) Extent(ctx context.Context, off, n int64) (formats.Extent, error) {
	if off < 0 || off >= im.size {
		return formats.Extent{}, fmt.Errorf("vmdk: extent at %d: %w", off, formats.ErrOutOfRange)
	}
	n = min(n, im.size-off)
	pc, _, err := im.at(ctx, off, n, false)
	if err != nil {
		return formats.Extent{}, fmt.Errorf("vmdk: %s: %w", im.name, err)
	}
	x := formats.Extent{Start: off, Length: pc.n, Present: true}
	switch pc.kind {
	case grainZero:
		x.Zero = true
	case grainUnalloc:
		if im.fromParent(off, 1) > 0 {
			px, err := im.parent.Extent(ctx, off, pc.n)
			if err != nil {
				return formats.Extent{}, err
			}
			px.Depth++
			return px, nil
		}
		x.Present, x.Zero = false, true
	case grainData:
		x.Data, x.File = true, pc.e.name
		if !pc.e.compressed {
			x.Offset, x.HasOffset = pc.host, true
		}
		if !pc.e.sparse {
			// QEMU asks the flat file itself (BDRV_BLOCK_RECURSE): its
			// holes are data that reads as zeroes.
			x.Length, x.Zero = hostfile.Run(pc.e.f.Fd(), pc.host, pc.n)
		}
	}
	return x, nil
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
func (im *Image) Backing() formats.Image {
	if im.parent == nil {
		return nil
	}
	return im.parent
}

func (im *Image) Size() int64 { return im.size }

// Close closes the image's files and its parent.
func (im *Image) Close() error {
	var first error
	for _, e := range im.extents {
		if e.owned && e.f != nil {
			if err := e.f.Close(); err != nil && first == nil {
				first = err
			}
		}
	}
	if im.parent != nil {
		if err := im.parent.Close(); err != nil && first == nil {
			first = err
		}
	}
	if im.f != nil {
		if err := im.f.Close(); err != nil && first == nil {
			first = err
		}
	}
	return first
}
