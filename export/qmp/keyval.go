package qmp

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
)

// ParseOption parses a QAPI command-line option the way QEMU's
// qemu-storage-daemon does: JSON when it starts with '{', else keyval
// (keyval true: scalars are strings, to be converted by type).
func ParseOption(s, implied string) (m map[string]any, keyval bool, err error) {
	if strings.HasPrefix(strings.TrimSpace(s), "{") {
		d := json.NewDecoder(strings.NewReader(s))
		d.UseNumber()
		if err := d.Decode(&m); err != nil {
			return nil, false, fmt.Errorf("JSON parse error: %v", err)
		}
		if d.More() {
			return nil, false, fmt.Errorf("JSON parse error: more than one value")
		}
		return m, false, nil
	}
	m, err = ParseKeyval(s, implied)
	return m, true, err
}

// ParseKeyval parses QEMU's keyval syntax: key=value pairs separated by
// commas, ",," standing for a comma in a value, dotted keys making
// nested objects (file.filename=x), and a first element without '='
// being the value of the implied key ("" for none). A key given twice
// takes its last value, as in QEMU.
func ParseKeyval(s, implied string) (map[string]any, error) {
	root := map[string]any{}
	first := true
	for rest := s; rest != ""; first = false {
		key, value, tail, err := keyvalPair(rest, first, implied)
		if err != nil {
			return nil, err
		}
		rest = tail
		if err := keyvalPut(root, key, value); err != nil {
			return nil, err
		}
	}
	return root, nil
}

// keyvalPair takes the first key=value off s.
func keyvalPair(s string, first bool, implied string) (key, value, rest string, err error) {
	eq := strings.IndexAny(s, "=,")
	if eq < 0 || s[eq] == ',' {
		if first && implied != "" {
			value, rest = keyvalValue(s)
			return implied, value, rest, nil
		}
		k := s
		if eq >= 0 {
			k = s[:eq]
		}
		if k == "" {
			return "", "", "", fmt.Errorf("Invalid parameter ''")
		}
		return "", "", "", fmt.Errorf("Expected '=' after parameter '%s'", k)
	}
	key = s[:eq]
	for _, part := range strings.Split(key, ".") {
		if !validKey(part) {
			return "", "", "", fmt.Errorf("Invalid parameter '%s'", key)
		}
	}
	value, rest = keyvalValue(s[eq+1:])
	return key, value, rest, nil
}

// keyvalValue reads a value up to a single comma; ",," is a comma.
func keyvalValue(s string) (value, rest string) {
	var b bytes.Buffer
	for i := 0; i < len(s); i++ {
		if s[i] != ',' {
			b.WriteByte(s[i])
			continue
		}
		if i+1 < len(s) && s[i+1] == ',' {
			b.WriteByte(',')
			i++
			continue
		}
		return b.String(), s[i+1:]
	}
	return b.String(), ""
}

// validKey is QEMU's keyval key fragment: a letter or digit first, then
// letters, digits, '-' and '_'.
func validKey(k string) bool {
	if k == "" || len(k) > 127 {
		return false
	}
	for i, c := range k {
		alnum := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
		if !alnum && (i == 0 || (c != '-' && c != '_')) {
			return false
		}
	}
	return true
}

// keyvalPut stores value under the dotted key.
func keyvalPut(root map[string]any, key, value string) error {
	parts := strings.Split(key, ".")
	cur := root
	for i, p := range parts[:len(parts)-1] {
		switch next := cur[p].(type) {
		case nil:
			m := map[string]any{}
			cur[p], cur = m, m
		case map[string]any:
			cur = next
		default:
			return fmt.Errorf("Parameters '%s' used inconsistently", strings.Join(parts[:i+1], "."))
		}
	}
	last := parts[len(parts)-1]
	if _, ok := cur[last].(map[string]any); ok {
		return fmt.Errorf("Parameters '%s' used inconsistently", key)
	}
	cur[last] = value
	return nil
}
