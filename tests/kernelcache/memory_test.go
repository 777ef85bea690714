package kernelcache

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// memoryCgroup makes a memory cgroup limited to limit bytes, below this
// process's own (cgroup v2 where the memory controller is there, else
// v1's memory hierarchy), and returns its cgroup.procs file. Cleanup
// moves anything left in it out and removes it.
func memoryCgroup(t *testing.T, limit int64) string {
	t.Helper()
	self, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	var dir, limitFile, parentProcs string
	ctrl, _ := os.ReadFile("/sys/fs/cgroup/cgroup.controllers")
	for _, line := range strings.Split(strings.TrimSpace(string(self)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		switch {
		case parts[0] == "0" && strings.Contains(string(ctrl), "memory"):
			base := filepath.Join("/sys/fs/cgroup", parts[2])
			dir, limitFile = filepath.Join(base, fmt.Sprintf("kc-test-%d", os.Getpid())), "memory.max"
			parentProcs = filepath.Join(base, "cgroup.procs")
			// A v2 child gets the memory controller only if its parent
			// hands it down (no process may live in a parent that does,
			// so this works below a leaf only where it already is).
			os.WriteFile(filepath.Join(base, "cgroup.subtree_control"), []byte("+memory"), 0)
		case parts[1] == "memory" && dir == "":
			base := filepath.Join("/sys/fs/cgroup/memory", parts[2])
			dir, limitFile = filepath.Join(base, fmt.Sprintf("kc-test-%d", os.Getpid())), "memory.limit_in_bytes"
			parentProcs = filepath.Join(base, "cgroup.procs")
		}
	}
	if dir == "" {
		t.Fatalf("no memory cgroup controller in\n%s", self)
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatalf("making a memory cgroup: %v", err)
	}
	t.Cleanup(func() {
		if b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs")); err == nil {
			for _, pid := range strings.Fields(string(b)) {
				os.WriteFile(parentProcs, []byte(pid), 0)
			}
		}
		for range 50 {
			if err := os.Remove(dir); err == nil || os.IsNotExist(err) {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
		t.Errorf("cgroup %s left behind", dir)
	})
	if err := os.WriteFile(filepath.Join(dir, limitFile), []byte(fmt.Sprint(limit)), 0); err != nil {
		t.Fatalf("limiting the cgroup's memory: %v", err)
	}
	return filepath.Join(dir, "cgroup.procs")
}

// TestKernelCacheLoopMountUnderMemoryLimitDoesNotDeadlock: ext4 on a loop device over a
// writeback-cached export, written hard (400 MiB, fsynced) by a shell in a
// memory cgroup of 64 MiB: the classic deadlock (reclaim waits on
// writeback through the loop and the FUSE daemon) must not happen, the
// job finishes, and the file system checks clean. The export's bdi keeps
// its dirty pages bounded (strict_limit, max_ratio 1).
func TestKernelCacheLoopMountUnderMemoryLimitDoesNotDeadlock(t *testing.T) {
	dir := t.TempDir()
	img := harness.SparseImage(t, dir, "img", 1<<30)
	mnt := filepath.Join(dir, "mnt")
	harness.StartCached(t, img, mnt, "-f", "raw")
	dev := strings.TrimSpace(harness.Run(t, "stat", "-c", "%Hd:%Ld", mnt))
	for file, want := range map[string]string{"strict_limit": "1", "max_ratio": "1"} {
		b, err := os.ReadFile(filepath.Join("/sys/class/bdi", dev, file))
		if err != nil || strings.TrimSpace(string(b)) != want {
			t.Fatalf("bdi %s %s: %q %v, want %s", dev, file, b, err, want)
		}
	}
	loop := strings.TrimSpace(harness.Run(t, "losetup", "--find", "--show", mnt))
	t.Cleanup(func() { exec.Command("losetup", "-d", loop).Run() })
	harness.Run(t, "mkfs.ext4", "-q", "-F", loop)
	fsdir := filepath.Join(dir, "fs")
	if err := os.Mkdir(fsdir, 0o755); err != nil {
		t.Fatal(err)
	}
	harness.Run(t, "mount", loop, fsdir)
	mounted := true
	t.Cleanup(func() {
		if mounted {
			exec.Command("umount", fsdir).Run()
		}
	})
	procs := memoryCgroup(t, 64<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	job := exec.CommandContext(ctx, "bash", "-c",
		`echo $$ > "$1" && exec dd if=/dev/urandom of="$2" bs=1M count=400 conv=fsync status=none`,
		"kc", procs, filepath.Join(fsdir, "big"))
	if out, err := job.CombinedOutput(); err != nil {
		t.Fatalf("write job under a 64 MiB memory limit: %v %s", err, out)
	}
	harness.Run(t, "umount", fsdir)
	mounted = false
	harness.Run(t, "e2fsck", "-fn", loop)
}
