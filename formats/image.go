// Package formats defines the interface every image format implements and the
// errors front ends branch on. A format owns its on-disk layout and nothing
// else: it never sees a protocol type, and front ends never see its types.
package formats

import (
	"context"
	"encoding/json"
	"errors"

	"github.com/blockexport/blockexport/aio"
)

// Errors callers branch on with [errors.Is]. Front ends map each to one
// errno (FUSE) or error code (NBD); anything else that carries a
// [syscall.Errno] passes through, and the rest become EIO.
var (
	// ErrReadOnly: a write-type request reached an image opened read-only.
	ErrReadOnly = errors.New("image is read-only")
	// ErrNotSupported: the format cannot do this (e.g. shrink a qcow2).
	ErrNotSupported = errors.New("operation not supported by the image format")
	// ErrOutOfRange: the request lies (partly) beyond the end of the image.
	ErrOutOfRange = errors.New("request beyond the end of the image")
	// ErrUnknownFormat: the file is not in a format we know or was asked for.
	ErrUnknownFormat = errors.New("unknown image format")
)

// Image is a disk image of one format, opened for I/O.
//
// All methods are safe for concurrent use. Offsets and lengths are in bytes
// and must lie within [0, Size()) unless a method says otherwise; front ends
// clamp requests before calling.
type Image interface {
	// ReadAt fills p from off. It returns len(p) or an error.
	ReadAt(ctx context.Context, p []byte, off int64) (int, error)
	// WriteAt writes p at off. It returns len(p) or an error.
	WriteAt(ctx context.Context, p []byte, off int64) (int, error)
	// WriteZeroes makes [off, off+n) read as zeroes. mayUnmap allows the
	// format to deallocate the range instead of writing zeroes.
	WriteZeroes(ctx context.Context, off, n int64, mayUnmap bool) error
	// Discard tells the format [off, off+n) is no longer needed. What it
	// reads afterwards is unspecified (zeroes or the old data).
	Discard(ctx context.Context, off, n int64) error
	// Flush makes every completed write durable.
	Flush(ctx context.Context) error
	// Size is the virtual size in bytes.
	Size() int64
	// Resize changes the virtual size; a grown tail reads as zeroes.
	Resize(ctx context.Context, size int64) error
	// Extent describes the run of bytes that starts at off and shares one
	// allocation status, cut at off+n. off must be below Size().
	Extent(ctx context.Context, off, n int64) (Extent, error)
	// AllocatedSize is the number of bytes the image occupies on the host
	// (st_blocks*512 of its files), or -1 when that is not meaningful.
	AllocatedSize(ctx context.Context) (int64, error)
	// TryReadAt fills all of p from off if it can without waiting for a
	// device or a lock someone holds. false: it would wait, p is undefined,
	// and the caller uses ReadAt, on a coroutines.AfterMiss context when this
	// try reached the host file (so that aio does not try again).
	TryReadAt(p []byte, off int64) bool
	// TryWriteAt writes all of p at off if it can without waiting for a
	// device, metadata I/O or a lock (raw: a buffered write into the page
	// cache; qcow2: into a cluster it owns). done false: nothing was written,
	// the caller uses WriteAt; with done true, err is the write's outcome.
	TryWriteAt(p []byte, off int64) (done bool, err error)
	// Features says what the image can offer front ends.
	Features() Features
	// Info describes the image for `info` and logs.
	Info() Info
	// Close releases the image. It does not flush.
	Close() error
}

// Extent is a run of bytes with one allocation status, in the terms of
// `qemu-img map --output=json`.
type Extent struct {
	Start  int64 `json:"start"`
	Length int64 `json:"length"`
	// Data: the bytes are stored (SEEK_DATA stops here). Not data means a
	// hole: SEEK_HOLE stops here.
	Data bool `json:"data"`
	// Zero: the bytes are known to read as zeroes.
	Zero bool `json:"zero"`
	// Present: some layer of the backing chain allocates the bytes (as data
	// or as zeroes); otherwise they read as zeroes from nowhere.
	Present bool `json:"present"`
	// Depth is the layer that answers: 0 this image, 1 its backing file...;
	// for bytes no layer allocates, the depth of the last layer asked.
	Depth int `json:"depth"`
	// Offset is where the bytes lie in that layer's host file, when
	// HasOffset is set.
	Offset    int64 `json:"-"`
	HasOffset bool  `json:"-"`
	// File is the host file of the layer that answers.
	File string `json:"-"`
}

