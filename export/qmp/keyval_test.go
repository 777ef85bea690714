package qmp

import (
	"bufio"
	"errors"
	"fmt"
	"strings"
	"testing"
)

func TestKeyvalParsesQEMUSyntax(t *testing.T) {
	for _, tc := range []struct {
		in, implied, want string
	}{
		{"driver=file,filename=/a,,b", "", "map[driver:file filename:/a,b]"},
		{"nbd,id=e", "type", "map[id:e type:nbd]"},
		{"file.driver=file,file.filename=x,driver=qcow2", "", "map[driver:qcow2 file:map[driver:file filename:x]]"},
		{"a=1,a=2", "", "map[a:2]"},
		{"a=", "", "map[a:]"},
		{"addr.type=unix,addr.path=/s,,t", "", "map[addr:map[path:/s,t type:unix]]"},
	} {
		m, err := ParseKeyval(tc.in, tc.implied)
		if err != nil || fmt.Sprint(m) != tc.want {
			t.Errorf("ParseKeyval(%q): %v, %v; want %s", tc.in, m, err, tc.want)
		}
	}
}

func TestKeyvalRefusesWhatQEMURefuses(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"driver", "Expected '=' after parameter 'driver'"},
		{"=x", "Invalid parameter ''"},
		{"a.b=1,a=2", "Parameters 'a' used inconsistently"},
		{"a=2,a.b=1", "Parameters 'a' used inconsistently"},
		{"a..b=1", "Invalid parameter 'a..b'"},
	} {
		_, err := ParseKeyval(tc.in, "")
		if err == nil || err.Error() != tc.want {
			t.Errorf("ParseKeyval(%q): %v, want %q", tc.in, err, tc.want)
		}
	}
}

func TestScannerSplitsValuesAsQEMUsStreamerDoes(t *testing.T) {
	in := "{\"a\":\n1}{\"b\":\"}{\\\"\"}  [1]\n\"s\" 12 }"
	sc := &scanner{r: bufio.NewReader(strings.NewReader(in))}
	want := []string{"{\"a\":\n1}", `{"b":"}{\""}`, "[1]", `"s"`, "12", "}"}
	for i, w := range want {
		got, err := sc.next()
		if err != nil || string(got) != w {
			t.Fatalf("value %d: %q, %v; want %q", i, got, err, w)
		}
	}
	if _, err := sc.next(); err == nil {
		t.Fatal("a value past the end of the input")
	}
}

func TestScannerDropsOversizedValueWhole(t *testing.T) {
	in := `{"x":"` + strings.Repeat("a", maxMessage) + `"} {"y":1}`
	sc := &scanner{r: bufio.NewReader(strings.NewReader(in))}
	if _, err := sc.next(); !errors.Is(err, errTooBig) {
		t.Fatalf("oversized value: %v", err)
	}
	if got, err := sc.next(); err != nil || string(got) != `{"y":1}` {
		t.Fatalf("the value after: %q, %v", got, err)
	}
}

// FuzzKeyval: no input makes the parser panic or loop, and what it
// accepts has no empty key.
func FuzzKeyval(f *testing.F) {
	for _, s := range []string{"driver=file,filename=/a,,b", "a.b.c=1", "nbd,id=e", ",,", "a=1,,", "=", "a.=1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		m, err := ParseKeyval(s, "type")
		if err == nil {
			if _, ok := m[""]; ok {
				t.Fatalf("%q: an empty key", s)
			}
		}
	})
}
