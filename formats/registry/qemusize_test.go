package registry

import (
	"errors"
	"testing"
)

// TestParseQemuSizeAcceptsAndRefusesAsQemu: the strings qemu_strtosz
// takes, and its two refusals (syntax, and 2^64 or more), as qemu-img 7.2
// answered them.
func TestParseQemuSizeAcceptsAndRefusesAsQemu(t *testing.T) {
	for _, c := range []struct {
		in   string
		want uint64
		err  error
	}{
		{"0", 0, nil}, {"1000", 1000, nil}, {"5b", 5, nil}, {"5B", 5, nil}, {" 5", 5, nil},
		{"1.5k", 1536, nil}, {"1.0000001k", 1024, nil}, {"64M", 64 << 20, nil}, {"2P", 2 << 50, nil},
		{"0x10", 16, nil}, {"18446744073709551615", 1<<64 - 1, nil},
		{"", 0, ErrSizeSyntax}, {"-1", 0, ErrSizeSyntax}, {"1Q", 0, ErrSizeSyntax}, {"1.5", 0, ErrSizeSyntax},
		{".5k", 0, ErrSizeSyntax}, {"5kb", 0, ErrSizeSyntax}, {"1e3", 0, ErrSizeSyntax}, {"1k=2", 0, ErrSizeSyntax},
		{"16E", 0, ErrSizeRange}, {"18446744073709551616", 0, ErrSizeRange},
	} {
		got, err := ParseQemuSize(c.in)
		if !errors.Is(err, c.err) || (err == nil && got != c.want) {
			t.Errorf("ParseQemuSize(%q) = %d, %v; want %d, %v", c.in, got, err, c.want, c.err)
		}
	}
}
