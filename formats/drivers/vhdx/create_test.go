package vhdx

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/formats/internal/driver"
)

// createAndOpen creates an image with keys and opens it with the reader.
func createAndOpen(t *testing.T, size int64, keys map[string]string) *Image {
	t.Helper()
	path := filepath.Join(t.TempDir(), "new.vhdx")
	if err := Create(path, driver.CreateOptions{Size: size, Keys: keys}); err != nil {
		t.Fatalf("create %v: %v", keys, err)
	}
	f, err := aio.Open(path, aio.Options{Backend: aio.Threads})
	if err != nil {
		t.Fatal(err)
	}
	img, err := New(context.Background(), f, Options{})
	if err != nil {
		t.Fatalf("open a new image %v: %v", keys, err)
	}
	t.Cleanup(func() { img.Close() })
	return img
}

func TestCreatedImageReadsAsZeroes(t *testing.T) {
	for _, c := range []struct {
		size      int64
		keys      map[string]string
		blockSize int64
	}{
		{100 << 20, nil, 8 << 20},
		{3 << 30, nil, 16 << 20},
		{20 << 20, map[string]string{"subformat": "fixed"}, 8 << 20},
		{20 << 20, map[string]string{"subformat": "fixed", "block_state_zero": "off"}, 8 << 20},
		{10 << 20, map[string]string{"block_state_zero": "off", "block_size": "1536k", "log_size": "3M"}, 2 << 20},
		{10 << 20, map[string]string{"block_size": "1G"}, 256 << 20},
		{0, nil, 8 << 20},
	} {
		img := createAndOpen(t, c.size, c.keys)
		if img.Size() != c.size || img.blockSize != c.blockSize {
			t.Errorf("%v: size %d, block size %d; want %d, %d", c.keys, img.Size(), img.blockSize, c.size, c.blockSize)
		}
		n := min(c.size, 24<<20)
		got := make([]byte, n)
		if _, err := img.ReadAt(context.Background(), got, c.size-n); err != nil {
			t.Fatalf("%v: read: %v", c.keys, err)
		}
		if !bytes.Equal(got, make([]byte, n)) {
			t.Errorf("%v: a new image does not read as zeroes", c.keys)
		}
	}
}

func TestCreateLayoutAsQemuImg(t *testing.T) {
	// Measured with qemu-img 7.2: an empty disk's BAT wraps to 64 MiB;
	// 64 TiB takes 64 MiB blocks and a 9 MiB BAT; the log moves the rest.
	for _, c := range []struct {
		size                     int64
		keys                     map[string]string
		batOff, batLen, fileSize uint64
	}{
		{0, nil, 2 * mib, 64 * mib, 71 * mib},
		{64 << 40, nil, 2 * mib, 9 * mib, 16 * mib},
		{1 << 30, map[string]string{"log_size": "1536k"}, 3 * mib, mib, 9 * mib},
		{3 << 20, map[string]string{"subformat": "fixed"}, 2 * mib, mib, 11 * mib},
	} {
		l, err := createOptions(driver.CreateOptions{Size: c.size, Keys: c.keys})
		if err != nil {
			t.Fatal(err)
		}
		if l.batOff != c.batOff || l.batLen != c.batLen || l.fileSize != c.fileSize {
			t.Errorf("%d %v: BAT at %d +%d, file %d; want %d +%d, %d", c.size, c.keys, l.batOff, l.batLen, l.fileSize, c.batOff, c.batLen, c.fileSize)
		}
	}
}

func TestCreateRefusesBeforeMakingAFile(t *testing.T) {
	for _, c := range []struct {
		keys map[string]string
		size int64
		want string
	}{
		{map[string]string{"subformat": "Fixed"}, mib, "Parameter 'subformat' does not accept value 'Fixed'"},
		{map[string]string{"block_size": "3M"}, mib, "Block size must be a power of two"},
		{map[string]string{"block_size": "-1"}, mib, "Parameter 'block_size' expects a non-negative number below 2^64"},
		{map[string]string{"block_size": "1Z"}, mib, "Parameter 'block_size' expects"},
		{map[string]string{"block_size": "99999999999E"}, mib, "Value '99999999999E' is out of range for parameter 'block_size'"},
		{map[string]string{"log_size": "0"}, mib, "Log size must be a multiple of 1 MB"},
		{map[string]string{"log_size": "4G"}, mib, "Log size must be smaller than 4 GB"},
		{map[string]string{"block_state_zero": "maybe"}, mib, "Parameter 'block_state_zero' expects 'on' or 'off'"},
		{map[string]string{"cluster_size": "2M"}, mib, "Invalid parameter 'cluster_size'"},
		{map[string]string{"foo": "1"}, mib, "Invalid parameter 'foo'"},
		{map[string]string{"preallocation": "metadata"}, mib, "Unsupported preallocation mode: metadata"},
		{map[string]string{"nocow": "x"}, mib, "Parameter 'nocow' expects 'on' or 'off'"},
		{nil, 64<<40 + 512, "Image size too large; max of 64TB"},
	} {
		p := filepath.Join(t.TempDir(), "x.vhdx")
		err := Create(p, driver.CreateOptions{Size: c.size, Keys: c.keys})
		if err == nil || !errors.Is(err, driver.ErrBadOption) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want %q", c.keys, err, c.want)
		}
		if _, err := os.Stat(p); err == nil {
			t.Errorf("%v: a file was left", c.keys)
		}
	}
	p := filepath.Join(t.TempDir(), "x.vhdx")
	if err := Create(p, driver.CreateOptions{Size: mib, BackingFile: "base.vhdx"}); !errors.Is(err, driver.ErrBadOption) {
		t.Errorf("a backing file: %v, want a refusal", err)
	}
}

// TestCreateBlockSizeAsQemuImg: block_size values as qemu-img 7.2 takes
// them for a 1 GiB disk (measured): hex, blanks, fractions before a
// suffix, rounding up to a MiB that wraps to the default near 2^64, the
// cut to 256 MiB; 0: refused.
func TestCreateBlockSizeAsQemuImg(t *testing.T) {
	for v, want := range map[string]uint64{
		"0x200000": 2 * mib, "1.5M": 2 * mib, "2097152b": 2 * mib, " 2M": 2 * mib, "+2M": 2 * mib, "2m": 2 * mib,
		"0x2M": 2 * mib, "0": 8 * mib, "18446744073709551615": 8 * mib, "18446744073708503040": 256 * mib,
		"4294967296": 256 * mib, "1": mib, "1e6": 0, "": 0, "16E": 0, "0x1.5M": 0, "2 M": 0, "1.5": 0, "-1": 0,
		"abc": 0, "0x": 0, "3M": 0,
	} {
		l, err := createOptions(driver.CreateOptions{Size: 1 << 30, Keys: map[string]string{"block_size": v}})
		switch {
		case want == 0 && !errors.Is(err, driver.ErrBadOption):
			t.Errorf("block_size=%q: %v, block size %d; want a refusal", v, err, l.blockSize)
		case want != 0 && (err != nil || l.blockSize != want):
			t.Errorf("block_size=%q: %v, block size %d; want %d", v, err, l.blockSize, want)
		}
	}
}
