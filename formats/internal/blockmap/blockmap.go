// Package blockmap is the read side of a block-mapped image (vdi, vpc,
// vhdx, vmdk): the format says where the bytes at an offset lie (Locate:
// a host file's bytes, zeroes, the backing image's, or something it reads
// itself), and Map turns that into ReadAt, TryReadAt, TryLendAt and
// Extent, one loop each over the same runs, so that a read, its
// non-blocking try, a lend and block status never disagree.
package blockmap

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/internal/hostfile"
)

// Kind says where the bytes of a run come from.
type Kind int

const (
	// Zero: allocated, reads as zeroes (an unallocated vdi or vpc block, a
	// vhdx ZERO block, a vmdk zeroed grain): present, zero.
	Zero Kind = iota
	// Hole: reads as zeroes from nowhere (no layer allocates it).
	Hole
	// Data: the bytes of File at Host.
	Data
	// Backing: the backing image's bytes at the same offset; zeroes past
	// its end, or where none is opened.
	Backing
	// Own: data the format reads itself (a compressed grain, a partially
	// present block): Map.ReadOwn, Map.TryOwn; never lent.
	Own
)

// Run is where the bytes from an offset lie, for N bytes.
type Run struct {
	Kind Kind
	N    int64
	// File and Host: where Data lies (Own: what the format says). Name is
	// the file's name as shown ("": File.Name()).
	File aio.File
	Host int64
	Name string
	// Raw: the run is a plain file's bytes (a flat extent, a fixed or
	// static disk), as QEMU asks the file itself: its holes are data that
	// reads as zeroes, and past its end it reads zeroes.
	Raw bool
	// Tag is the format's own (Own: which extent).
	Tag any
}

// Map serves the reads of a read-only block-mapped image. It has no write
// fast path and no features (formats.NoFastPath).
type Map struct {
	formats.NoFastPath
	// Format names the format in messages.
	Format string
	// End is the virtual size.
	End int64
	// Locate says where the bytes at off lie, for at most n bytes (n > 0,
	// off+n <= End). try: from memory only; ok false: it would wait.
	Locate func(ctx context.Context, off, n int64, try bool) (r Run, ok bool, err error)
	// Backing is the image Backing runs read (nil: none opened).
	Backing formats.Image
	// File is the image's file: it lends the zero pages of Zero and Hole
	// runs, and its allocation is the image's (AllocatedSize).
	File aio.File
	// Direct: the files are O_DIRECT; tries and lends always wait.
	Direct bool
	// ReadOwn and TryOwn read an Own run's bytes at off into p.
	ReadOwn func(ctx context.Context, r Run, p []byte, off int64) error
	TryOwn  func(r Run, p []byte, off int64) bool
}

func (m *Map) inRange(off, n int64) bool { return off >= 0 && n >= 0 && off <= m.End && n <= m.End-off }

// fromBacking is how many of the n bytes at off the backing image holds.
func (m *Map) fromBacking(off, n int64) int64 {
	if m.Backing == nil {
		return 0
	}
	return max(0, min(n, m.Backing.Size()-off))
}

// ReadAt fills p from off, run by run; runs of one file that follow each
// other there are read in one call.
func (m *Map) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	if !m.inRange(off, int64(len(p))) {
		return 0, fmt.Errorf("%s: read %d bytes at %d: %w", m.Format, len(p), off, formats.ErrOutOfRange)
	}
	// next is the run after the last one read, already looked up to see
	// whether it merged (a vpc child's bitmap read, a vmdk grain table
	// look-up): it is not looked up again.
	var next Run
	for done := int64(0); done < int64(len(p)); {
		at := off + done
		r := next
		if r.N == 0 {
			var err error
			if r, _, err = m.Locate(ctx, at, int64(len(p))-done, false); err != nil {
				return int(done), err
			}
		}
		next = Run{}
		for r.Kind == Data && done+r.N < int64(len(p)) {
			nx, _, err := m.Locate(ctx, at+r.N, int64(len(p))-done-r.N, false)
			if err != nil {
				break // the loop's own look-up of it reports the error
			}
			if nx.Kind != Data || nx.File != r.File || nx.Host != r.Host+r.N || nx.Raw != r.Raw {
				next = nx
				break
			}
			r.N += nx.N
		}
		if err := m.read(ctx, r, p[done:done+r.N], at); err != nil {
			return int(done), err
		}
		done += r.N
	}
	return len(p), nil
}

func (m *Map) read(ctx context.Context, r Run, q []byte, at int64) error {
	switch r.Kind {
	case Data:
		n, err := r.File.ReadAt(ctx, q, r.Host)
		if r.Raw && errors.Is(err, io.EOF) {
			clear(q[n:]) // a plain file shorter than it says: zeroes, as QEMU reads it
			return nil
		}
		if err != nil {
			// Blocks were checked against the file at open: a short read
			// means it shrank under us, an error, not zeroes.
			return fmt.Errorf("%s: read %d bytes at %d (%s at %#x): %w", m.Format, len(q), at, r.File.Name(), r.Host, err)
		}
	case Backing:
		return m.ReadBacking(ctx, q, at)
	case Own:
		return m.ReadOwn(ctx, r, q, at)
	default:
		clear(q)
	}
	return nil
}

