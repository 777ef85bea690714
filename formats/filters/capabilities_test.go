// Package filters_test checks that every filter image passes on each
// optional capability of the image it wraps (formats.Filter), so that no
// fast path vanishes under a filter, and that none claims one the image
// under it lacks.
package filters_test

import (
	"context"
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/formats"
	"github.com/blockexport/blockexport/formats/drivers/null"
	"github.com/blockexport/blockexport/formats/filters/copyonread"
	"github.com/blockexport/blockexport/formats/filters/partition"
)

// bare is an image with no optional capability but those copy-on-read
// needs of what it wraps (a backing file, its reads).
type bare struct {
	*null.Image
	backing formats.Image
}

func (b *bare) Backing() formats.Image { return b.backing }
func (b *bare) ReadCopy(ctx context.Context, p []byte, off int64) (int, error) {
	return b.ReadAt(ctx, p, off)
}
func (b *bare) TryReadHere(p []byte, off int64) bool { return b.TryReadAt(p, off) }

// full is an image with every optional capability in package formats,
// noting what reaches it.
type full struct {
	bare
	pageAt, cacheAt  int64 // the offset the last lend asked for; -1: none
	served, released int
	noFlush          bool
	growAhead        int64
}

func (f *full) CanLend() bool { return true }
func (f *full) LendAt(_ context.Context, off, n int64, _ int) ([][]byte, func(), bool, error) {
	f.cacheAt = off
	return [][]byte{make([]byte, n)}, func() {}, true, nil
}
func (f *full) TryLendAt(off, n int64, v [][]byte) ([][]byte, bool) {
	f.pageAt = off
	return append(v, make([]byte, n)), true
}
func (f *full) CompletionFds(dst []int) []int { return append(dst, 42) }
func (f *full) ServeCompletions()             { f.served++ }
func (f *full) ReleaseCompletions()           { f.released++ }
func (f *full) SetNoFlush(on bool)            { f.noFlush = on }
func (f *full) SetGrowAhead(n int64)          { f.growAhead = n }

const diskSize = 8 << 20

func newBare(t *testing.T) *bare {
	img, err := null.New("disk", diskSize, true)
	if err != nil {
		t.Fatal(err)
	}
	back, _ := null.New("backing", diskSize, true)
	return &bare{Image: img, backing: back}
}

func newFull(t *testing.T) *full { return &full{bare: *newBare(t), pageAt: -1, cacheAt: -1} }

// capability is one optional interface of package formats, and how to
// tell that a call through filter img reached the image under it, in,
// where the filter's offset 0 is in's shift.
type capability struct {
	name    string
	typ     reflect.Type
	reaches func(img formats.Image, in *full, shift int64) bool
}

var capabilities = []capability{
	{"Layered", reflect.TypeFor[formats.Layered](), func(img formats.Image, in *full, _ int64) bool {
		l, ok := formats.As[formats.Layered](img)
		return ok && l.Backing() == in.backing
	}},
	{"CacheLender", reflect.TypeFor[formats.CacheLender](), func(img formats.Image, in *full, shift int64) bool {
		l, ok := formats.As[formats.CacheLender](img)
		if !ok || !l.CanLend() {
			return false
		}
		bufs, _, ok, err := l.LendAt(context.Background(), 4096, 512, 8)
		return ok && err == nil && len(bufs) == 1 && in.cacheAt == 4096+shift
	}},
	{"PageLender", reflect.TypeFor[formats.PageLender](), func(img formats.Image, in *full, shift int64) bool {
		l, ok := formats.As[formats.PageLender](img)
		if !ok {
			return false
		}
		v, ok := l.TryLendAt(4096, 512, nil)
		return ok && len(v) == 1 && in.pageAt == 4096+shift
	}},
	{"Completions", reflect.TypeFor[formats.Completions](), func(img formats.Image, in *full, _ int64) bool {
		c, ok := formats.As[formats.Completions](img)
		if !ok || !slices.Equal(c.CompletionFds(nil), []int{42}) {
			return false
		}
		c.ServeCompletions()
		c.ReleaseCompletions()
		return in.served == 1 && in.released == 1
	}},
	{"NoFlusher", reflect.TypeFor[formats.NoFlusher](), func(img formats.Image, in *full, _ int64) bool {
		n, ok := formats.As[formats.NoFlusher](img)
		if !ok {
			return false
		}
		n.SetNoFlush(true)
		return in.noFlush
	}},
	{"GrowAheader", reflect.TypeFor[formats.GrowAheader](), func(img formats.Image, in *full, _ int64) bool {
		g, ok := formats.As[formats.GrowAheader](img)
		if !ok {
			return false
		}
		g.SetGrowAhead(64 << 20)
		return in.growAhead == 64<<20
	}},
}

