package qcow2

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
)

// SetGrowAhead (convert into a new qcow2 file): the file grows in steps
// ahead of the allocations; a copy of it taken before Close (as a killed
// convert leaves it) is longer than its clusters and still check-clean
// and readable; Close cuts it back to the length the same writes give
// without growing ahead.
func TestGrowAheadCutBackAtClose(t *testing.T) {
	ctx := context.Background()
	const step = 4 << 20
	data := bytes.Repeat([]byte("grow ahead "), 200000)[:2<<20]
	lengths := map[bool]int64{}
	for _, grow := range []bool{false, true} {
		dir := t.TempDir()
		img := filepath.Join(dir, "g.qcow2")
		if err := Create(img, CreateOptions{Size: 64 << 20, ClusterSize: 65536}); err != nil {
			t.Fatal(err)
		}
		q := openRW(t, img)
		if grow {
			q.SetGrowAhead(step)
		}
		for _, off := range []int64{0, 5 << 20, 40 << 20} {
			if _, err := q.WriteAt(ctx, data, off); err != nil {
				t.Fatal(err)
			}
		}
		if err := q.Flush(ctx); err != nil {
			t.Fatal(err)
		}
		fi, err := os.Stat(img)
		if err != nil {
			t.Fatal(err)
		}
		if grow {
			if fi.Size()%step != 0 || fi.Size() <= q.fileSize {
				t.Fatalf("grown ahead: file %d bytes, clusters end at %d: want a longer multiple of %d", fi.Size(), q.fileSize, step)
			}
			// What a killed convert leaves: clean, and it reads back.
			killed := filepath.Join(dir, "killed.qcow2")
			b, err := os.ReadFile(img)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(killed, b, 0o644); err != nil {
				t.Fatal(err)
			}
			checkClean(t, killed)
			k := openRW(t, killed)
			got := make([]byte, len(data))
			if _, err := k.ReadAt(ctx, got, 40<<20); err != nil || !bytes.Equal(got, data) {
				t.Fatalf("the longer file reads back wrong (%v)", err)
			}
			k.Close()
		}
		if err := q.Close(); err != nil {
			t.Fatal(err)
		}
		fi, err = os.Stat(img)
		if err != nil {
			t.Fatal(err)
		}
		lengths[grow] = fi.Size()
		checkClean(t, img)
		r := openRW(t, img)
		got := make([]byte, len(data))
		if _, err := r.ReadAt(ctx, got, 5<<20); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("grow %v: reads back wrong (%v)", grow, err)
		}
		r.Close()
	}
	if lengths[true] != lengths[false] {
		t.Fatalf("after Close: %d bytes grown ahead, %d without", lengths[true], lengths[false])
	}
}
