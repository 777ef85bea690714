package remote

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestS3ObjectWithoutETagReadsConditionalOnLastModified: a file put straight into versitygw's bucket
// directory has no ETag; reads are conditional on its Last-Modified
// (versitygw 1.8.0 answers If-Unmodified-Since equal to the object's time
// with 412, comparing strictly): the object converts to its own bytes.
func TestS3ObjectWithoutETagReadsConditionalOnLastModified(t *testing.T) {
	s := harness.StartS3Server(t)
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, 3<<20+517, 2731)
	want := harness.ReadAll(t, img)
	if err := os.WriteFile(filepath.Join(s.Root, harness.S3Bucket, "plain.raw"), want, 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "out.raw")
	code, msg := harness.RunBlockexport(t, "convert", "--s3-endpoint", s.Endpoint, "-f", "raw", "-O", "raw", s.URL("plain.raw"), out)
	if code != 0 {
		t.Fatalf("convert of an object without an ETag: exit %d\n%s", code, msg)
	}
	if got := harness.ReadAll(t, out); !bytes.Equal(got, want) {
		t.Fatalf("converted %d bytes, not the object's %d", len(got), len(want))
	}
}
