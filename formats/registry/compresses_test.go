package registry

import "testing"

// TestCompressesAsksTheDriver: convert -c is allowed for the formats
// whose driver takes compressed clusters (qcow2, vmdk, as qemu-img 7.2's
// block_driver_can_compress) and for no other, nor for an unknown name.
func TestCompressesAsksTheDriver(t *testing.T) {
	for format, want := range map[string]bool{
		"qcow2": true, "vmdk": true, "raw": false, "vpc": false, "vdi": false, "vhdx": false, "nosuch": false,
	} {
		if got := Compresses(format); got != want {
			t.Errorf("Compresses(%q) = %v, want %v", format, got, want)
		}
	}
}