// Info is what a format tells about an image, for `blockexport info`. The
// JSON names and nesting are those of `qemu-img info --output=json`.
type Info struct {
	Format      string `json:"format"`
	Filename    string `json:"filename"`
	VirtualSize int64  `json:"virtual-size"`
	// ActualSize is the host allocation in bytes, -1 when unknown.
	ActualSize  int64 `json:"actual-size"`
	ClusterSize int64 `json:"cluster-size,omitempty"`
	DirtyFlag   bool  `json:"dirty-flag"`

	BackingFilename       string `json:"backing-filename,omitempty"`
	FullBackingFilename   string `json:"full-backing-filename,omitempty"`
	BackingFilenameFormat string `json:"backing-filename-format,omitempty"`

	FormatSpecific *FormatSpecific `json:"format-specific,omitempty"`
	Snapshots      []Snapshot      `json:"snapshots,omitempty"`

	// RequestAlignment is the smallest unit the host accepts for I/O.
	RequestAlignment int `json:"-"`
	// Remote: the image is on a server (NBD), with no host file: its JSON
	// has no actual-size or dirty-flag, as qemu-img's has none.
	Remote bool `json:"-"`
	// ServerLines describe the server's side (flags, block sizes), for
	// info's human output.
	ServerLines []string `json:"-"`
}

// MarshalJSON writes qemu-img info's object: for a remote image only the
// keys qemu-img prints for one.
func (i Info) MarshalJSON() ([]byte, error) {
	type plain Info // without this method
	if !i.Remote && i.ActualSize < 0 {
		// Unknown (an image in remote storage read through a format):
		// qemu-img leaves the key out.
		return json.Marshal(struct {
			plain
			ActualSize int64 `json:"actual-size,omitempty"`
		}{plain: plain(i)})
	}
	if !i.Remote {
		return json.Marshal(plain(i))
	}
	return json.Marshal(struct {
		VirtualSize int64  `json:"virtual-size"`
		Filename    string `json:"filename"`
		Format      string `json:"format"`
	}{i.VirtualSize, i.Filename, i.Format})
}

// FormatSpecific is qemu-img's "format-specific" object.
type FormatSpecific struct {
	Type string `json:"type"`
	// Data is the format's own object, with qemu-img's JSON names.
	Data any `json:"data"`
	// Lines are what `info` prints of it, as qemu-img words it.
	Lines []string `json:"-"`
}

// CheckResult is what a consistency check found, with the names and
// meaning of `qemu-img check --output=json` (zero counts are left out, as
// qemu-img leaves them out).
type CheckResult struct {
	Filename           string `json:"filename"`
	Format             string `json:"format"`
	CheckErrors        int64  `json:"check-errors"`
	ImageEndOffset     int64  `json:"image-end-offset,omitempty"`
	Corruptions        int64  `json:"corruptions,omitempty"`
	Leaks              int64  `json:"leaks,omitempty"`
	CorruptionsFixed   int64  `json:"corruptions-fixed,omitempty"`
	LeaksFixed         int64  `json:"leaks-fixed,omitempty"`
	TotalClusters      int64  `json:"total-clusters,omitempty"`
	AllocatedClusters  int64  `json:"allocated-clusters,omitempty"`
	FragmentedClusters int64  `json:"fragmented-clusters,omitempty"`
	CompressedClusters int64  `json:"compressed-clusters,omitempty"`
	// Messages name each problem, a line each, as qemu-img prints them.
	Messages []string `json:"-"`
}

// Snapshot is one internal snapshot of a qcow2 image.
type Snapshot struct {
	ID          string `json:"id"`
	Name        string `json:"name"`
	VMStateSize uint64 `json:"vm-state-size"`
	DateSec     uint32 `json:"date-sec"`
	DateNsec    uint32 `json:"date-nsec"`
	VMClockSec  uint64 `json:"vm-clock-sec"`
	VMClockNsec uint64 `json:"vm-clock-nsec"`
	// ICount is nil where the snapshot records none (QEMU's -1).
	ICount *uint64 `json:"icount,omitempty"`
}

