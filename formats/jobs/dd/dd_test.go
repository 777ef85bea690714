package dd

import "testing"

// TestPlanKeepsQemuArithmetic: count from the input's start, the length
// in whole sectors, a skip past the end (or past 2^63) an empty output.
func TestPlanKeepsQemuArithmetic(t *testing.T) {
	for _, c := range []struct {
		r    Request
		size int64
		want Plan
	}{
		{Request{BlockSize: 512}, 5_000_000, Plan{0, 5_000_192, 5_000_192, false}},
		{Request{BlockSize: 1 << 20, Count: 2, HasCount: true, Skip: 1, HasSkip: true}, 5_000_000, Plan{1 << 20, 2 << 20, 1 << 20, false}},
		{Request{BlockSize: 1000, Skip: 5000, HasSkip: true}, 5_000_000, Plan{5_000_000, 5_000_192, 192, false}},
		{Request{BlockSize: 1000, Skip: 5001, HasSkip: true}, 5_000_000, Plan{5_000_192, 5_000_192, 0, true}},
		{Request{BlockSize: 2, Skip: 1 << 62, HasSkip: true}, 4096, Plan{4096, 4096, 0, true}},
		{Request{BlockSize: 1 << 30, Count: 1 << 40, HasCount: true}, 4096, Plan{0, 4096, 4096, false}},
		{Request{BlockSize: 512, Count: 0, HasCount: true}, 4096, Plan{0, 0, 0, false}},
	} {
		if got := c.r.Plan(c.size); got != c.want {
			t.Errorf("%+v.Plan(%d) = %+v, want %+v", c.r, c.size, got, c.want)
		}
	}
}
