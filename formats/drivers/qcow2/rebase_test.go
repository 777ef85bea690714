package qcow2

import (
	"context"
	"errors"
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats"
)

// headerBacking opens path read-only and returns the backing name and
// format its header holds.
func headerBacking(t *testing.T, path string) (string, string) {
	t.Helper()
	f, err := aio.Open(path, aio.Options{Backend: aio.Threads})
	if err != nil {
		t.Fatal(err)
	}
	q, err := New(context.Background(), f, Options{OpenBacking: func(string, string) (formats.Image, error) { return nil, nil }})
	if err != nil {
		t.Fatalf("the image does not open: %v", err)
	}
	defer q.Close()
	return q.BackingName()
}

// TestSetBackingNeverPairsANameWithTheOtherFormat stops SetBacking after
// each of its writes in turn: every header left names the old backing
// file or the new one, with its own format or none (probed), never the
// other's.
func TestSetBackingNeverPairsANameWithTheOtherFormat(t *testing.T) {
	for _, tc := range []struct{ oldName, oldFormat, newName, newFormat string }{
		{"old.raw", "raw", "a/much/longer/path/to/new.qcow2", "qcow2"},
		{"old.qcow2", "qcow2", "new.qcow2", "qcow2"},
		{"", "", "new.raw", "raw"},
	} {
		for stop := int64(0); ; stop++ {
			path := filepath.Join(t.TempDir(), "top.qcow2")
			if err := Create(path, CreateOptions{Size: 1 << 20, BackingFile: tc.oldName, BackingFormat: tc.oldFormat}); err != nil {
				t.Fatal(err)
			}
			f, err := aio.Open(path, aio.Options{Backend: aio.Threads, Writable: true})
			if err != nil {
				t.Fatal(err)
			}
			d := &killedFile{File: f, n: math.MaxInt}
			q, err := New(context.Background(), d, Options{Writable: true, OpenBacking: func(string, string) (formats.Image, error) { return nil, nil }})
			if err != nil {
				t.Fatal(err)
			}
			d.n = d.writes + int(stop) // from here, stop writes get through
			err = q.SetBacking(context.Background(), tc.newName, tc.newFormat)
			q.f = f // the close's own writes are not the subject
			q.Close()
			name, format := headerBacking(t, path)
			switch {
			case name == tc.oldName && (format == tc.oldFormat || format == ""),
				name == tc.newName && (format == tc.newFormat || format == ""):
			default:
				t.Fatalf("%+v stopped after %d writes: the header names %q in format %q", tc, stop, name, format)
			}
			if err == nil {
				if name != tc.newName || format != tc.newFormat {
					t.Fatalf("%+v: done, the header names %q in format %q", tc, name, format)
				}
				if stop < 2 {
					t.Fatalf("%+v: done in %d writes: no step between was tested", tc, stop)
				}
				break
			}
			if !errors.Is(err, errKilled) {
				t.Fatalf("%+v: %v", tc, err)
			}
			os.Remove(path)
		}
	}
}
