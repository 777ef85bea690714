package formats

import (
	"bytes"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestVhdxWrittenInPlaceReadsBackThroughLibvhdi: a dynamic and a fixed
// VHDX that we create and then write in place through `fuse -w`
// (scattered writes, some into blocks not yet allocated, one across a
// block boundary) is accepted by libyal's vhdiinfo and reads back through
// its vhdimount (which shares no code with QEMU or us) as the writes
// left it, as qemu-img reads it too (compare against a raw copy written
// the same way, check clean).
func TestVhdxWrittenInPlaceReadsBackThroughLibvhdi(t *testing.T) {
	needVhdi(t)
	const size = 64 << 20
	for _, sub := range []string{"dynamic", "fixed"} {
		t.Run(sub, func(t *testing.T) {
			dir := t.TempDir()
			img, raw := filepath.Join(dir, "disk.vhdx"), filepath.Join(dir, "want.raw")
			// 1 MiB blocks, so that the writes cross and allocate several.
			harness.CreateImage(t, "-f", "vhdx", "-o", "subformat="+sub+",block_size=1M", img, "64M")
			want := make([]byte, size)
			mnt := filepath.Join(dir, "mnt")
			if err := os.WriteFile(mnt, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			d := harness.StartExport(t, img, mnt, "-w")
			f, err := os.OpenFile(mnt, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			rng := rand.New(rand.NewPCG(7, uint64(len(sub))))
			for _, w := range []struct{ off, n int64 }{
				{0, 4096}, {1<<20 - 512, 1024}, {5<<20 + 12345, 70000}, {63<<20 - 4096, 4096}, {17 << 20, 3 << 20}, {5 << 20, 512},
			} {
				p := make([]byte, w.n)
				for i := range p {
					p[i] = byte(rng.Uint32())
				}
				if _, err := f.WriteAt(p, w.off); err != nil {
					t.Fatalf("write at %d: %v", w.off, err)
				}
				copy(want[w.off:], p)
			}
			if err := f.Sync(); err != nil {
				t.Fatal(err)
			}
			f.Close()
			d.StopClean()
			if err := os.WriteFile(raw, want, 0o644); err != nil {
				t.Fatal(err)
			}
			if code, out := exitOf(t, "vhdiinfo", img); code != 0 || !strings.Contains(out, "Media size") {
				t.Fatalf("vhdiinfo after our writes: exit %d\n%s", code, out)
			}
			if got := vhdiReads(t, img, size); !bytes.Equal(got, want) {
				i := 0
				for i < len(got) && got[i] == want[i] {
					i++
				}
				t.Errorf("vhdimount reads other bytes than were written, first at %d", i)
			}
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "vhdx", raw, img)
			harness.Run(t, "qemu-img", "check", "-f", "vhdx", img)
		})
	}
}