// BackingOpener opens an image's backing file, read-only: path as the image
// names it (a relative name made relative to the image's directory),
// format as it names it ("": detect it). Formats with backing files get
// one from whoever opens them (package registry), so that no format needs to
// know the others.
type BackingOpener func(path, format string) (Image, error)

// Layered is implemented by images with a backing file.
type Layered interface {
	// Backing returns the backing image, or nil.
	Backing() Image
}

// Features are what an image offers front ends beyond reads and writes.
type Features struct {
	// FastZero: WriteZeroes writes no data (NBD's FAST_ZERO asks).
	FastZero bool
	// MayStall: a request may wait on a network peer that can stall for as
	// long as the reconnect timeout (HTTP(S) or S3 storage, in this image or
	// its backing chain): a front end then never lets one hold the thread
	// that reads its protocol for more than a moment.
	MayStall bool
}

// NoFastPath is what a format embeds when it has no way to finish a read
// or write without waiting: its tries always say "would wait", so front
// ends hand every request to a goroutine. It also offers no features.
type NoFastPath struct{}

func (NoFastPath) TryReadAt([]byte, int64) bool           { return false }
func (NoFastPath) TryWriteAt([]byte, int64) (bool, error) { return false, nil }
func (NoFastPath) Features() Features                     { return Features{} }

// ReadOnly is what a read-only format embeds: every write-type request
// is refused with ErrReadOnly, and a flush has nothing to write.
type ReadOnly struct{}

func (ReadOnly) WriteAt(context.Context, []byte, int64) (int, error)   { return 0, ErrReadOnly }
func (ReadOnly) WriteZeroes(context.Context, int64, int64, bool) error { return ErrReadOnly }
func (ReadOnly) Discard(context.Context, int64, int64) error           { return ErrReadOnly }
func (ReadOnly) Resize(context.Context, int64) error                   { return ErrReadOnly }
func (ReadOnly) Flush(context.Context) error                           { return nil }

// Completions is an image whose requests complete on descriptors of its
// own (an NBD client's sockets). By default a request waiting for its
// completion reads it itself, asleep in read(2) meanwhile; a serve loop
// with one thread may take that reading over, as QEMU's event loop does,
// waiting on these descriptors beside its own input, so that nothing
// sleeps per request on a second thread.
//
// The loop calls CompletionFds each time before it waits (a reconnect
// changes them); from the first call on, requests on those connections
// leave reading to the loop, except those that run in the loop itself
// (path coroutines.Lone). ServeCompletions reads what has arrived without
// waiting for more. ReleaseCompletions hands reading back to the
// requests; it must come before the loop stops answering, or requests
// left waiting would hang.
type Completions interface {
	CompletionFds(dst []int) []int
	ServeCompletions()
	ReleaseCompletions()
}

// NoFlusher is an image whose flushes can be skipped (qemu-img's
// cache=unsafe: a conversion's target, written back by the kernel later).
type NoFlusher interface {
	SetNoFlush(on bool)
}

// GrowAheader is an image whose file can grow in steps of n bytes ahead
// of its writes rather than write by write (cut back when closed): a new
// image a conversion fills.
type GrowAheader interface {
	SetGrowAhead(n int64)
}

// WriteZeroBuffers zeroes [off, off+n) by writing zeroes with write, 1 MiB
// at a time from a buffer aligned to align: for an image with no cheaper
// way (no zeroing fallocate, no WRITE_ZEROES).
func WriteZeroBuffers(ctx context.Context, write func(context.Context, []byte, int64) (int, error), off, n int64, align int) error {
	zero := aio.AlignedBuf(int(min(n, 1<<20)), align)
	for n > 0 {
		k := min(n, int64(len(zero)))
		if _, err := write(ctx, zero[:k], off); err != nil {
			return err
		}
		off, n = off+k, n-k
	}
	return nil
}
