package harness

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// HoldImage has qemu-io open the qcow2 image img for writing, with QEMU's
// image locks, until the test ends, and returns once the locks are taken.
// qemu-io reads its commands from a pipe kept open, so it holds the image
// without relying on a timer of its own.
//
// It watches /proc/locks for the lock rather than trying to open the
// image: a probe's own read lock, taken while qemu-io opened, made qemu-io
// fail with "Failed to get write lock" and then sit at its prompt holding
// nothing (seen under load).
func HoldImage(t *testing.T, img string) {
	t.Helper()
	holder := exec.Command("qemu-io", "-f", "qcow2", img)
	var out bytes.Buffer
	holder.Stdout, holder.Stderr = &out, &out
	stdin, err := holder.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := holder.Start(); err != nil {
		t.Fatalf("qemu-io: %v (apt-get install qemu-utils)", err)
	}
	t.Cleanup(func() {
		stdin.Close()
		holder.Process.Kill()
		holder.Wait()
	})
	for deadline := time.Now().Add(30 * time.Second); !holdsWriteLock(t, img); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) || strings.Contains(out.String(), "can't open") {
			t.Fatalf("qemu-io did not lock %s:\n%s", img, out.String())
		}
	}
}

// qemuWriteLockByte is the byte QEMU's file driver locks (an OFD lock) while
// it holds the write permission: RAW_LOCK_PERM_BASE (100) plus the bit of
// BLK_PERM_WRITE (1).
const qemuWriteLockByte = 101

// holdsWriteLock: some process holds QEMU's write-permission lock on img.
func holdsWriteLock(t *testing.T, img string) bool {
	fi, err := os.Stat(img)
	if err != nil {
		t.Fatal(err)
	}
	st := fi.Sys().(*syscall.Stat_t)
	// /proc/locks: "1: OFDLCK ADVISORY READ -1 08:01:1234 100 101" (the
	// kernel joins a process's adjacent ranges).
	inode := fmt.Sprintf(":%d", st.Ino)
	locks, err := os.ReadFile("/proc/locks")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(string(locks), "\n") {
		f := strings.Fields(line)
		if len(f) < 8 || f[1] != "OFDLCK" || !strings.HasSuffix(f[5], inode) {
			continue
		}
		start, err1 := strconv.ParseInt(f[6], 10, 64)
		end, err2 := strconv.ParseInt(f[7], 10, 64)
		if err1 == nil && err2 == nil && start <= qemuWriteLockByte && qemuWriteLockByte <= end {
			return true
		}
	}
	return false
}
