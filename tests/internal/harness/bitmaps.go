package harness

import (
	"bufio"
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
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
	sock := filepath.Join(t.TempDir(), "nbd.sock")
	srv := exec.Command("qemu-nbd", "-r", "-f", "qcow2", "-B", bitmap, "-k", sock, img)
	var log bytes.Buffer
	srv.Stdout, srv.Stderr = &log, &log
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- srv.Wait() }()
	defer func() {
		srv.Process.Kill() // it exits by itself once nbdinfo disconnects
		<-exited
	}()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		select {
		case err := <-exited:
			exited <- err
			t.Fatalf("qemu-nbd -B %s exited: %v\n%s", bitmap, err, log.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("qemu-nbd did not listen in time\n%s", log.String())
		}
	}
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
