package formats

import (
	"bytes"
	"encoding/binary"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"unicode/utf16"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// vpcFixFooter rewrites the checksum of the 512-byte VHD footer at b.
func vpcFixFooter(b []byte) {
	binary.BigEndian.PutUint32(b[64:], 0)
	var sum uint32
	for _, c := range b[:512] {
		sum += uint32(c)
	}
	binary.BigEndian.PutUint32(b[64:], ^sum)
}

// vpcMakeDiff turns the dynamic VHD child (made by qemu-img) into a
// differencing disk on the VHD whose footer is parentFooter, with one
// W2ru parent locator naming locator, and its first allocated blocks'
// bitmaps set to the sector runs given (block index: [first, end) sectors).
func vpcMakeDiff(t *testing.T, child []byte, parentFooter []byte, locator string, runs map[int][2]int) []byte {
	t.Helper()
	be := binary.BigEndian
	body := append([]byte(nil), child[:len(child)-512]...)
	hdr := int(be.Uint64(body[16:]))
	bat := int(be.Uint64(body[hdr+16:]))
	bs := int(be.Uint32(body[hdr+32:]))
	bitmapSize := (bs/(8*512) + 511) &^ 511
	for blk, r := range runs {
		e := be.Uint32(body[bat+4*blk:])
		if e == 0xffffffff {
			t.Fatalf("block %d is not allocated in the child", blk)
		}
		bm := body[int(e)*512 : int(e)*512+bitmapSize]
		clear(bm)
		for s := r[0]; s < r[1]; s++ {
			bm[s/8] |= 0x80 >> (s % 8)
		}
	}
	u := utf16.Encode([]rune(locator))
	loc := make([]byte, 512)
	for i, c := range u {
		binary.LittleEndian.PutUint16(loc[2*i:], c)
	}
	locOff := len(body)
	body = append(body, loc...)
	copy(body[hdr+40:hdr+56], parentFooter[68:84]) // parent unique id
	le := body[hdr+576:]
	be.PutUint32(le, 0x57327275) // W2ru
	be.PutUint32(le[4:], 512)
	be.PutUint32(le[8:], uint32(2*len(u)))
	be.PutUint64(le[16:], uint64(locOff))
	footer := append([]byte(nil), body[:512]...)
	be.PutUint32(footer[60:], 4) // differencing
	vpcFixFooter(footer)
	copy(body, footer)
	return append(body, footer...)
}

// TestVpcDifferencingDiskReadsItsParent: a differencing VHD (made from a
// qemu-img dynamic VHD: type 4, a W2ru locator, the parent's unique id,
// sector bitmaps naming a few runs) reads each sector from the child
// where its bitmap bit is set (data, and zeroes the child holds) and from
// the parent elsewhere, through the FUSE export. QEMU 7.2 reads it
// without its parent (zeroes there), which the test shows. Locators that
// name a file outside the image's directory, an absolute path, the image
// itself, or a parent of another unique id are refused in one line, and
// so is a writable export of the differencing disk.
func TestVpcDifferencingDiskReadsItsParent(t *testing.T) {
	dir := t.TempDir()
	src := harness.RandomImage(t, dir, 8<<20, 29)
	parent := filepath.Join(dir, "parent.vhd")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "vpc", "-o", "force_size=on", src, parent)
	plain := filepath.Join(dir, "plain.vhd")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "vpc", "-o", "force_size=on", plain, "8M")
	harness.Run(t, "qemu-io", "-f", "vpc", "-c", "write -P 0x55 1M 64k", "-c", "write -P 0x66 5M 4k", plain)
	childBytes, err := os.ReadFile(plain)
	if err != nil {
		t.Fatal(err)
	}
	pb, err := os.ReadFile(parent)
	if err != nil {
		t.Fatal(err)
	}
	pfooter := pb[:512]
	// Block 0: sectors of 1M..1M+64k; block 2 (4M..): its first sector
	// (zeroes in the child) and 5M..5M+4k.
	runs := map[int][2]int{0: {2048, 2048 + 128}}
	diff := vpcMakeDiff(t, childBytes, pfooter, `.\parent.vhd`, runs)
	// Block 2 has two runs: set the second by hand on top.
	{
		be := binary.BigEndian
		hdr := int(be.Uint64(diff[16:]))
		bat := int(be.Uint64(diff[hdr+16:]))
		e := int(be.Uint32(diff[bat+8:]))
		bm := diff[e*512 : e*512+512]
		clear(bm)
		bm[0] = 0x80
		for s := 2048; s < 2056; s++ {
			bm[s/8] |= 0x80 >> (s % 8)
		}
	}
	child := filepath.Join(dir, "child.vhd")
	if err := os.WriteFile(child, diff, 0o644); err != nil {
		t.Fatal(err)
	}
	want, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	copy(want[1<<20:], bytes.Repeat([]byte{0x55}, 64<<10))
	clear(want[4<<20 : 4<<20+512])
	copy(want[5<<20:], bytes.Repeat([]byte{0x66}, 4<<10))

	// Differencing disks are not written: -w is refused in one line
	// naming a qcow2 overlay, and the file is left as it was.
	wmnt := filepath.Join(dir, "wmnt")
	os.Mkdir(wmnt, 0o755)
	if code, out := harness.TryExport(t, wmnt, "-w", child); code == 0 || !strings.Contains(out, "qcow2 overlay") || strings.Count(strings.TrimSpace(out), "\n") != 0 {
		t.Errorf("-w on a differencing disk: exit %d, want a one-line refusal naming a qcow2 overlay:\n%s", code, out)
	}
	if after, _ := os.ReadFile(child); !bytes.Equal(after, diff) {
		t.Error("a refused writable open changed the differencing disk")
	}
	mnt := filepath.Join(dir, "mnt")
	harness.StartExport(t, child, mnt)
	harness.MustEqualBytes(t, "differencing disk through the export", harness.ReadAll(t, mnt), want)
	if code, out := harness.RunBlockexport(t, "info", "--output=json", child); code != 0 || !strings.Contains(out, `"backing-filename": "parent.vhd"`) {
		t.Errorf("info: exit %d, want the parent named:\n%s", code, out)
	}
	exp := filepath.Join(dir, "want.raw")
	if err := os.WriteFile(exp, want, 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("qemu-img", "compare", "-f", "vpc", "-F", "raw", child, exp).CombinedOutput(); err == nil {
		t.Errorf("qemu-img now reads the differencing disk with its parent; the note in docs/formats.md (vpc, The differencing disk) is stale:\n%s", out)
	}

	outside := filepath.Join(filepath.Dir(dir), filepath.Base(dir)+"-outside.vhd")
	if err := os.WriteFile(outside, pb, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(outside) })
	otherID := append([]byte(nil), pfooter...)
	otherID[70] ^= 0xff
	for name, c := range map[string]struct {
		locator string
		footer  []byte
	}{
		"outside the directory": {`..\` + filepath.Base(outside), pfooter},
		"absolute path":         {"/etc/passwd", pfooter},
		"itself":                {`.\hostile.vhd`, pfooter},
		"another unique id":     {`.\parent.vhd`, otherID},
	} {
		t.Run(name, func(t *testing.T) {
			p := filepath.Join(dir, "hostile.vhd")
			if err := os.WriteFile(p, vpcMakeDiff(t, childBytes, c.footer, c.locator, runs), 0o644); err != nil {
				t.Fatal(err)
			}
			// map opens the chain (info alone opens no parent, as qemu-img).
			code, out := harness.RunBlockexport(t, "map", p)
			if code == 0 || strings.Count(strings.TrimSpace(out), "\n") != 0 {
				t.Fatalf("blockexport map: exit %d, want a one-line refusal:\n%s", code, out)
			}
			t.Logf("refused: %s", out)
		})
	}
}
