package harness

import (
	"bufio"
	"encoding/json"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// QemuBitmap is one persistent dirty bitmap as `qemu-img info
// --output=json` lists it.
type QemuBitmap struct {
	Name        string   `json:"name"`
	Flags       []string `json:"flags"`
	Granularity int64    `json:"granularity"`
}

// QemuBitmaps lists img's persistent dirty bitmaps by name, as qemu-img
// info sees them.
func QemuBitmaps(t *testing.T, img string) map[string]QemuBitmap {
	t.Helper()
	var info struct {
		FormatSpecific struct {
			Data struct {
				Bitmaps []QemuBitmap `json:"bitmaps"`
			} `json:"data"`
		} `json:"format-specific"`
	}
	if err := json.Unmarshal([]byte(Run(t, "qemu-img", "info", "-U", "--output=json", img)), &info); err != nil {
		t.Fatal(err)
	}
	m := map[string]QemuBitmap{}
	for _, b := range info.FormatSpecific.Data.Bitmaps {
		m[b.Name] = b
	}
	return m
}

// DirtyRanges is bitmap's dirty blocks in the qcow2 image img as qemu-nbd
// exports them (-B, read by nbdinfo --map=qemu:dirty-bitmap:NAME), merged
// into sorted [start, end) runs.
func DirtyRanges(t *testing.T, img, bitmap string) [][2]int64 {
	t.Helper()
	for _, tool := range [][2]string{{"qemu-nbd", "qemu-utils"}, {"nbdinfo", "libnbd-bin"}} {
		if _, err := exec.LookPath(tool[0]); err != nil {
			t.Fatalf("%s is missing: apt-get install %s", tool[0], tool[1])
		}
	}
	// --persistent: StartServerProc's connect to see it listen (the socket
	// file exists from bind, before listen) must not end it.
	sock := filepath.Join(t.TempDir(), "nbd.sock")
	srv := StartServerProc(t, sock, "qemu-nbd", "-t", "-r", "-f", "qcow2", "-B", bitmap, "-k", sock, img)
	defer srv.Kill()
	out := Run(t, "nbdinfo", "--map=qemu:dirty-bitmap:"+bitmap, "nbd+unix:///?socket="+sock)
	var runs [][2]int64
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 3 || f[2] != "1" {
			continue
		}
		start, err1 := strconv.ParseInt(f[0], 10, 64)
		n, err2 := strconv.ParseInt(f[1], 10, 64)
		if err1 != nil || err2 != nil {
			t.Fatalf("nbdinfo line %q", sc.Text())
		}
		if k := len(runs) - 1; k >= 0 && runs[k][1] == start {
			runs[k][1] += n
		} else {
			runs = append(runs, [2]int64{start, start + n})
		}
	}
	return runs
}

// DirtyRuns is what a bitmap of granularity gran over size bytes holds
// after writes to ranges ({offset, length} pairs): each rounded out to
// whole blocks, merged.
func DirtyRuns(size, gran int64, ranges ...[2]int64) [][2]int64 {
	dirty := make([]bool, (size+gran-1)/gran)
	for _, r := range ranges {
		for b := r[0] / gran; b <= (r[0]+r[1]-1)/gran; b++ {
			dirty[b] = true
		}
	}
	var runs [][2]int64
	for b, d := range dirty {
		if !d {
			continue
		}
		start, end := int64(b)*gran, min(int64(b+1)*gran, size)
		if k := len(runs) - 1; k >= 0 && runs[k][1] == start {
			runs[k][1] = end
		} else {
			runs = append(runs, [2]int64{start, end})
		}
	}
	return runs
}
