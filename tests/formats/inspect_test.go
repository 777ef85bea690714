package formats

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// inspectImages builds the images info and map are checked on; each is
// named by what it exercises.
func inspectImages(t *testing.T, dir string) map[string]string {
	t.Helper()
	imgs := map[string]string{}
	sparse := harness.SparseImage(t, dir, "sparse.raw", 16<<20)
	f, _ := os.OpenFile(sparse, os.O_RDWR, 0)
	f.WriteAt([]byte(strings.Repeat("x", 1<<20)), 4<<20)
	f.Close()
	imgs["raw sparse"] = sparse

	v3 := filepath.Join(dir, "v3.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", v3, "64M")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 1 0 1M", "-c", "write -z 8M 1M", "-c", "write -P 2 63M 1M", v3)
	harness.Run(t, "qemu-img", "snapshot", "-c", "before", v3)
	imgs["qcow2 v3 with zero clusters and a snapshot"] = v3

	v2 := filepath.Join(dir, "v2.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "compat=0.10,cluster_size=4096", v2, "8M")
	harness.Run(t, "qemu-io", "-f", "qcow2", "-c", "write -P 3 4096 100k", v2)
	imgs["qcow2 v2, 4 KiB clusters"] = v2

	comp := filepath.Join(dir, "comp.qcow2")
	harness.Run(t, "qemu-img", "convert", "-c", "-f", "raw", "-O", "qcow2", "-o", "compression_type=zstd", sparse, comp)
	imgs["qcow2 zstd-compressed"] = comp

	imgs["qcow2 chain"] = harness.QcowChain(t, dir)
	return imgs
}

// intersect keeps, recursively, only the keys of a that b has too.
func intersect(a, b any) any {
	am, ok1 := a.(map[string]any)
	bm, ok2 := b.(map[string]any)
	if !ok1 || !ok2 {
		return a
	}
	out := map[string]any{}
	for k, v := range am {
		if bv, ok := bm[k]; ok {
			out[k] = intersect(v, bv)
		}
	}
	return out
}

func TestInfoJSONMatchesQemuImg(t *testing.T) {
	dir := t.TempDir()
	for name, img := range inspectImages(t, dir) {
		t.Run(name, func(t *testing.T) {
			for _, chain := range []bool{false, true} {
				args := []string{"info", "--output=json", img}
				ours := []string{"info", "--json", img}
				if chain {
					// qemu-img's spelling, accepted beside --json.
					args = []string{"info", "--backing-chain", "--output=json", img}
					ours = []string{"info", "--output=json", "--backing-chain", img}
				}
				var want, got any
				if err := json.Unmarshal([]byte(harness.Run(t, "qemu-img", args...)), &want); err != nil {
					t.Fatal(err)
				}
				code, out := harness.RunBlockexport(t, ours...)
				if code != 0 {
					t.Fatalf("blockexport info: exit %d: %s", code, out)
				}
				if err := json.Unmarshal([]byte(out), &got); err != nil {
					t.Fatalf("our JSON does not parse: %v\n%s", err, out)
				}
				if !chain {
					want, got = []any{want}, []any{got}
				}
				wl, gl := want.([]any), got.([]any)
				if len(wl) != len(gl) {
					t.Fatalf("chain of %d images, qemu-img says %d", len(gl), len(wl))
				}
				shared := 0
				for i := range wl {
					g := intersect(gl[i], wl[i])
					w := intersect(wl[i], gl[i])
					// Filenames differ in spelling (absolute vs relative)
					// along chains; compare their base names.
					for _, m := range []any{g, w} {
						mm := m.(map[string]any)
						for _, k := range []string{"filename", "full-backing-filename", "backing-filename"} {
							if s, ok := mm[k].(string); ok {
								mm[k] = filepath.Base(s)
							}
						}
					}
					if !reflect.DeepEqual(g, w) {
						gj, _ := json.Marshal(g)
						wj, _ := json.Marshal(w)
						t.Fatalf("layer %d differs on shared fields\n ours: %s\nqemu: %s", i, gj, wj)
					}
					shared += len(g.(map[string]any))
				}
				if shared < 5*len(wl) {
					t.Fatalf("only %d shared fields: the comparison would prove little", shared)
				}
			}
		})
	}
}

func TestMapJSONMatchesQemuImg(t *testing.T) {
	dir := t.TempDir()
	for name, img := range inspectImages(t, dir) {
		t.Run(name, func(t *testing.T) {
			var want, got []map[string]any
			if err := json.Unmarshal([]byte(harness.Run(t, "qemu-img", "map", "--output=json", img)), &want); err != nil {
				t.Fatal(err)
			}
			code, out := harness.RunBlockexport(t, "map", "--output=json", img)
			if code != 0 {
				t.Fatalf("blockexport map: exit %d: %s", code, out)
			}
			if err := json.Unmarshal([]byte(out), &got); err != nil {
				t.Fatalf("our JSON does not parse: %v\n%s", err, out)
			}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("map differs\n ours: %v\nqemu: %v", got, want)
			}
		})
	}
}

