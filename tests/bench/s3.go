package main

import (
	"context"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
)

// The S3 server the s3 rows read from: the versitygw the tests use
// (tests/internal/harness/s3.go), installed by .ci/s3server.
const (
	s3BenchServerVersion = "v1.8.0"
	s3BenchAccess        = "AKIABLOCKEXPORTBENCH"
	s3BenchSecret        = "bench-secret-0f3a"
	s3BenchBucket        = "bench"
)

// s3BenchServerBin is where .ci/s3server puts versitygw.
func s3BenchServerBin() string {
	dir := os.Getenv("BLOCKEXPORT_TEST_BIN")
	if dir == "" {
		cache := os.Getenv("XDG_CACHE_HOME")
		if cache == "" {
			home, err := os.UserHomeDir()
			if err != nil {
				log.Fatal(err)
			}
			cache = filepath.Join(home, ".cache")
		}
		dir = filepath.Join(cache, "blockexport-tests", "bin")
	}
	bin := filepath.Join(dir, "versitygw-"+s3BenchServerVersion)
	if _, err := os.Stat(bin); err != nil {
		log.Fatalf("the s3 rows need versitygw %s at %s: run .ci/s3server", s3BenchServerVersion, bin)
	}
	return bin
}

// benchS3 measures a FUSE export of a 1 GiB raw object in versitygw on
// loopback (the object in the server's page cache): 1 MiB sequential
// reads and 4 KiB random reads at libaio qd16 and pvsync2 qd1, each cold
// (a fresh export, every block fetched) and warm (the same I/Os again, from
// the export's cache, sized to hold the object). There is no QEMU S3
// driver to compare with: the rows give our figure and, beside it, fio on
// the local file (O_DIRECT) as a ceiling.
func benchS3(dir, bin string) []row {
	log.Printf("target s3 (versitygw on loopback)")
	root := filepath.Join(dir, "s3root")
	if err := os.MkdirAll(filepath.Join(root, s3BenchBucket), 0o755); err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(root)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	endpoint := "http://" + addr
	server := exec.Command(s3BenchServerBin(), "--port", addr, "--access", s3BenchAccess, "--secret", s3BenchSecret, "--quiet", "posix", root)
	server.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME"), "AWS_EC2_METADATA_DISABLED=true"}
	server.Stderr = os.Stderr
	if err := server.Start(); err != nil {
		log.Fatal(err)
	}
	defer func() { server.Process.Kill(); server.Wait() }()
	ready := false
	for i := 0; i < 600 && !ready; i++ {
		if resp, err := http.Get(endpoint + "/"); err == nil {
			resp.Body.Close()
			ready = true
		} else {
			time.Sleep(50 * time.Millisecond)
		}
	}
	if !ready {
		server.Process.Kill()
		server.Wait()
		log.Fatalf("versitygw did not serve %s", endpoint)
	}

	img := filepath.Join(dir, "s3-src.img")
	if err := makeImage("raw", img); err != nil {
		log.Fatal(err)
	}
	defer os.Remove(img)
	if err := s3BenchPut(endpoint, "disk.img", img); err != nil {
		log.Fatal(err)
	}
	object := filepath.Join(root, s3BenchBucket, "disk.img") // the server's file

	// The export's configuration: the environment's credentials are the
	// server's, the cache holds the whole object for the warm rows.
	env := append(os.Environ(), "AWS_ACCESS_KEY_ID="+s3BenchAccess, "AWS_SECRET_ACCESS_KEY="+s3BenchSecret,
		"AWS_REGION=us-east-1", "AWS_CONFIG_FILE=/nonexistent", "AWS_SHARED_CREDENTIALS_FILE=/nonexistent",
		"AWS_EC2_METADATA_DISABLED=true")
	mnt := filepath.Join(dir, "s3.mnt")
	startOurs := func() (*exec.Cmd, error) {
		cmd := exec.Command(bin, "fuse", "--log-level", "warn", "-f", "raw", "--s3-endpoint", endpoint,
			"--cache-size", "1280M", "s3://"+s3BenchBucket+"/disk.img", mnt)
		cmd.Env = env
		return startAndWait(cmd, mnt)
	}
	jobs := []struct {
		job  fioJob
		size string
		ios  int
	}{
		{fioJob{"R 1 MiB seq (MiB/s)", "read", "libaio", "1M", 16}, "1G", 1024},
		{fioJob{"R rand aio", "randread", "libaio", "4k", 16}, "1G", 40000},
		{fioJob{"R rand sync", "randread", "pvsync2", "4k", 1}, "1G", 10000},
	}
	ours := system{name: "blockexport", ours: true}
	var rows []row
	for _, j := range jobs {
		unit := "IOPS"
		if j.job.bs == "1M" {
			unit = "MiB/s"
		}
		cold := row{target: "s3", name: j.job.name + " cold", unit: unit, higherBetter: true}
		hot := row{target: "s3", name: j.job.name + " warm", unit: unit, higherBetter: true}
		warm(object)
		cmd, err := startOurs()
		if err != nil {
			log.Fatal(err)
		}
		// The same I/Os twice (fio repeats its random offsets): the first
		// pass fetches every block, the second finds them cached.
		v, err := fioCount(j.job, mnt, j.size, j.ios)
		if err != nil {
			log.Printf("s3 cold: %v", err)
		}
		cold.add(ours, v)
		v, err = fioCount(j.job, mnt, j.size, j.ios)
		if err != nil {
			log.Printf("s3 warm: %v", err)
		}
		hot.add(ours, v)
		stop(cmd, mnt)
		warm(img)
		f, err := fioCount(j.job, img, j.size, j.ios)
		if err != nil {
			log.Printf("s3 file: %v", err)
		}
		cold.file, hot.file = f, f
		for _, r := range []row{cold, hot} {
			log.Printf("  %-34s ours %10.2f  file %10.2f", r.name, r.ours, r.file)
		}
		rows = append(rows, cold, hot)
	}
	return rows
}

// s3BenchPut uploads path as KEY in the bench bucket.
func s3BenchPut(endpoint, key, path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	c := s3.New(s3.Options{Region: "us-east-1", BaseEndpoint: aws.String(endpoint), UsePathStyle: true,
		Credentials: credentials.NewStaticCredentialsProvider(s3BenchAccess, s3BenchSecret, "")})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if _, err := c.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String(s3BenchBucket), Key: aws.String(key),
		Body: f, ContentLength: aws.Int64(fi.Size())}); err != nil {
		return fmt.Errorf("uploading %s: %w", path, err)
	}
	return nil
}
