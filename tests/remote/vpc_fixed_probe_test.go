package remote

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestHTTPFixedVHDProbedByItsFooter: a fixed VHD on nginx (its only
// footer at the end, where qemu-img probes raw) is probed as vpc without
// -f, as a local one is: info says vpc with one note and its JSON is
// qemu-img's given -f vpc; the FUSE and NBD exports read as the disk
// without the footer; -f raw is raw with a warning naming vpc, and a raw
// object stays raw with no note. The same object in S3 is probed alike.
func TestHTTPFixedVHDProbedByItsFooter(t *testing.T) {
	n := harness.StartNginx(t)
	dir := t.TempDir()
	raw := harness.RandomImage(t, dir, 4<<20, 4701)
	fixed := filepath.Join(dir, "fixed.vhd")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vpc", "-o", "subformat=fixed,force_size=on", raw, fixed)
	n.Put(t, "fixed.vhd", fixed)
	n.Put(t, "plain.img", raw)
	u := n.URL("http", "fixed.vhd")

	code, out := harness.RunBlockexport(t, "info", u)
	if code != 0 || !strings.Contains(out, "file format: vpc") || strings.Count(out, "note:") != 1 || !strings.Contains(out, "qemu-img") {
		t.Errorf("info %s: exit %d, want vpc and one note of qemu-img's raw:\n%s", u, code, out)
	}
	want := qemuImgJSON(t, "qemu-img", "info", "-f", "vpc", "--output=json", u)
	if _, got := harness.RunBlockexport(t, "info", "--output", "json", u); canonicalJSON(t, got) != want {
		t.Errorf("info --output json:\n got %s\nwant %s", got, want)
	}
	if code, out := harness.RunBlockexport(t, "info", "-f", "raw", u); code != 0 || !strings.Contains(out, "file format: raw") || !strings.Contains(out, "looks like a vpc image") {
		t.Errorf("info -f raw: exit %d, want raw with a warning naming vpc:\n%s", code, out)
	}
	if code, out := harness.RunBlockexport(t, "info", n.URL("http", "plain.img")); code != 0 || !strings.Contains(out, "file format: raw") || strings.Contains(out, "note:") {
		t.Errorf("info of a raw object: exit %d, want raw and no note:\n%s", code, out)
	}

	mnt := filepath.Join(t.TempDir(), "mnt")
	d := harness.StartExport(t, u, mnt)
	if fi, err := os.Stat(mnt); err != nil || fi.Size() != 4<<20 {
		t.Fatalf("the FUSE export of the fixed VHD: %v, size %v, want 4 MiB (the footer is not disk)", err, fi)
	}
	harness.MustEqualBytes(t, "the FUSE export", harness.ReadAll(t, mnt), harness.ReadAll(t, raw))
	d.StopClean()

	s := harness.StartNBD(t, u, false)
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", "-s", raw, s.URI)
	if got := strings.TrimSpace(harness.Run(t, "nbdinfo", "--size", s.URI)); got != "4194304" {
		t.Errorf("nbdinfo --size of the NBD export: %s, want 4194304", got)
	}

	s3 := harness.StartS3Server(t)
	s3.Put("fixed.vhd", fixed)
	if _, got := harness.RunBlockexport(t, "info", "--output", "json", "--s3-endpoint", s3.Endpoint, s3.URL("fixed.vhd")); !strings.Contains(got, `"format": "vpc"`) || !strings.Contains(got, `"virtual-size": 4194304`) {
		t.Errorf("info of the fixed VHD in S3: want vpc of 4 MiB:\n%s", got)
	}
}

// TestHTTPFixedVHDCraftedFootersProbeAsRaw: an object whose last 512
// bytes are a fixed VHD's footer with one field wrong (the cookie, the
// checksum, the disk size at 0, at the most a uint64 holds, or one byte
// past what the object holds before its footer, each with a checksum
// that fits, and a dynamic disk type) is probed as raw, as qemu-img
// probes it, whole: exit 0, format raw, the object's size, info's JSON
// qemu-img's.
func TestHTTPFixedVHDCraftedFootersProbeAsRaw(t *testing.T) {
	n := harness.StartNginx(t)
	dir := t.TempDir()
	raw := harness.RandomImage(t, dir, 1<<20, 4702)
	fixed := filepath.Join(dir, "fixed.vhd")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vpc", "-o", "subformat=fixed,force_size=on", raw, fixed)
	good := harness.ReadAll(t, fixed)
	const disk = 1 << 20
	for _, c := range []struct {
		name  string
		craft func(f []byte) // f is the footer
		sum   bool           // recompute the checksum after
	}{
		{"cookie", func(f []byte) { copy(f, "conectiy") }, true},
		{"checksum", func(f []byte) { f[64] ^= 0xff }, false},
		{"size 0", func(f []byte) { binary.BigEndian.PutUint64(f[48:], 0) }, true},
		{"size max", func(f []byte) { binary.BigEndian.PutUint64(f[48:], ^uint64(0)) }, true},
		{"size past the object", func(f []byte) { binary.BigEndian.PutUint64(f[48:], disk+1) }, true},
		{"dynamic type", func(f []byte) { binary.BigEndian.PutUint32(f[60:], 3) }, true},
	} {
		b := append([]byte(nil), good...)
		f := b[len(b)-512:]
		c.craft(f)
		if c.sum {
			binary.BigEndian.PutUint32(f[64:], 0)
			var sum uint32
			for _, x := range f {
				sum += uint32(x)
			}
			binary.BigEndian.PutUint32(f[64:], ^sum)
		}
		name := strings.ReplaceAll(c.name, " ", "-") + ".vhd"
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		n.Put(t, name, p)
		u := n.URL("http", name)
		code, out := harness.RunBlockexport(t, "info", "--output", "json", u)
		if code != 0 || !strings.Contains(out, `"format": "raw"`) || !strings.Contains(out, fmt.Sprintf(`"virtual-size": %d`, len(b))) {
			t.Errorf("%s: exit %d, want raw of %d bytes:\n%s", c.name, code, len(b), out)
		}
		if q := qemuImgJSON(t, "qemu-img", "info", "--output=json", u); canonicalJSON(t, out) != q {
			t.Errorf("%s: info --output json\n got %s\nwant qemu-img's %s", c.name, out, q)
		}
	}
}
