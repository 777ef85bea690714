package daemon

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// Mapped reads (reads replied straight from a mapping of the image file)
// against an image cut short under a read-only export by someone else,
// after its pages were lent: a read of what was cut gets EIO or zeroes
// (what a pread of the short file gives), never bytes of anything else;
// what is left reads right, and the export goes on serving. With the
// mapping on and off, same answers.
func TestMappedReadsOfAnImageCutShort(t *testing.T) {
	for _, mapped := range []string{"true", "false"} {
		t.Run("mapped-reads="+mapped, func(t *testing.T) {
			dir := t.TempDir()
			const size = 8 << 20
			img := harness.RandomImage(t, dir, size, 7)
			want := harness.ReadAll(t, img)
			mnt := filepath.Join(dir, "mnt")
			d := harness.StartExport(t, img, mnt, "--format", "raw", "--kernel-cache", "off", "--mapped-reads="+mapped)
			fd, err := syscall.Open(mnt, syscall.O_RDONLY|syscall.O_DIRECT, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer syscall.Close(fd)
			buf, err := unix.Mmap(-1, 0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Munmap(buf)
			readBack := func(off int64) ([]byte, error) {
				n, err := unix.Pread(fd, buf, off)
				if n < 0 {
					n = 0
				}
				return buf[:n], err
			}
			// Twice: the first reads fill the page cache, the second are lent.
			for range 2 {
				for off := int64(0); off < size; off += 1 << 20 {
					got, err := readBack(off)
					if err != nil || !bytes.Equal(got, want[off:off+1<<20]) {
						t.Fatalf("read at %d before the cut: %d bytes, %v", off, len(got), err)
					}
				}
			}
			if err := os.Truncate(img, size/2); err != nil {
				t.Fatal(err)
			}
			eio := 0
			for off := int64(size / 2); off < size; off += 1 << 20 {
				got, err := readBack(off)
				if err != nil {
					eio++
				}
				switch {
				case err != nil && !errors.Is(err, unix.EIO):
					t.Fatalf("read at %d past the cut: %v, want EIO or zeroes", off, err)
				case err == nil && !bytes.Equal(got, make([]byte, len(got))):
					t.Fatalf("read at %d past the cut: %d bytes, not zeroes", off, len(got))
				}
			}
			t.Logf("reads past the cut: %d of 4 EIO, the rest zeroes", eio)
			for off := int64(0); off < size/2; off += 1 << 20 {
				got, err := readBack(off)
				if err != nil || !bytes.Equal(got, want[off:off+1<<20]) {
					t.Fatalf("read at %d after the cut: %d bytes, %v", off, len(got), err)
				}
			}
			d.StopClean()
		})
	}
}
