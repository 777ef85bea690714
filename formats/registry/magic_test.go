package registry

import (
	"encoding/binary"
	"testing"
)

// TestProbeFormat: the format QEMU 7.2's probes name for a file's first
// bytes (block/*.c), edge cases included: what is one byte short of a
// magic, or a version QEMU does not take, is raw.
func TestProbeFormat(t *testing.T) {
	head := func(parts ...any) []byte {
		b := make([]byte, probeHead)
		for i := 0; i+1 < len(parts); i += 2 {
			off := parts[i].(int)
			switch v := parts[i+1].(type) {
			case string:
				copy(b[off:], v)
			case uint32le:
				binary.LittleEndian.PutUint32(b[off:], uint32(v))
			case uint32be:
				binary.BigEndian.PutUint32(b[off:], uint32(v))
			case uint16be:
				binary.BigEndian.PutUint16(b[off:], uint16(v))
			}
		}
		return b
	}
	for _, c := range []struct {
		name string
		head []byte
		path string
		want string
	}{
		{"qcow2 v3", head(0, "QFI\xfb", 4, uint32be(3)), "", QCOW2},
		{"qcow2 v0 is qcow2 (refused by the reader, never raw)", head(0, "QFI\xfb"), "", QCOW2},
		{"qcow v1", head(0, "QFI\xfb", 4, uint32be(1)), "", "qcow"},
		{"vmdk sparse", head(0, "KDMV"), "", "vmdk"},
		{"vmdk cowd", head(0, "COWD"), "", "vmdk"},
		{"vmdk descriptor", head(0, "# Disk DescriptorFile\nversion=1\nCID=fffffffe\n"), "", "vmdk"},
		{"vmdk descriptor after an empty line", head(0, "# c\r\n   \r\n\nversion=3\r\n"), "", Raw}, // QEMU takes only spaces before \n as blank
		{"vmdk descriptor, spaces line and CRLF", head(0, "# c\r\n   \r\nversion=3\r\n"), "", "vmdk"},
		{"vmdk descriptor, version 4", head(0, "# Disk DescriptorFile\nversion=4\n"), "", Raw},
		{"vmdk descriptor, text first", head(0, "hello\nversion=1\n"), "", Raw},
		{"vhdx", head(0, "vhdxfile"), "", "vhdx"},
		{"vpc", head(0, "conectix"), "", "vpc"},
		{"vpc one byte short", head(0, "conecti"), "", Raw},
		{"vdi", head(0, "<<< Oracle VM VirtualBox Disk Image >>>\n", 64, uint32le(0xbeda107f)), "", "vdi"},
		{"qed", head(0, "QED\x00"), "", "qed"},
		{"parallels", head(0, "WithoutFreeSpace", 16, uint32le(2)), "", "parallels"},
		{"parallels ext", head(0, "WithouFreSpacExt", 16, uint32le(2)), "", "parallels"},
		{"parallels v3", head(0, "WithoutFreeSpace", 16, uint32le(3)), "", Raw},
		{"bochs", head(0, "Bochs Virtual HD Image", 32, "Redolog", 48, "Growing", 64, uint32le(0x20000)), "", "bochs"},
		{"bochs undoable", head(0, "Bochs Virtual HD Image", 32, "Redolog", 48, "Undoable", 64, uint32le(0x20000)), "", Raw},
		{"cloop", head(0, cloopMagic), "", "cloop"},
		{"cloop prefix", head(0, cloopMagic[:20]), "", Raw},
		{"dmg by name", head(), "/images/mac.dmg", "dmg"},
		{"dmg: the name alone is not enough", head(), ".dmg", Raw},
		{"qcow2 wins over dmg's name", head(0, "QFI\xfb", 4, uint32be(3)), "x.dmg", QCOW2},
		{"luks1", head(0, "LUKS\xba\xbe", 6, uint16be(1)), "", "luks"},
		{"luks2 (QEMU 7.2 reads v1 only)", head(0, "LUKS\xba\xbe", 6, uint16be(2)), "", Raw},
		{"zeroes", head(), "", Raw},
	} {
		if got := probeFormat(c.head, c.path).Name; got != c.want {
			t.Errorf("%s: %q, want %q", c.name, got, c.want)
		}
	}
}

type (
	uint32le uint32
	uint32be uint32
	uint16be uint16
)

// FuzzProbeFormat: any head, of any length, and any name is some format
// (raw at worst), without a panic; and a head that holds every probe's
// header (512 bytes) names the same format when padded with zeroes to
// probeHead, as QEMU pads a short file.
func FuzzProbeFormat(f *testing.F) {
	for _, seed := range []string{"", "KDMV", "COWD", "# Disk DescriptorFile\nversion=1\n", "#", " ", " \r", "vhdxfile",
		"conectix", "QFI\xfb\x00\x00\x00\x01", "QFI\xfb\x00\x00\x00\x03", "QED\x00", "WithoutFreeSpace\x02\x00\x00\x00",
		"LUKS\xba\xbe\x00\x01", cloopMagic, "Bochs Virtual HD Image"} {
		f.Add([]byte(seed), "x.img")
	}
	f.Add([]byte{}, "y.dmg")
	f.Fuzz(func(t *testing.T, head []byte, name string) {
		ff := probeFormat(head, name)
		if ff.Name == "" {
			t.Fatalf("no format for %q", head)
		}
		if len(head) <= probeHead {
			padded := make([]byte, probeHead)
			copy(padded, head)
			if pf := probeFormat(padded, name); len(head) >= 512 && pf.Name != ff.Name {
				t.Fatalf("%q is %s, padded %s", head, ff.Name, pf.Name)
			}
		}
	})
}
