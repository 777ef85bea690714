package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"unicode/utf8"
)

// writeQemuJSON writes v as qemu-img's --output=json does, byte for
// byte: QEMU's JSON writer (qobject/json-writer.c) indents by four, and
// a QDict hands out its keys in the order of its hash buckets
// (qobject/qdict.c), not in the order they were put, so scripts that
// compare qemu-img's output with ours as text see the same lines.
func writeQemuJSON(w io.Writer, v any) error {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return err
	}
	dec := json.NewDecoder(&b)
	dec.UseNumber()
	var tree any
	if err := dec.Decode(&tree); err != nil {
		return err
	}
	var out strings.Builder
	qemuValue(&out, tree, 0)
	out.WriteString("\n")
	_, err := io.WriteString(w, out.String())
	return err
}

func qemuValue(b *strings.Builder, v any, depth int) {
	newline := func(d int) { b.WriteString("\n" + strings.Repeat(" ", 4*d)) }
	switch v := v.(type) {
	case map[string]any:
		keys := make([]string, 0, len(v))
		for k := range v {
			keys = append(keys, k)
		}
		slices.SortFunc(keys, func(a, b string) int { return int(qdictBucket(a)) - int(qdictBucket(b)) })
		b.WriteString("{")
		for i, k := range keys {
			if i > 0 {
				b.WriteString(",")
			}
			newline(depth + 1)
			qemuString(b, k)
			b.WriteString(": ")
			qemuValue(b, v[k], depth+1)
		}
		newline(depth)
		b.WriteString("}")
	case []any:
		b.WriteString("[")
		for i, e := range v {
			if i > 0 {
				b.WriteString(",")
			}
			newline(depth + 1)
			qemuValue(b, e, depth+1)
		}
		newline(depth)
		b.WriteString("]")
	case string:
		qemuString(b, v)
	case nil:
		b.WriteString("null")
	default: // json.Number, bool
		fmt.Fprint(b, v)
	}
}

// qdictBucket is the bucket QEMU's QDict keeps key in: tdb_hash(key) %
// QDICT_BUCKET_MAX (512). Keys in one bucket would come out newest
// first; no two keys qemu-img prints together share one.
func qdictBucket(key string) uint32 {
	v := uint32(0x238F13AF) * uint32(len(key))
	for i := 0; i < len(key); i++ {
		v += uint32(key[i]) << (uint(i) * 5 % 24)
	}
	return (1103515243*v + 12345) % 512
}

// qemuString quotes s as QEMU's JSON writer does: \uXXXX (upper-case
// hex) for control characters and everything past ASCII.
func qemuString(b *strings.Builder, s string) {
	b.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		default:
			switch {
			case r == utf8.RuneError:
				b.WriteString(`\uFFFD`)
			case r > 0xFFFF:
				r -= 0x10000
				fmt.Fprintf(b, `\u%04X\u%04X`, 0xD800+(r>>10), 0xDC00+(r&0x3FF))
			case r < 0x20 || r >= 0x7F:
				fmt.Fprintf(b, `\u%04X`, r)
			default:
				b.WriteRune(r)
			}
		}
	}
	b.WriteByte('"')
}
