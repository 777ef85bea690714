package main

import "testing"

// TestHumanSize: qemu-img's size_to_str, including the sizes qemu-img
// itself never shows because its block layer rounds an image up to 512
// bytes (tests/formats checks the rest against qemu-img info).
func TestHumanSize(t *testing.T) {
	for n, want := range map[int64]string{
		0: "0 B", 1: "1 B", 999: "999 B", 1000: "0.977 KiB", 1023: "0.999 KiB", 1024: "1 KiB", 1536: "1.5 KiB",
		1048575: "1 MiB", 1 << 30: "1 GiB", 10 << 30: "10 GiB", 1<<63 - 1: "8 EiB",
	} {
		if got := humanSize(n); got != want {
			t.Errorf("humanSize(%d) = %q, want %q", n, got, want)
		}
	}
}