// ReadBacking reads p at off from the backing image: zeroes past its end,
// or where none is opened.
func (m *Map) ReadBacking(ctx context.Context, p []byte, off int64) error {
	k := m.fromBacking(off, int64(len(p)))
	if k > 0 {
		if _, err := m.Backing.ReadAt(ctx, p[:k], off); err != nil {
			return fmt.Errorf("%s: read %d bytes at %d from the backing image: %w", m.Format, k, off, err)
		}
	}
	clear(p[k:])
	return nil
}

// TryReadAt fills p from off if every run's bytes are at hand (metadata
// in memory, data in the page cache or the backing image's own try).
func (m *Map) TryReadAt(p []byte, off int64) bool {
	if m.Direct || !m.inRange(off, int64(len(p))) {
		return false
	}
	for done := int64(0); done < int64(len(p)); {
		at := off + done
		r, ok, err := m.Locate(context.Background(), at, int64(len(p))-done, true)
		if err != nil || !ok {
			return false
		}
		q := p[done : done+r.N]
		switch r.Kind {
		case Data:
			if !r.File.TryReadAt(q, r.Host) {
				return false
			}
		case Backing:
			k := m.fromBacking(at, r.N)
			if k > 0 && !m.Backing.TryReadAt(q[:k], at) {
				return false
			}
			clear(q[k:])
		case Own:
			if m.TryOwn == nil || !m.TryOwn(r, q, at) {
				return false
			}
		default:
			clear(q)
		}
		done += r.N
	}
	return true
}

// TryLendAt is TryReadAt lending the files' pages (formats.PageLender),
// and the backing image's where it lends.
func (m *Map) TryLendAt(off, n int64, v [][]byte) ([][]byte, bool) {
	if m.Direct || n <= 0 || !m.inRange(off, n) {
		return v, false
	}
	ok := true
	for done := int64(0); done < n && ok; {
		at := off + done
		r, found, err := m.Locate(context.Background(), at, n-done, true)
		if err != nil || !found || r.N <= 0 {
			return v, false
		}
		switch r.Kind {
		case Data:
			v, ok = formats.LendFile(r.File, v, r.Host, r.N)
		case Backing:
			k := m.fromBacking(at, r.N)
			if k > 0 {
				v, ok = formats.TryLend(m.Backing, at, k, v)
			}
			if ok && k < r.N {
				v, ok = formats.LendZeroes(m.File, v, r.N-k)
			}
		case Own:
			return v, false
		default:
			v, ok = formats.LendZeroes(m.File, v, r.N)
		}
		done += r.N
	}
	return v, ok
}

// maxExtentSteps bounds the lookups of one Extent call.
const maxExtentSteps = 1 << 16

// Extent describes the runs from off that share one status, cut at off+n,
// as qemu-img map shows them: Data at its host offset (a Raw run cut
// where the file's holes begin or end, which read as zeroes), Own as data
// without an offset, Zero as present zeroes, Hole as zeroes from nowhere,
// Backing as the backing image maps it, one layer deeper.
func (m *Map) Extent(ctx context.Context, off, n int64) (formats.Extent, error) {
	if off < 0 || off >= m.End {
		return formats.Extent{}, fmt.Errorf("%s: extent at %d: %w", m.Format, off, formats.ErrOutOfRange)
	}
	n = min(n, m.End-off)
	r, _, err := m.Locate(ctx, off, n, false)
	if err != nil {
		return formats.Extent{}, err
	}
	for steps := 0; r.N < n && steps < maxExtentSteps; steps++ {
		nx, _, err := m.Locate(ctx, off+r.N, n-r.N, false)
		if err != nil || nx.Kind != r.Kind || nx.File != r.File || nx.Raw != r.Raw || nx.Kind == Data && nx.Host != r.Host+r.N {
			break
		}
		r.N += nx.N
	}
	e := formats.Extent{Start: off, Length: r.N}
	switch r.Kind {
	case Data, Own:
		e.Data, e.Present, e.File = true, true, r.Name
		if e.File == "" {
			e.File = r.File.Name()
		}
		if r.Kind == Data {
			e.Offset, e.HasOffset = r.Host, true
		}
		if r.Raw {
			e.Length, e.Zero = hostfile.Run(r.File.Fd(), r.Host, r.N)
		}
	case Backing:
		if k := m.fromBacking(off, r.N); k > 0 {
			be, err := m.Backing.Extent(ctx, off, k)
			if err != nil {
				return formats.Extent{}, fmt.Errorf("%s: map the backing image at %d: %w", m.Format, off, err)
			}
			be.Depth++
			return be, nil
		}
		e.Zero, e.Depth = true, 1 // past the backing image's end, or none opened
	case Zero:
		e.Zero, e.Present = true, true
	case Hole:
		e.Zero = true
	}
	if e.File == "" && m.File != nil && r.Kind != Backing {
		e.File = m.File.Name()
	}
	return e, nil
}

// AllocatedSize is the host allocation of the image's file.
func (m *Map) AllocatedSize(context.Context) (int64, error) {
	a, err := hostfile.Allocated(m.File.Fd())
	if err != nil {
		return 0, fmt.Errorf("%s: stat %s: %w", m.Format, m.File.Name(), err)
	}
	return a, nil
}

// ActualSize is AllocatedSize as info shows it: -1 when unknown.
func (m *Map) ActualSize() int64 {
	if a, err := m.AllocatedSize(context.Background()); err == nil {
		return a
	}
	return -1
}
