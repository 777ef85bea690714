package registry

import (
	"errors"
	"math"
	"math/big"
	"strconv"
	"strings"
)

// ErrSizeSyntax and ErrSizeRange are QEMU's two refusals of a size: not a
// size at all (EINVAL), and a size of 2^64 bytes or more (ERANGE). The
// qemu-img verbs word each differently.
var (
	ErrSizeSyntax = errors.New("invalid size")
	ErrSizeRange  = errors.New("size out of range")
)

// ParseQemuSize parses a size as QEMU's qemu_strtosz does, so that the
// verbs that mirror qemu-img accept and refuse the same strings: a decimal
// (or 0x hexadecimal) number, a fraction only before a suffix, one
// optional suffix of b, k, M, G, T, P or E (powers of 1024, either case).
func ParseQemuSize(s string) (uint64, error) {
	t := strings.TrimLeft(s, " \t\n\v\f\r")
	t = strings.TrimPrefix(t, "+")
	if strings.HasPrefix(t, "0x") || strings.HasPrefix(t, "0X") {
		end := 2
		for end < len(t) && strings.IndexByte("0123456789abcdefABCDEF", t[end]) >= 0 {
			end++
		}
		if end == 2 {
			return 0, ErrSizeSyntax
		}
		v, err := strconv.ParseUint(t[2:end], 16, 64)
		if err != nil {
			return 0, ErrSizeRange
		}
		return withSuffix(v, 0, t[end:])
	}
	end := 0
	for end < len(t) && t[end] >= '0' && t[end] <= '9' {
		end++
	}
	if end == 0 {
		return 0, ErrSizeSyntax
	}
	v, err := strconv.ParseUint(t[:end], 10, 64)
	if err != nil {
		return 0, ErrSizeRange
	}
	rest := t[end:]
	frac := 0.0
	if strings.HasPrefix(rest, ".") {
		j := 1
		for j < len(rest) && rest[j] >= '0' && rest[j] <= '9' {
			j++
		}
		if j == 1 {
			return 0, ErrSizeSyntax
		}
		frac, _ = strconv.ParseFloat("0"+rest[:j], 64)
		rest = rest[j:]
		if rest == "" {
			return 0, ErrSizeSyntax // a fraction of a byte
		}
	}
	return withSuffix(v, frac, rest)
}

func withSuffix(v uint64, frac float64, rest string) (uint64, error) {
	shift := 0
	if rest != "" {
		i := strings.IndexByte("bkmgtpe", rest[0]|0x20)
		if i < 0 || len(rest) != 1 {
			return 0, ErrSizeSyntax
		}
		shift = 10 * i
	}
	mul := new(big.Int).Lsh(big.NewInt(1), uint(shift))
	n := new(big.Int).Mul(new(big.Int).SetUint64(v), mul)
	if frac > 0 {
		n.Add(n, big.NewInt(int64(frac*float64(uint64(1)<<shift))))
	}
	if !n.IsUint64() || n.Uint64() == math.MaxUint64 && frac > 0 {
		return 0, ErrSizeRange
	}
	return n.Uint64(), nil
}
