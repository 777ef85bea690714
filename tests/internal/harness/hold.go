package harness

import (
	"bytes"
	"os/exec"
	"testing"
	"time"
)

// HoldImage has qemu-io open the qcow2 image img for writing, with QEMU's
// image locks, until the test ends, and returns once the locks are taken
// (qemu-img info is refused). qemu-io reads its commands from a pipe kept
// open, so it holds the image without relying on a timer of its own.
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
	for deadline := time.Now().Add(30 * time.Second); exec.Command("qemu-img", "info", img).Run() == nil; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("qemu-io did not lock %s:\n%s", img, out.String())
		}
	}
}
