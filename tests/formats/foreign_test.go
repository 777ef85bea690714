package formats

import (
	"encoding/binary"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/formats/registry"
	"github.com/blockexport/blockexport/tests/internal/harness"
)

// foreignImages makes one image of every format QEMU probes and
// blockexport does not read: by qemu-img where it creates the format, by
// hand (the probe's magic in a header) where it does not. The map is file
// -> the format qemu-img's probe names.
func foreignImages(t *testing.T, dir string) map[string]string {
	t.Helper()
	imgs := map[string]string{}
	for _, c := range []struct {
		file, format string
		opts         []string
	}{
		{"disk.vhdx", "vhdx", nil},
		{"dynamic.vhd", "vpc", nil},
		{"disk.vdi", "vdi", nil},
		{"disk.qed", "qed", nil},
		{"disk.hds", "parallels", nil},
		{"v1.qcow", "qcow", nil},
		{"secret.luks", "luks", []string{"--object", "secret,id=s0,data=pw", "-o", "key-secret=s0,iter-time=10"}},
	} {
		p := filepath.Join(dir, c.file)
		args := append([]string{"create", "-q", "-f", c.format}, c.opts...)
		// qemu-img times its LUKS key derivation by the thread's CPU
		// time, which this machine's clock counts too coarsely: 9 tries
		// of 20 ended "Unable to get accurate CPU usage", whatever the
		// iter-time. Tried again, up to 20 times.
		for try := 1; ; try++ {
			out, err := exec.Command("qemu-img", append(args, p, "4M")...).CombinedOutput()
			if err == nil {
				break
			}
			if try == 20 || !strings.Contains(string(out), "accurate CPU usage") {
				t.Fatalf("qemu-img %v: %v\n%s", append(args, p, "4M"), err, out)
			}
		}
		imgs[p] = c.format
	}
	write := func(name string, head []byte, size int64) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, head, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(p, size); err != nil {
			t.Fatal(err)
		}
		return p
	}
	bochs := make([]byte, 512)
	copy(bochs[0:], "Bochs Virtual HD Image")
	copy(bochs[32:], "Redolog")
	copy(bochs[48:], "Growing")
	binary.LittleEndian.PutUint32(bochs[64:], 0x00020000)
	imgs[write("redolog.img", bochs, 1<<20)] = "bochs"
	imgs[write("knoppix.img", []byte("#!/bin/sh\n#V2.0 Format\nmodprobe cloop file=$0 && mount -r -t iso9660 /dev/cloop $1\n"), 1<<20)] = "cloop"
	imgs[write("apple.dmg", nil, 1<<20)] = "dmg" // QEMU goes by the name
	return imgs
}

