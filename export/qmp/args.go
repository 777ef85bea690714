package qmp

import (
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strconv"

	"github.com/blockexport/blockexport/export/engine"
)

// args reads a command's arguments the way QEMU's QAPI input visitor
// does, member by member in the schema's order, and fails as it fails:
// the first missing member, wrong type or refused enum value, and then
// any member the schema does not have. From the command line (keyval)
// every scalar comes as a string and is converted.
type args struct {
	m      map[string]any
	prefix string // "file." for a nested object
	used   map[string]bool
	keyval bool
	err    *error // shared with nested objects: the first error wins
}

func newArgs(m map[string]any, keyval bool) *args {
	var err error
	return &args{m: m, used: map[string]bool{}, keyval: keyval, err: &err}
}

func (a *args) fail(format string, v ...any) {
	if *a.err == nil {
		*a.err = &engine.Error{Class: engine.Generic, Desc: fmt.Sprintf(format, v...)}
	}
}

// get returns the member's value; missing ones fail when required.
func (a *args) get(name string, required bool) (any, bool) {
	a.used[name] = true
	v, ok := a.m[name]
	if !ok {
		if required {
			a.fail("Parameter '%s%s' is missing", a.prefix, name)
		}
		return nil, false
	}
	return v, true
}

func (a *args) str(name string, required bool) string {
	v, ok := a.get(name, required)
	if !ok {
		return ""
	}
	s, ok := v.(string)
	if !ok {
		a.fail("Invalid parameter type for '%s%s', expected: string", a.prefix, name)
	}
	return s
}

// optStr is a string member that may be absent (nil then).
func (a *args) optStr(name string) *string {
	if _, ok := a.m[name]; !ok {
		a.used[name] = true
		return nil
	}
	s := a.str(name, false)
	return &s
}

func (a *args) integer(name string, required bool) int64 {
	v, ok := a.get(name, required)
	if !ok {
		return 0
	}
	switch v := v.(type) {
	case json.Number:
		if n, err := v.Int64(); err == nil {
			return n
		}
	case string:
		if n, err := strconv.ParseInt(v, 0, 64); a.keyval && err == nil {
			return n
		}
		if a.keyval {
			a.fail("Parameter '%s%s' expects integer", a.prefix, name)
			return 0
		}
	}
	a.fail("Invalid parameter type for '%s%s', expected: integer", a.prefix, name)
	return 0
}

func (a *args) boolean(name string) bool {
	v, ok := a.get(name, false)
	if !ok {
		return false
	}
	switch v := v.(type) {
	case bool:
		return v
	case string:
		if a.keyval {
			switch v {
			case "on", "yes", "true", "y":
				return true
			case "off", "no", "false", "n":
				return false
			}
			a.fail("Parameter '%s%s' expects 'on' or 'off'", a.prefix, name)
			return false
		}
	}
	a.fail("Invalid parameter type for '%s%s', expected: boolean", a.prefix, name)
	return false
}

func (a *args) enum(name string, required bool, values ...string) string {
	s := a.str(name, required)
	if *a.err == nil && s != "" && !slices.Contains(values, s) {
		a.fail("Parameter '%s%s' does not accept value '%s'", a.prefix, name, s)
	}
	return s
}

// strList is a list of strings: a JSON array, or from the command line
// keyval's numbered members (bitmaps.0=a,bitmaps.1=b), as QEMU's keyval
// makes a list of them; nil when absent.
func (a *args) strList(name string) []string {
	v, ok := a.get(name, false)
	if !ok {
		return nil
	}
	var items []any
	switch v := v.(type) {
	case []any:
		items = v
	case map[string]any:
		if !a.keyval {
			break
		}
		for i := range len(v) {
			item, ok := v[strconv.Itoa(i)]
			if !ok {
				a.fail("Parameter '%s%s.%d' is missing", a.prefix, name, i)
				return nil
			}
			items = append(items, item)
		}
	}
	if items == nil {
		if _, isList := v.([]any); !isList {
			a.fail("Invalid parameter type for '%s%s', expected: array", a.prefix, name)
			return nil
		}
	}
	out := make([]string, 0, len(items))
	for i, item := range items {
		s, ok := item.(string)
		if !ok {
			a.fail("Invalid parameter type for '%s%s[%d]', expected: string", a.prefix, name, i)
			return nil
		}
		out = append(out, s)
	}
	return out
}

// object is a nested object member; nil when absent or not an object.
func (a *args) object(name string, required bool) *args {
	v, ok := a.get(name, required)
	if !ok {
		return nil
	}
	m, ok := v.(map[string]any)
	if !ok {
		a.fail("Invalid parameter type for '%s%s', expected: object", a.prefix, name)
		return nil
	}
	return &args{m: m, prefix: a.prefix + name + ".", used: map[string]bool{}, keyval: a.keyval, err: a.err}
}

// done fails on the first member nobody asked for, in name order (QEMU
// walks a hash table; one name is what a script sees) and returns the
// first error.
func (a *args) done() error {
	var extra []string
	for k := range a.m {
		if !a.used[k] {
			extra = append(extra, k)
		}
	}
	sort.Strings(extra)
	if len(extra) > 0 {
		a.fail("Parameter '%s%s' is unexpected", a.prefix, extra[0])
	}
	return *a.err
}

// ignore marks members QEMU's schema has and that change nothing here,
// so that a script giving them is not refused; a wrong type still is.
func (a *args) ignore(names ...string) {
	for _, n := range names {
		if v, ok := a.m[n]; ok {
			switch v.(type) {
			case map[string]any, []any:
			default:
				a.used[n] = true
			}
		}
	}
}
