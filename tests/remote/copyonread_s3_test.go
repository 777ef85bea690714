package remote

import (
	"encoding/json"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestCopyOnReadAndStreamOverS3BackingFile: an ext4 image in S3 (versitygw) is the backing file
// of local qcow2 overlays. Copy-on-read: a tree read through a loop mount
// of the --copy-on-read export reads again, the same, with the S3 server
// killed. Stream: a second overlay's stream is killed (SIGKILL) midway,
// resumed to completion, and the overlay then opens with the server gone:
// no backing file, check clean, the image's bytes.
func TestCopyOnReadAndStreamOverS3BackingFile(t *testing.T) {
	s := harness.StartS3Server(t)
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	want := fileTree(t, src, 50, 13)
	base := filepath.Join(dir, "fs.raw")
	harness.Run(t, "mkfs.ext4", "-q", "-d", src, base, "64M")
	s.Put("fs.img", base)
	cor := filepath.Join(dir, "cor.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", s.URL("fs.img"), "-F", "raw", cor, "64M")
	streamed := filepath.Join(dir, "streamed.qcow2")
	harness.Run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", s.URL("fs.img"), "-F", "raw", streamed, "64M")

	// Stream, killed at step 20 of 64 or later, once a flush made
	// copies durable, resumed.
	cmd, lines, _ := startStream(t, "--s3-endpoint", s.Endpoint, streamed)
	var full int64
	for i := 0; lines.Scan(); i++ {
		var st streamStep
		json.Unmarshal(lines.Bytes(), &st)
		if st.Event == "planned" {
			full = st.Total
		}
		if i >= 20 && st.Durable > 0 {
			break
		}
	}
	cmd.Process.Signal(syscall.SIGKILL)
	go func() {
		for lines.Scan() {
		}
	}()
	cmd.Wait()
	if rest := streamToEnd(t, streamed, "--s3-endpoint", s.Endpoint); full <= 0 || rest >= full {
		t.Fatalf("the resumed stream planned %d bytes of %d", rest, full)
	}

	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, cor, mnt, "-w", "--copy-on-read", "--s3-endpoint", s.Endpoint, "--kernel-cache", "off", "--reconnect-timeout", "1s")
	first := fileTreeHashes(t, mnt, filepath.Join(dir, "fs1"))
	for name, sum := range want {
		if first[name] != sum {
			t.Fatalf("%s differs through the export", name)
		}
	}
	s.Kill()
	second := fileTreeHashes(t, mnt, filepath.Join(dir, "fs2"))
	for name, sum := range first {
		if second[name] != sum {
			t.Fatalf("%s differs with the S3 server gone", name)
		}
	}
	d.StopClean()

	mustBeStandalone(t, streamed, base, "")
}