// TestOutputFlag: --output human is the default text, --output json is
// --json, and anything else is a usage error (exit 2, one line).
func TestOutputFlag(t *testing.T) {
	img := harness.RandomImage(t, t.TempDir(), 1<<20, 31)
	for _, cmd := range []string{"info", "map"} {
		_, plain := harness.RunBlockexport(t, cmd, "-f", "raw", img)
		code, human := harness.RunBlockexport(t, cmd, "-f", "raw", "--output", "human", img)
		if code != 0 || human != plain {
			t.Errorf("%s --output human: exit %d, %q; want the default text %q", cmd, code, human, plain)
		}
		_, viaJSON := harness.RunBlockexport(t, cmd, "-f", "raw", "--json", img)
		code, out := harness.RunBlockexport(t, cmd, "-f", "raw", "--output=json", img)
		if code != 0 || out != viaJSON || !strings.HasPrefix(strings.TrimSpace(out), "{") && !strings.HasPrefix(strings.TrimSpace(out), "[") {
			t.Errorf("%s --output=json: exit %d, %q; want %q", cmd, code, out, viaJSON)
		}
		code, out = harness.RunBlockexport(t, cmd, "--output", "xml", img)
		if code != 2 || !strings.Contains(out, `unknown --output "xml"`) || strings.Count(out, "\n") != 1 {
			t.Errorf("%s --output xml: exit %d, %q; want 2 and one line", cmd, code, out)
		}
	}
}

func TestInspectRefusesWhatItCannotRead(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.qcow2")
	os.WriteFile(bad, []byte("QFI\xfb\x00\x00\x00\x03garbage"), 0o644)
	for _, cmd := range []string{"info", "map"} {
		code, out := harness.RunBlockexport(t, cmd, bad)
		if code != 1 || strings.Count(strings.TrimSpace(out), "\n") != 0 || !strings.Contains(out, "qcow2") {
			t.Errorf("%s of a corrupt image: exit %d, %q; want 1 and one line", cmd, code, out)
		}
		code, out = harness.RunBlockexport(t, cmd, "--bogus", bad)
		if code != 2 {
			t.Errorf("%s with a bad flag: exit %d, %q; want 2", cmd, code, out)
		}
		code, _ = harness.RunBlockexport(t, cmd, filepath.Join(dir, "missing"))
		if code != 1 {
			t.Errorf("%s of a missing file: exit %d, want 1", cmd, code)
		}
	}
	code, out := harness.RunBlockexport(t, "info", "--json", "null:1G")
	var info struct {
		Format      string `json:"format"`
		VirtualSize int64  `json:"virtual-size"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &info) != nil || info.Format != "null" || info.VirtualSize != 1<<30 {
		t.Errorf("info of null:1G: exit %d, %s", code, out)
	}
}

// TestInfoHumanSizesMatchQemuImg: the virtual size line of info is
// byte-equal to qemu-img's for raw images whose sizes sit where its
// three significant digits and its unit switch at 1000 show (qemu-img
// rounds a raw image up to 512 bytes, so the sizes are multiples of it).
func TestInfoHumanSizesMatchQemuImg(t *testing.T) {
	dir := t.TempDir()
	for _, size := range []int64{0, 512, 1024, 1536, 1000 * 1024, 1023 * 1024, 1048064, 1 << 20, 1536 << 10, 10 << 30} {
		img := filepath.Join(dir, fmt.Sprintf("%d.raw", size))
		if err := os.WriteFile(img, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(img, size); err != nil {
			t.Fatal(err)
		}
		line := func(out string) string {
			for l := range strings.Lines(out) {
				if strings.HasPrefix(l, "virtual size:") {
					return l
				}
			}
			t.Fatalf("no virtual size line in\n%s", out)
			return ""
		}
		want := line(harness.Run(t, "qemu-img", "info", "-f", "raw", img))
		code, out := harness.RunBlockexport(t, "info", "-f", "raw", img)
		if code != 0 {
			t.Fatalf("blockexport info: exit %d: %s", code, out)
		}
		if got := line(out); got != want {
			t.Errorf("%d bytes: ours %q, qemu-img %q", size, got, want)
		}
	}
}
