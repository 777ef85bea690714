package http

import "testing"

// FuzzCheckPartial: whatever a server puts in Content-Range and
// Content-Length, a reply passes only when it is exactly the range asked
// of an object of the size opened (or ErrChanged says the size moved); no
// panic, no overflow.
func FuzzCheckPartial(f *testing.F) {
	const top = int64(1<<63 - 1)
	for _, s := range []struct {
		cr         string
		cl, off, n int64
		size       int64
	}{
		{"bytes 0-0/1", 1, 0, 1, 1},
		{"bytes 0-9/10", 10, 0, 10, 10},
		{"bytes 9223372036854775806-9223372036854775806/9223372036854775807", 1, top - 1, 1, top},
		{"bytes 0-0/9223372036854775808", 1, 0, 1, MaxSize},
		{"bytes 4611686018427387903-4611686018427387903/4611686018427387904", 1, MaxSize - 1, 1, MaxSize},
		{"bytes -1-0/5", 2, -1, 2, 5},
		{"bytes 0-18446744073709551615/*", -1, 0, 1, 1},
		{"bytes 00000000000000000001-2/3", 2, 1, 2, 3},
		{"bytes 1-2/*", -1, 1, 2, 3},
		{"bytes 5-4/10", 0, 5, 0, 10},
		{"bytes +1-2/3", 2, 1, 2, 3},
	} {
		f.Add(s.cr, s.cl, s.off, s.n, s.size)
	}
	f.Fuzz(func(t *testing.T, cr string, cl, off, n, size int64) {
		if n <= 0 || off < 0 || size < 0 || off > size-n {
			return // the caller never asks such a range
		}
		err := CheckPartial(cr, cl, off, n, size)
		if err != nil {
			return
		}
		first, last, total, perr := ParseContentRange(cr)
		if perr != nil || first != off || last != off+n-1 || total >= 0 && total != size || cl >= 0 && cl != n {
			t.Fatalf("accepted %q (Content-Length %d) for %d+%d of %d", cr, cl, off, n, size)
		}
	})
}
