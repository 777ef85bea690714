package formats

import (
	"encoding/json"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestInfoWithMissingBackingFileAsQemuImg: info on a qcow2 image whose backing file is
// missing failed; qemu-img info describes the image from its own header
// (it opens no backing file) and names the missing file. Ours prints what
// qemu-img prints, human and JSON, with its exit status (0); with
// --backing-chain both fail (1), naming the missing file, as map does.
func TestInfoWithMissingBackingFileAsQemuImg(t *testing.T) {
	dir := t.TempDir()
	cases := map[string][]string{
		"absolute raw":   {"-b", filepath.Join(dir, "gone.raw"), "-F", "raw"},
		"relative qcow2": {"-b", "gone.qcow2", "-F", "qcow2"},
		"nbd server":     {"-b", "nbd+unix:///disk?socket=" + filepath.Join(dir, "nobody.sock"), "-F", "raw"},
	}
	for name, backing := range cases {
		t.Run(name, func(t *testing.T) {
			img := filepath.Join(dir, strings.ReplaceAll(name, " ", "-")+".qcow2")
			harness.Run(t, "qemu-img", append(append([]string{"create", "-q", "-u", "-f", "qcow2"}, backing...), img, "16M")...)

			want := harness.Run(t, "qemu-img", "info", img)
			code, got := harness.RunBlockexport(t, "info", img)
			if code != 0 || got != want {
				t.Errorf("info: exit %d, want 0 and qemu-img's output\n ours:\n%s\nqemu-img:\n%s", code, got, want)
			}
			var wantJ, gotJ any
			if err := json.Unmarshal([]byte(harness.Run(t, "qemu-img", "info", "--output=json", img)), &wantJ); err != nil {
				t.Fatal(err)
			}
			code, out := harness.RunBlockexport(t, "info", "--output=json", img)
			if err := json.Unmarshal([]byte(out), &gotJ); code != 0 || err != nil {
				t.Fatalf("info --output=json: exit %d, %v\n%s", code, err, out)
			}
			if g, w := intersect(gotJ, wantJ), intersect(wantJ, gotJ); !reflect.DeepEqual(g, w) || len(g.(map[string]any)) < 8 {
				t.Errorf("info --output=json differs from qemu-img's on shared fields\n ours: %v\nqemu: %v", g, w)
			}

			missing := backing[1]
			if strings.Contains(missing, "socket=") {
				missing = "nobody.sock"
			}
			if err := exec.Command("qemu-img", "info", "--backing-chain", img).Run(); err == nil {
				t.Fatal("qemu-img info --backing-chain went through: the test proves nothing")
			}
			for _, cmd := range [][]string{{"info", "--backing-chain", img}, {"map", img}} {
				code, out := harness.RunBlockexport(t, cmd...)
				if code != 1 || !strings.Contains(out, missing) {
					t.Errorf("%v: exit %d, want 1 naming %s:\n%s", cmd, code, missing, out)
				}
			}
		})
	}
}