// TestForeignFormatsRefusedNamingTheFormat: a file in a format QEMU reads and blockexport
// does not (vhdx, vpc, vdi, qed, parallels, qcow, luks, bochs,
// cloop, dmg) was reported by info as raw and exported writable as raw
// bytes: a guest write landed in the container's metadata. Each is now
// refused in one line naming the format qemu-img names (info, map, fuse
// -w), and `-f raw` opens it as asked with a warning that names it. A
// fixed VHD (footer at the end only) and a raw file stay raw, as in QEMU.
func TestForeignFormatsRefusedNamingTheFormat(t *testing.T) {
	dir := t.TempDir()
	imgs := foreignImages(t, dir)
	for img, format := range imgs {
		t.Run(filepath.Base(img), func(t *testing.T) {
			// The expectation is qemu-img's own probe, where it can say.
			if !strings.HasSuffix(img, ".img") && !strings.HasSuffix(img, ".dmg") {
				var info struct{ Format string }
				out, err := exec.Command("qemu-img", "info", "--output=json", img).Output()
				if err != nil || json.Unmarshal(out, &info) != nil || info.Format != format {
					t.Fatalf("qemu-img info says %q (%v), the test expects %q", info.Format, err, format)
				}
			}
			before := harness.ReadAll(t, img)
			if slices.Contains(registry.WritableFormats(), format) {
				// Read and written here (its own tests write it): probed
				// as qemu-img probes it, and -f raw warns.
				if code, out := harness.RunBlockexport(t, "info", img); code != 0 || !strings.Contains(out, "file format: "+format+"\n") {
					t.Errorf("info: exit %d, want 0 and format %s:\n%s", code, format, out)
				}
				if code, out := harness.RunBlockexport(t, "info", "-f", "raw", img); code != 0 || !strings.Contains(out, "looks like a "+format+" image") {
					t.Errorf("info -f raw: exit %d, want 0 and a warning naming %s:\n%s", code, format, out)
				}
				harness.MustEqualBytes(t, "the image after info", harness.ReadAll(t, img), before)
				return
			}
			if slices.Contains(registry.ReadOnlyFormats(), format) {
				// Read here now (read-only): probed as qemu-img probes it,
				// and -w refused, pointing at an overlay.
				if code, out := harness.RunBlockexport(t, "info", img); code != 0 || !strings.Contains(out, "file format: "+format+"\n") {
					t.Errorf("info: exit %d, want 0 and format %s:\n%s", code, format, out)
				}
				mnt := filepath.Join(t.TempDir(), "export")
				if code, out := harness.TryExport(t, mnt, "-w", img); code != 1 || !strings.Contains(out, "qcow2") {
					t.Errorf("fuse -w: exit %d, want 1 and a refusal naming a qcow2 overlay:\n%s", code, out)
				}
				if code, out := harness.RunBlockexport(t, "info", "-f", "raw", img); code != 0 || !strings.Contains(out, "looks like a "+format+" image") {
					t.Errorf("info -f raw: exit %d, want 0 and a warning naming %s:\n%s", code, format, out)
				}
				harness.MustEqualBytes(t, "the image after the refusal", harness.ReadAll(t, img), before)
				return
			}
			for _, cmd := range [][]string{{"info", img}, {"info", "--output=json", img}, {"map", img}, {"check", img}} {
				code, out := harness.RunBlockexport(t, cmd...)
				if code != 1 || !strings.Contains(out, format+" images are not supported") {
					t.Errorf("%v: exit %d, want 1 and %q:\n%s", cmd, code, format+" images are not supported", out)
				}
				if n := strings.Count(strings.TrimSpace(out), "\n"); n != 0 {
					t.Errorf("%v: %d lines, want one:\n%s", cmd, n+1, out)
				}
			}
			mnt := filepath.Join(t.TempDir(), "export")
			if code, out := harness.TryExport(t, mnt, "-w", img); code != 1 || !strings.Contains(out, format+" images are not supported") {
				t.Errorf("fuse -w: exit %d, want 1 and the refusal:\n%s", code, out)
			}
			code, out := harness.RunBlockexport(t, "info", "-f", "raw", img)
			if code != 0 || !strings.Contains(out, "file format: raw") || !strings.Contains(out, "looks like a "+format+" image") {
				t.Errorf("info -f raw: exit %d, want 0, raw, and a warning naming %s:\n%s", code, format, out)
			}
			harness.MustEqualBytes(t, "the image after the refusals", harness.ReadAll(t, img), before)
		})
	}

	t.Run("backing file", func(t *testing.T) {
		// A qcow2 overlay over a parallels image (backing format probed)
		// and over one the header says is qed: both refused by name, not
		// read as raw.
		var hds, qed string
		for img, f := range imgs {
			switch {
			case f == "parallels":
				hds = img
			case f == "qed":
				qed = img
			}
		}
		probed := filepath.Join(dir, "over-hds.qcow2")
		harness.Run(t, "qemu-img", "create", "-q", "-u", "-f", "qcow2", "-b", hds, "-F", "parallels", probed, "4M")
		dropBackingFormat(t, probed)
		named := filepath.Join(dir, "over-qed.qcow2")
		harness.Run(t, "qemu-img", "create", "-q", "-u", "-f", "qcow2", "-b", qed, "-F", "qed", named, "4M")
		// The named one goes to the opener as the header names it, which
		// refuses it by name as it refuses a probed one.
		for img, want := range map[string]string{probed: "parallels images are not supported", named: "qed images are not supported"} {
			if code, out := harness.RunBlockexport(t, "map", img); code != 1 || !strings.Contains(out, want) {
				t.Errorf("map %s: exit %d, want 1 and %q:\n%s", filepath.Base(img), code, want, out)
			}
		}
	})

	t.Run("stays raw", func(t *testing.T) {
		fixed := filepath.Join(dir, "fixed.vhd")
		harness.Run(t, "qemu-img", "create", "-q", "-f", "vpc", "-o", "subformat=fixed", fixed, "4M")
		plain := filepath.Join(dir, "plain.img")
		harness.Run(t, "qemu-img", "create", "-q", "-f", "raw", plain, "4M")
		short := filepath.Join(dir, "short.img") // a prefix of cloop's magic: QEMU pads and says raw
		if err := os.WriteFile(short, []byte("#!/bin/sh\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		for _, img := range []string{fixed, plain, short} {
			code, out := harness.RunBlockexport(t, "info", img)
			if code != 0 || !strings.Contains(out, "file format: raw") {
				t.Errorf("info %s: exit %d, want raw as qemu-img says:\n%s", filepath.Base(img), code, out)
			}
			if _, out := harness.RunBlockexport(t, "info", "-f", "raw", img); strings.Contains(out, "looks like") {
				t.Errorf("info -f raw %s warns of a format it is not:\n%s", filepath.Base(img), out)
			}
		}
	})
}

// dropBackingFormat makes the qcow2 image at path name its backing file
// without a format (qemu-img 7.2 no longer creates such images; older ones
// did), so that the backing file is probed: the backing-format header
// extension becomes the end of the extensions.
func dropBackingFormat(t *testing.T, path string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	be := binary.BigEndian
	off := int(be.Uint32(b[100:])) // header_length (version 3)
	for off+8 <= len(b) && off < 65536 {
		typ, n := be.Uint32(b[off:]), int(be.Uint32(b[off+4:]))
		if typ == 0 {
			break
		}
		if typ == 0xe2792aca {
			f, err := os.OpenFile(path, os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if _, err := f.WriteAt(make([]byte, 4), int64(off)); err != nil {
				t.Fatal(err)
			}
			return
		}
		off += 8 + (n+7)&^7
	}
	t.Fatalf("%s has no backing format extension", path)
}
