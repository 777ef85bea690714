package remote

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/blockexport/blockexport/formats/protocols/remote"
	s3backend "github.com/blockexport/blockexport/formats/protocols/remote/s3"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestS3BackendAgainstVersitygw: the s3 backend against versitygw, below the
// export: the pinned size and ETag, exact ranges, If-Match honoured (an
// overwritten object is ErrChanged, never the new bytes), and each open
// failure in its own words with the secret nowhere.
func TestS3BackendAgainstVersitygw(t *testing.T) {
	s := harness.StartS3Server(t)
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, 3<<20, 271)
	s.Put("a/b/disk.img", img)
	want := harness.ReadAll(t, img)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	b, err := s3backend.New(ctx, s.URL("a/b/disk.img"), s3backend.Options{Endpoint: s.Endpoint})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	obj, err := b.Stat(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if obj.Size != int64(len(want)) || obj.ETag == "" {
		t.Fatalf("Stat = %+v, want size %d and an ETag", obj, len(want))
	}
	for _, r := range [][2]int64{{0, 1}, {0, 4096}, {1<<20 - 7, 65536}, {int64(len(want)) - 1, 1}, {0, int64(len(want))}} {
		p := make([]byte, r[1])
		if err := b.ReadRange(ctx, obj, p, r[0]); err != nil {
			t.Fatalf("%d+%d: %v", r[0], r[1], err)
		}
		harness.MustEqualBytes(t, "range", p, want[r[0]:r[0]+r[1]])
	}

	// Replaced by an object of the same size: only the ETag tells.
	other := harness.RandomImage(t, filepath.Join(dir), 3<<20, 272)
	s.Put("a/b/disk.img", other)
	p := make([]byte, 4096)
	err = b.ReadRange(ctx, obj, p, 8192)
	if !errors.Is(err, remote.ErrChanged) {
		t.Fatalf("read of a replaced object: %v, want ErrChanged", err)
	}
	if bytes.Equal(p, harness.ReadAll(t, other)[8192:8192+4096]) {
		t.Fatal("the new version's bytes were handed out")
	}

	open := func(url string, o s3backend.Options) error {
		b, err := s3backend.New(ctx, url, o)
		if err != nil {
			return err
		}
		defer b.Close()
		_, err = b.Stat(ctx)
		return err
	}
	for _, c := range []struct {
		name, url, secret, want string
	}{
		{"missing key", s.URL("nope.img"), harness.S3Secret, "s3://images/nope.img: no such object"},
		{"missing bucket", "s3://nobucket/disk.img", harness.S3Secret, "s3://nobucket/disk.img: no such bucket"},
		{"wrong secret", s.URL("a/b/disk.img"), "wrong-secret", "s3://images/a/b/disk.img: the server refused the request signature (SignatureDoesNotMatch): check the secret key"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv("AWS_SECRET_ACCESS_KEY", c.secret)
			err := open(c.url, s3backend.Options{Endpoint: s.Endpoint})
			if err == nil || err.Error() != c.want {
				t.Fatalf("got %v\nwant %s", err, c.want)
			}
		})
	}
	t.Run("unknown access key", func(t *testing.T) {
		t.Setenv("AWS_ACCESS_KEY_ID", "AKIANOBODY")
		err := open(s.URL("a/b/disk.img"), s3backend.Options{Endpoint: s.Endpoint})
		// S3 says InvalidAccessKeyId (403), versitygw XAdminUserNotFound
		// (404): the same line.
		want := "s3://images/a/b/disk.img: the access key is not known to the server (InvalidAccessKeyId): check AWS_ACCESS_KEY_ID, AWS_PROFILE or the shared credentials file"
		if err == nil || err.Error() != want {
			t.Fatalf("got %v\nwant %s", err, want)
		}
	})
	t.Run("endpoint from AWS_ENDPOINT_URL_S3", func(t *testing.T) {
		t.Setenv("AWS_ENDPOINT_URL_S3", s.Endpoint)
		if err := open(s.URL("a/b/disk.img"), s3backend.Options{}); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("credentials from the shared file", func(t *testing.T) {
		creds := filepath.Join(t.TempDir(), "credentials")
		if err := os.WriteFile(creds, []byte("[img]\naws_access_key_id = "+harness.S3Access+"\naws_secret_access_key = "+harness.S3Secret+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		t.Setenv("AWS_ACCESS_KEY_ID", "")
		t.Setenv("AWS_SECRET_ACCESS_KEY", "")
		t.Setenv("AWS_SHARED_CREDENTIALS_FILE", creds)
		t.Setenv("AWS_PROFILE", "img")
		if err := open(s.URL("a/b/disk.img"), s3backend.Options{Endpoint: s.Endpoint}); err != nil {
			t.Fatal(err)
		}
	})
}
