package registry

import (
	"errors"
	"maps"
	"os"
	"testing"
)

func TestCreateOptionsReadAsQemuKeyval(t *testing.T) {
	o, err := ParseCreateOptions([]string{"subformat=fixed,size=1M", "backing_file=a,,b.img,backing_fmt=raw", "force_size=on,subformat=dynamic"})
	if err != nil {
		t.Fatal(err)
	}
	if o.Size != 1<<20 || o.BackingFile != "a,b.img" || o.BackingFormat != "raw" {
		t.Errorf("size %d backing %q %q, want 1048576 \"a,b.img\" \"raw\"", o.Size, o.BackingFile, o.BackingFormat)
	}
	want := map[string]string{"subformat": "dynamic", "force_size": "on"}
	if !maps.Equal(o.Keys, want) {
		t.Errorf("keys %v, want %v (a later key wins)", o.Keys, want)
	}
	if o, err := ParseCreateOptions(nil); err != nil || o.Size != -1 || o.Keys != nil {
		t.Errorf("no -o: %+v %v, want size -1 and no keys", o, err)
	}
	// As QemuOpts reads a bare key: KEY=on, or with "no" KEY=off.
	if o, err := ParseCreateOptions([]string{"subformat=fixed,force_size,nolazy_refcounts"}); err != nil || !maps.Equal(o.Keys, map[string]string{"subformat": "fixed", "force_size": "on", "lazy_refcounts": "off"}) {
		t.Errorf("bare keys: %v %v", o.Keys, err)
	}
	for _, bad := range []string{"size", "size=-1", "size=1Q", "size=16E"} {
		if _, err := ParseCreateOptions([]string{bad}); !errors.Is(err, ErrBadSpec) {
			t.Errorf("-o %s: %v, want a refusal", bad, err)
		}
	}
}

func TestCreateRefusesUnknownKeysBeforeMakingTheFile(t *testing.T) {
	dir := t.TempDir()
	for _, format := range CreatableFormats() {
		path := dir + "/img." + format
		err := Create(path, format, CreateOptions{Size: 1 << 20, Keys: map[string]string{"no_such_key": "1"}})
		if !errors.Is(err, ErrBadSpec) {
			t.Errorf("%s: %v, want a refused option", format, err)
		}
		if _, serr := os.Stat(path); serr == nil {
			t.Errorf("%s: the file was made although the option was refused", format)
		}
	}
}
