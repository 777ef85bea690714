package registry

import (
	"bytes"
	"encoding/binary"
	"strings"

	"github.com/blockexport/blockexport/formats/internal/driver"
)

// The probes below say what QEMU 7.2's drivers say of a file's first
// probeHead bytes (block/<driver>.c, the *_probe functions): the same
// magic, the same version checks, the same scores, so that a file QEMU
// takes for a vmdk is never taken for raw here.

// qcowMagic starts qcow and qcow2 files; the version tells them apart.
var qcowMagic = []byte{'Q', 'F', 'I', 0xfb}

// probeQCOW1: QFI\xfb, version 1 (qcow_probe).
func probeQCOW1(head []byte, _ string) int {
	return driver.Score(bytes.HasPrefix(head, qcowMagic) && len(head) >= 8 && binary.BigEndian.Uint32(head[4:]) == 1, 100)
}

// probeQED: "QED\0", in a 64-byte header (bdrv_qed_probe).
func probeQED(head []byte, _ string) int {
	return driver.Score(len(head) >= 64 && bytes.HasPrefix(head, []byte("QED\x00")), 100)
}

// probeParallels: "WithoutFreeSpace" or "WithouFreSpacExt" and version 2,
// in a 64-byte header (parallels_probe).
func probeParallels(head []byte, _ string) int {
	return driver.Score(len(head) >= 64 && binary.LittleEndian.Uint32(head[16:]) == 2 &&
		(bytes.HasPrefix(head, []byte("WithoutFreeSpace")) || bytes.HasPrefix(head, []byte("WithouFreSpacExt"))), 100)
}

// probeBochs: a growing redolog: "Bochs Virtual HD Image", "Redolog",
// "Growing" as C strings in their fields, version 1 or 2, in a 512-byte
// header (bochs_probe).
func probeBochs(head []byte, _ string) int {
	if len(head) < 512 {
		return 0
	}
	cstr := func(b []byte) string {
		if i := bytes.IndexByte(b, 0); i >= 0 {
			return string(b[:i])
		}
		return "" // not terminated inside the field: strcmp would run on; QEMU's header has one
	}
	if cstr(head[0:32]) != "Bochs Virtual HD Image" || cstr(head[32:48]) != "Redolog" || cstr(head[48:64]) != "Growing" {
		return 0
	}
	v := binary.LittleEndian.Uint32(head[64:])
	return driver.Score(v == 0x00010000 || v == 0x00020000, 100)
}

// cloopMagic starts a compressed loop image (cloop_probe), which scores
// it 2: a weak guess, above raw's 1.
const cloopMagic = "#!/bin/sh\n#V2.0 Format\nmodprobe cloop file=$0 && mount -r -t iso9660 /dev/cloop $1\n"

func probeCloop(head []byte, _ string) int {
	return driver.Score(bytes.HasPrefix(head, []byte(cloopMagic)), 2)
}

// probeDMG: QEMU takes any file whose name ends in ".dmg" for an Apple
// disk image (dmg_probe, score 2): it has no magic at the start.
func probeDMG(_ []byte, path string) int {
	return driver.Score(len(path) > 4 && strings.HasSuffix(path, ".dmg"), 2)
}

// probeLUKS: "LUKS\xba\xbe" and version 1, big-endian
// (qcrypto_block_luks_has_format).
func probeLUKS(head []byte, _ string) int {
	return driver.Score(len(head) >= 8 && bytes.HasPrefix(head, []byte("LUKS\xba\xbe")) && binary.BigEndian.Uint16(head[6:]) == 1, 100)
}
