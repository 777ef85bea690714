package convert

import (
	"bytes"
	"context"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/blockexport/blockexport/formats/drivers/qcow2"
	"github.com/blockexport/blockexport/formats/registry"
)

// The engine into real qcow2 images, compressed or not, in order and out
// of order, from many workers: the image reads back as the source and
// qemu-img check finds it clean (run with -race to see the workers).
func TestConvertIntoQcow2(t *testing.T) {
	src := &fakeImage{size: 9<<20 + 512, data: []span{{0, 1 << 20, true}, {3<<20 + 4096, 5 << 20, true},
		{7<<20 - 100, 9<<20 + 512, true}}}
	want := make([]byte, src.size)
	if _, err := src.ReadAt(context.Background(), want, 0); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		comp string // "": not compressed
		o    Options
	}{
		{"plain", "", Options{Parallel: 8, OutOfOrder: true, MinSparse: 4096}},
		{"zlib", "zlib", Options{Parallel: 8}},
		{"zstd-W", "zstd", Options{Parallel: 16, OutOfOrder: true}},
	} {
		t.Run(c.name, func(t *testing.T) {
			img := filepath.Join(t.TempDir(), "t.qcow2")
			if err := qcow2.Create(img, qcow2.CreateOptions{Size: src.size, ClusterSize: 16 << 10, CompressionType: c.comp}); err != nil {
				t.Fatal(err)
			}
			dst, err := registry.Open(img, registry.Options{Format: "qcow2", Writable: true, Backend: "threads"})
			if err != nil {
				t.Fatal(err)
			}
			o := c.o
			o.TargetZero = true
			if c.comp != "" {
				o.Compressed = dst.Image.(CompressedTarget)
			}
			ctx := context.Background()
			if _, err := Convert(ctx, src, dst.Image, o); err != nil {
				t.Fatal(err)
			}
			if err := dst.Image.Flush(ctx); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, src.size)
			if _, err := dst.Image.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, want) {
				t.Fatalf("reads back wrong (%v)", err)
			}
			dst.Image.Close()
			if out, err := exec.Command("qemu-img", "check", img).CombinedOutput(); err != nil {
				t.Fatalf("qemu-img check: %v\n%s", err, out)
			}
		})
	}
}
