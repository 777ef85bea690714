package qmp

import (
	"bufio"
	"errors"
	"io"
)

// QEMU's JSON streamer splits its input into top-level values by brace
// depth, not by lines, and after an error starts again at the next
// value; its limits keep one client from making it hold unbounded input.
// scanner does the same, so that a script that sends a command over
// several lines, or two on one, is read as QEMU reads it.
const (
	maxMessage = 8 << 20 // QEMU allows 64 MiB; no command here needs a fraction of this
	maxNesting = 1024    // QEMU's MAX_NESTING
)

// errTooBig and errTooDeep are reported with QEMU's wording.
var (
	errTooBig  = errors.New("JSON token size limit exceeded")
	errTooDeep = errors.New("JSON nesting depth limit exceeded")
)

type scanner struct {
	r *bufio.Reader
}

// next returns the next top-level value's bytes, or an error for one
// that broke a limit (the value is skipped) or for the end of input.
func (s *scanner) next() ([]byte, error) {
	var buf []byte
	depth, inString, escaped := 0, false, false
	over, deep := false, false
	// end says the value is complete, reporting a broken limit instead.
	end := func() ([]byte, error) {
		switch {
		case over:
			return nil, errTooBig
		case deep:
			return nil, errTooDeep
		}
		return buf, nil
	}
	for {
		b, err := s.r.ReadByte()
		if err != nil {
			if err == io.EOF && len(buf) > 0 && depth == 0 && !inString {
				return end()
			}
			return nil, err
		}
		if depth == 0 && !inString && isSpace(b) {
			if len(buf) > 0 || over {
				return end() // a top-level scalar ends at white space
			}
			continue
		}
		if len(buf) >= maxMessage {
			over, buf = true, buf[:0]
		}
		if !over {
			buf = append(buf, b)
		}
		switch {
		case inString:
			switch {
			case escaped:
				escaped = false
			case b == '\\':
				escaped = true
			case b == '"':
				inString = false
				if depth == 0 {
					return end()
				}
			}
		case b == '"':
			inString = true
		case b == '{' || b == '[':
			if depth++; depth > maxNesting {
				deep = true
			}
		case b == '}' || b == ']':
			if depth--; depth <= 0 {
				return end() // a stray closer is a value of its own, refused by the parser
			}
		}
	}
}

func isSpace(b byte) bool { return b == ' ' || b == '\n' || b == '\r' || b == '\t' }
