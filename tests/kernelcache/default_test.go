package kernelcache

import (
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestKernelCacheDefaultsToAuto: without --kernel-cache, a local raw or
// qcow2 image read through the page cache is served with the kernel's
// cache on (auto), and the null device and --cache none without it.
func TestKernelCacheDefaultsToAuto(t *testing.T) {
	dir := t.TempDir()
	img := harness.SparseImage(t, dir, "disk.raw", 8<<20)
	for _, c := range []struct {
		args []string
		want bool
	}{
		{[]string{img}, true},
		{[]string{"-f", "raw", img}, true},
		{[]string{"--cache", "none", img}, false},
		{[]string{"null:64M"}, false},
	} {
		mnt := filepath.Join(t.TempDir(), "export")
		argv := append(append([]string{"fuse"}, c.args...), mnt)
		d := harness.StartDaemon(t, mnt, harness.Bin, argv...)
		for deadline := time.Now().Add(10 * time.Second); !strings.Contains(d.Log(), "exporting"); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("fuse %v did not say it serves\n%s", c.args, d.Log())
			}
		}
		if got := strings.Contains(d.Log(), "kernel_cache=true"); got != c.want {
			t.Errorf("fuse %v: kernel cache %v, want %v\n%s", c.args, got, c.want, d.Log())
		}
		d.StopClean()
	}
}
