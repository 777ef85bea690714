package harness

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
	s3ServerVersion = "v1.8.0"
	// S3Access, S3Secret and S3Bucket are the test server's credentials
	// and bucket.
	S3Access = "AKIABLOCKEXPORTTEST"
	S3Secret = "s3t-secret-do-not-log-8c1f"
	S3Bucket = "images"
)

// s3ServerBin is where .ci/s3server puts the pinned versitygw.
func s3ServerBin(t *testing.T) string {
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
	bin := filepath.Join(dir, "versitygw-"+s3ServerVersion)
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("s3 tests need the S3 server versitygw %s at %s; install it with: .ci/s3server (go install github.com/versity/versitygw/cmd/versitygw@%s)", s3ServerVersion, bin, s3ServerVersion)
	}
	return bin
}

// S3Server is one versitygw process on a loopback port over a directory
// of buckets; it can be killed and started again on the same port and
// directory, as a server restarting.
type S3Server struct {
	t        *testing.T
	bin      string
	Root     string
	Addr     string
	Endpoint string
	LogFile  string
	Cmd      *exec.Cmd
	Done     chan struct{}
}

// StartS3Server starts the server with a bucket S3Bucket, and sets the
// AWS environment (credentials, region, no shared files) that this test
// and the blockexport processes it runs read. Stopped in t.Cleanup.
func StartS3Server(t *testing.T) *S3Server {
	t.Helper()
	s := &S3Server{t: t, bin: s3ServerBin(t), Root: filepath.Join(t.TempDir(), "gw")}
	if err := os.MkdirAll(filepath.Join(s.Root, S3Bucket), 0o755); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s.Addr = l.Addr().String()
	l.Close()
	s.Endpoint = "http://" + s.Addr
	s.LogFile = filepath.Join(t.TempDir(), "versitygw.log")
	t.Setenv("AWS_ACCESS_KEY_ID", S3Access)
	t.Setenv("AWS_SECRET_ACCESS_KEY", S3Secret)
	t.Setenv("AWS_REGION", "us-east-1")
	t.Setenv("AWS_SESSION_TOKEN", "")
	t.Setenv("AWS_PROFILE", "")
	t.Setenv("AWS_CONFIG_FILE", filepath.Join(t.TempDir(), "no-config"))
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", filepath.Join(t.TempDir(), "no-credentials"))
	t.Setenv("AWS_ENDPOINT_URL", "")
	t.Setenv("AWS_ENDPOINT_URL_S3", "")
	t.Setenv("AWS_EC2_METADATA_DISABLED", "true")
	s.Start()
	t.Cleanup(s.Kill)
	return s
}

// Start runs the server and waits until it answers HTTP.
func (s *S3Server) Start() {
	t := s.t
	t.Helper()
	lf, err := os.OpenFile(s.LogFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	s.Cmd = exec.Command(s.bin, "--port", s.Addr, "--access", S3Access, "--secret", S3Secret,
		"--region", "us-east-1", "--quiet", "posix", s.Root)
	// The server's own environment must not carry the variables it reads
	// its root keys from: they are given on the command line.
	s.Cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME"), "AWS_EC2_METADATA_DISABLED=true"}
	s.Cmd.Stdout, s.Cmd.Stderr = lf, lf
	if err := s.Cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	s.Done = done
	cmd := s.Cmd
	go func() { cmd.Wait(); close(done) }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get(s.Endpoint + "/")
		if err == nil {
			resp.Body.Close()
			return
		}
		select {
		case <-done:
			b, _ := os.ReadFile(s.LogFile)
			t.Fatalf("versitygw exited before serving\n%s", b)
		default:
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(s.LogFile)
			t.Fatalf("versitygw did not serve %s in time\n%s", s.Endpoint, b)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Kill ends the server at once (SIGKILL), as a crash would.
func (s *S3Server) Kill() {
	if s.Cmd == nil {
		return
	}
	select {
	case <-s.Done:
	default:
		s.Cmd.Process.Kill()
		<-s.Done
	}
}

// Client is an SDK client of the server with the test's credentials.
func (s *S3Server) Client() *s3.Client {
	return s3.New(s3.Options{
		Region:       "us-east-1",
		BaseEndpoint: aws.String(s.Endpoint),
		UsePathStyle: true,
		Credentials:  credentials.NewStaticCredentialsProvider(S3Access, S3Secret, ""),
	})
}

// Put uploads the file at path as KEY in S3Bucket.
func (s *S3Server) Put(key, path string) {
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
	if _, err := s.Client().PutObject(ctx, &s3.PutObjectInput{
		Bucket: aws.String(S3Bucket), Key: aws.String(key), Body: f, ContentLength: aws.Int64(fi.Size()),
	}); err != nil {
		t.Fatalf("uploading %s as s3://%s/%s: %v", path, S3Bucket, key, err)
	}
}

// URL names KEY in the test bucket.
func (s *S3Server) URL(key string) string {
	return fmt.Sprintf("s3://%s/%s", S3Bucket, key)
}

// MustNotShowS3Secret fails the test if text shows the secret key.
func MustNotShowS3Secret(t *testing.T, what, text string) {
	t.Helper()
	if strings.Contains(text, S3Secret) {
		t.Fatalf("%s shows the secret key:\n%s", what, text)
	}
}
