package tests

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
)

// The S3 server the s3:// tests run against: versitygw with its POSIX
// backend, a real S3 implementation (SigV4, conditional GETs, ranges),
// installed by .ci/s3server at this pinned version into a cache both
// share.
const (
	s3tServerVersion = "v1.8.0"
	s3tAccess        = "AKIABLOCKEXPORTTEST"
	s3tSecret        = "s3t-secret-do-not-log-8c1f"
	s3tBucket        = "images"
)

// s3tServerBin is where .ci/s3server puts the pinned versitygw.
func s3tServerBin(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("BLOCKEXPORT_TEST_BIN")
	if dir == "" {
		cache := os.Getenv("XDG_CACHE_HOME")
		if cache == "" {
			home, err := os.UserHomeDir()
			if err != nil {
				t.Fatalf("s3 tests: no home directory for the test server cache: %v", err)
			}
			cache = filepath.Join(home, ".cache")
		}
		dir = filepath.Join(cache, "blockexport-tests", "bin")
	}
	bin := filepath.Join(dir, "versitygw-"+s3tServerVersion)
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("s3 tests need the S3 server versitygw %s at %s; install it with: .ci/s3server (go install github.com/versity/versitygw/cmd/versitygw@%s)", s3tServerVersion, bin, s3tServerVersion)
	}
	return bin
}

// s3tServer is one versitygw process on a loopback port over a directory
// of buckets; it can be killed and started again on the same port and
// directory, as a server restarting.
type s3tServer struct {
	t        *testing.T
	bin      string
	root     string
	addr     string
	endpoint string
	log      string
	cmd      *exec.Cmd
	done     chan struct{}
}

// s3tStartServer starts the server with a bucket s3tBucket, and sets the
// AWS environment (credentials, region, no shared files) that this test
// and the blockexport processes it runs read. Stopped in t.Cleanup.
func s3tStartServer(t *testing.T) *s3tServer {
	t.Helper()
	s := &s3tServer{t: t, bin: s3tServerBin(t), root: filepath.Join(t.TempDir(), "gw")}
	if err := os.MkdirAll(filepath.Join(s.root, s3tBucket), 0o755); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s.addr = l.Addr().String()
	l.Close()
	s.endpoint = "http://" + s.addr
	s.log = filepath.Join(t.TempDir(), "versitygw.log")
	t.Setenv("AWS_ACCESS_KEY_ID", s3tAccess)
	t.Setenv("AWS_SECRET_ACCESS_KEY", s3tSecret)
	t.Setenv("AWS_REGION", "us-east-1")
	t.Setenv("AWS_SESSION_TOKEN", "")
	t.Setenv("AWS_PROFILE", "")
	t.Setenv("AWS_CONFIG_FILE", filepath.Join(t.TempDir(), "no-config"))
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", filepath.Join(t.TempDir(), "no-credentials"))
	t.Setenv("AWS_ENDPOINT_URL", "")
	t.Setenv("AWS_ENDPOINT_URL_S3", "")
	t.Setenv("AWS_EC2_METADATA_DISABLED", "true")
	s.start()
	t.Cleanup(s.kill)
	return s
}

// start runs the server and waits until it answers HTTP.
func (s *s3tServer) start() {
	t := s.t
	t.Helper()
	lf, err := os.OpenFile(s.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	s.cmd = exec.Command(s.bin, "--port", s.addr, "--access", s3tAccess, "--secret", s3tSecret,
		"--region", "us-east-1", "--quiet", "posix", s.root)
	// The server's own environment must not carry the variables it reads
	// its root keys from: they are given on the command line.
	s.cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME"), "AWS_EC2_METADATA_DISABLED=true"}
	s.cmd.Stdout, s.cmd.Stderr = lf, lf
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	s.done = done
	cmd := s.cmd
	go func() { cmd.Wait(); close(done) }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get(s.endpoint + "/")
		if err == nil {
			resp.Body.Close()
			return
		}
		select {
		case <-done:
			b, _ := os.ReadFile(s.log)
			t.Fatalf("versitygw exited before serving\n%s", b)
		default:
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(s.log)
			t.Fatalf("versitygw did not serve %s in time\n%s", s.endpoint, b)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// kill ends the server at once (SIGKILL), as a crash would.
func (s *s3tServer) kill() {
	if s.cmd == nil {
		return
	}
	select {
	case <-s.done:
	default:
		s.cmd.Process.Kill()
		<-s.done
	}
}

// client is an SDK client of the server with the test's credentials.
func (s *s3tServer) client() *s3.Client {
	return s3.New(s3.Options{
		Region:       "us-east-1",
		BaseEndpoint: aws.String(s.endpoint),
		UsePathStyle: true,
		Credentials:  credentials.NewStaticCredentialsProvider(s3tAccess, s3tSecret, ""),
	})
}

// put uploads the file at path as KEY in s3tBucket.
func (s *s3tServer) put(key, path string) {
	t := s.t
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, err := s.client().PutObject(ctx, &s3.PutObjectInput{
		Bucket: aws.String(s3tBucket), Key: aws.String(key), Body: f, ContentLength: aws.Int64(fi.Size()),
	}); err != nil {
		t.Fatalf("uploading %s as s3://%s/%s: %v", path, s3tBucket, key, err)
	}
}

// url names KEY in the test bucket.
func (s *s3tServer) url(key string) string {
	return fmt.Sprintf("s3://%s/%s", s3tBucket, key)
}

// s3tNoSecret fails the test if text shows the secret key.
func s3tNoSecret(t *testing.T, what, text string) {
	t.Helper()
	if strings.Contains(text, s3tSecret) {
		t.Fatalf("%s shows the secret key:\n%s", what, text)
	}
}
