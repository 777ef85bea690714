package formats

import "context"

// Filter is what a filter image (copy-on-read, a partition's range, a disk
// whose size is pinned) embeds: the image it wraps, every optional
// capability of that image passed on (doing nothing where the wrapped
// image lacks it; [As] says whether it has it), so that a fast path does
// not vanish under a filter. A filter overrides what it changes.
type Filter struct {
	Image
}

// Wrapped is the image under the filter.
func (f Filter) Wrapped() Image { return f.Image }

func (f Filter) Backing() Image {
	if l, ok := f.Image.(Layered); ok {
		return l.Backing()
	}
	return nil
}

func (f Filter) CanLend() bool {
	l, ok := f.Image.(CacheLender)
	return ok && l.CanLend()
}

func (f Filter) LendAt(ctx context.Context, off, n int64, max int) ([][]byte, func(), bool, error) {
	if l, ok := f.Image.(CacheLender); ok {
		return l.LendAt(ctx, off, n, max)
	}
	return nil, nil, false, nil
}

func (f Filter) TryLendAt(off, n int64, v [][]byte) ([][]byte, bool) {
	return TryLend(f.Image, off, n, v)
}

func (f Filter) CompletionFds(dst []int) []int {
	if c, ok := f.Image.(Completions); ok {
		return c.CompletionFds(dst)
	}
	return dst
}

func (f Filter) ServeCompletions() {
	if c, ok := f.Image.(Completions); ok {
		c.ServeCompletions()
	}
}

func (f Filter) ReleaseCompletions() {
	if c, ok := f.Image.(Completions); ok {
		c.ReleaseCompletions()
	}
}

func (f Filter) SetNoFlush(on bool) {
	if n, ok := f.Image.(NoFlusher); ok {
		n.SetNoFlush(on)
	}
}

func (f Filter) SetGrowAhead(n int64) {
	if g, ok := f.Image.(GrowAheader); ok {
		g.SetGrowAhead(n)
	}
}

// As returns img as the optional interface T (PageLender, CacheLender,
// Layered, Completions, NoFlusher, GrowAheader) where img offers it,
// through filters only where the image under them does too. Front ends
// ask As, not a type assertion, before they choose a path by a capability.
func As[T any](img Image) (T, bool) {
	t, ok := img.(T)
	for under := img; ok; {
		f, isFilter := under.(interface{ Wrapped() Image })
		if !isFilter {
			return t, true
		}
		under = f.Wrapped()
		_, ok = under.(T)
	}
	var zero T
	return zero, false
}
