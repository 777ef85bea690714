package hostfile

import (
	"os"
	"path/filepath"
	"testing"
)

// A file of hole, data, hole (1 MiB each, the last a hole only because
// the file ends there): every run as the file system has it, cut at n,
// and past the end one hole (ext4 and tmpfs, where tests run, keep
// holes).
func TestRun(t *testing.T) {
	const mb = 1 << 20
	path := filepath.Join(t.TempDir(), "sparse")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	data := make([]byte, mb)
	for i := range data {
		data[i] = 1
	}
	if _, err := f.WriteAt(data, mb); err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(3 * mb); err != nil {
		t.Fatal(err)
	}
	f.Sync()
	fd := int(f.Fd())
	for _, c := range []struct {
		off, n, want int64
		zero         bool
	}{
		{0, 3 * mb, mb, true},           // the leading hole, up to the data
		{0, 4096, 4096, true},           // cut at n
		{4096, 3 * mb, mb - 4096, true}, // from inside the hole
		{mb, 3 * mb, mb, false},         // the data, up to the trailing hole
		{mb + 512, 100, 100, false},     // cut at n, unaligned
		{2*mb - 4096, 3 * mb, 4096, false},
		{2 * mb, 3 * mb, 3 * mb, true}, // a hole to the end: ENXIO, all n
		{5 * mb, 8192, 8192, true},     // past the end
	} {
		n, zero := Run(fd, c.off, c.n)
		if n != c.want || zero != c.zero {
			t.Errorf("Run(%d, %d) = %d, %v; want %d, %v", c.off, c.n, n, zero, c.want, c.zero)
		}
	}
	got, err := Allocated(fd)
	if err != nil || got < mb || got >= 3*mb {
		t.Errorf("Allocated = %d, %v; want the 1 MiB of data (and no more than a little metadata)", got, err)
	}
	if _, err := Allocated(-1); err == nil {
		t.Error("Allocated of a closed descriptor: no error")
	}
}
