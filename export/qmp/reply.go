package qmp

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
)

// QEMU writes its JSON with ", " and ": " between members; scripts that
// compare replies as text (iotests' reference output) see the same here.

func returnReply(id, ret any) string {
	if id == nil {
		return fmt.Sprintf(`{"return": %s}`, encode(ret))
	}
	return fmt.Sprintf(`{"return": %s, "id": %s}`, encode(ret), encode(id))
}

func errorReply(id any, class, desc string) string {
	e := fmt.Sprintf(`{"class": %s, "desc": %s}`, quote(class), quote(desc))
	if id == nil {
		return fmt.Sprintf(`{"error": %s}`, e)
	}
	return fmt.Sprintf(`{"id": %s, "error": %s}`, encode(id), e)
}

func quote(s string) string { return encode(s) }

// encode marshals v and spaces it as QEMU does.
func encode(v any) string {
	// QEMU escapes no HTML characters: "a >0 size" stays as it is.
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return "null" // only our own values are encoded: cannot happen
	}
	b := bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
	var out strings.Builder
	inString, escaped := false, false
	for _, c := range string(b) {
		out.WriteRune(c)
		switch {
		case inString && escaped:
			escaped = false
		case inString && c == '\\':
			escaped = true
		case c == '"':
			inString = !inString
		case !inString && (c == ',' || c == ':'):
			out.WriteByte(' ')
		}
	}
	return out.String()
}

func sortedKeys(m map[string]any) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