// filter is one filter image: how it wraps an image, where its offset 0
// lies in it, and the capabilities it withholds on purpose.
type filter struct {
	name     string
	wrap     func(formats.Image) (formats.Image, error)
	shift    int64
	withheld []string
}

var filters = []filter{
	{"formats.Filter", func(img formats.Image) (formats.Image, error) { return formats.Filter{Image: img}, nil }, 0, nil},
	// Copy-on-read lends nothing: a lend would read the backing chain
	// without copying it.
	{"copyonread", func(img formats.Image) (formats.Image, error) { return copyonread.New(img, "test") }, 0,
		[]string{"CacheLender", "PageLender"}},
	// A partition's range has no backing image: the disk's answers at
	// the disk's offsets.
	{"partition.Range", func(img formats.Image) (formats.Image, error) { return partition.NewRange(img, 1<<20, 4<<20, "p1") }, 1 << 20,
		[]string{"Layered"}},
	{"partition.FixedDisk", func(img formats.Image) (formats.Image, error) {
		return partition.FixedDisk{Filter: formats.Filter{Image: img}}, nil
	}, 0, nil},
}

// TestFiltersPassCapabilitiesOn: over an image with every optional
// capability, each filter offers each (at its own offsets) and a call
// reaches the image under it, but for those it withholds on purpose,
// which reach nothing.
func TestFiltersPassCapabilitiesOn(t *testing.T) {
	for _, f := range filters {
		for _, c := range capabilities {
			in := newFull(t)
			img, err := f.wrap(in)
			if err != nil {
				t.Fatalf("%s: %v", f.name, err)
			}
			got := c.reaches(img, in, f.shift)
			if slices.Contains(f.withheld, c.name) {
				if got || in.pageAt != -1 || in.cacheAt != -1 {
					t.Errorf("%s passes on %s, which it must withhold", f.name, c.name)
				}
				continue
			}
			if !got {
				t.Errorf("%s does not pass on %s of the image under it", f.name, c.name)
			}
		}
	}
}

// TestFiltersAddNoCapability: over an image with none, no filter claims
// one (formats.As), so a front end never takes a path nobody can serve.
// (Copy-on-read needs a backing file: Layered is there.)
func TestFiltersAddNoCapability(t *testing.T) {
	for _, f := range filters {
		img, err := f.wrap(newBare(t))
		if err != nil {
			t.Fatalf("%s: %v", f.name, err)
		}
		for name, has := range map[string]bool{
			"CacheLender": as[formats.CacheLender](img),
			"PageLender":  as[formats.PageLender](img),
			"Completions": as[formats.Completions](img),
			"NoFlusher":   as[formats.NoFlusher](img),
			"GrowAheader": as[formats.GrowAheader](img),
		} {
			if has {
				t.Errorf("%s over an image without %s offers it", f.name, name)
			}
		}
	}
}

func as[T any](img formats.Image) bool { _, ok := formats.As[T](img); return ok }

// TestEveryOptionalInterfaceIsChecked: every interface package formats
// declares besides Image is in the table above, and formats.Filter has
// its methods; a new optional interface fails here until a filter passes
// it on and the table checks that it does.
func TestEveryOptionalInterfaceIsChecked(t *testing.T) {
	files, err := filepath.Glob("../*.go")
	if err != nil {
		t.Fatal(err)
	}
	var declared []string
	for _, path := range files {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		file, err := parser.ParseFile(token.NewFileSet(), path, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(file, func(n ast.Node) bool {
			if ts, ok := n.(*ast.TypeSpec); ok {
				if _, isIface := ts.Type.(*ast.InterfaceType); isIface && ts.Name.IsExported() && ts.Name.Name != "Image" {
					declared = append(declared, ts.Name.Name)
				}
			}
			return true
		})
	}
	if len(declared) == 0 {
		t.Fatal("found no optional interface in package formats: wrong directory?")
	}
	filterType := reflect.TypeFor[formats.Filter]()
	for _, name := range declared {
		i := slices.IndexFunc(capabilities, func(c capability) bool { return c.name == name })
		if i < 0 {
			t.Errorf("formats.%s is not in the capability table", name)
			continue
		}
		if !filterType.Implements(capabilities[i].typ) {
			t.Errorf("formats.Filter does not pass on formats.%s", name)
		}
	}
}
