package harness

import (
	"bytes"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// HoldImage has qemu-io open the qcow2 image img for writing, with QEMU's
// image locks, until the test ends, and returns once the locks are taken
// (heldForWriting). qemu-io reads its commands from a pipe kept
// open, so it holds the image without relying on a timer of its own.
func HoldImage(t *testing.T, img string) {
	t.Helper()
	holder := exec.Command("qemu-io", "-f", "qcow2", img)
	var out lockedBuffer // written by exec's copier while the loop below reads it
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
	for deadline := time.Now().Add(30 * time.Second); !heldForWriting(img); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) || strings.Contains(out.String(), "can't open") {
			t.Fatalf("qemu-io did not lock %s:\n%s", img, out.String())
		}
	}
}

// heldForWriting says whether a process holds QEMU's write permission on
// img (its lock byte 101), without taking a lock: a qemu-img info probing
// for it took a read lock that refuses writers, and a qemu-io starting
// meanwhile then failed with "Failed to get \"write\" lock" (seen under
// load in one run of three).
func heldForWriting(img string) bool {
	f, err := os.Open(img)
	if err != nil {
		return false
	}
	defer f.Close()
	lk := unix.Flock_t{Type: unix.F_WRLCK, Start: 101, Len: 1}
	if err := unix.FcntlFlock(f.Fd(), unix.F_OFD_GETLK, &lk); err != nil {
		return false
	}
	return lk.Type != unix.F_UNLCK
}

// lockedBuffer is a bytes.Buffer one goroutine writes while another reads.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
