package remote

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// s3FioJob is a crc32c-verified random-write job over the first size
// bytes of a file, replayed with --verify_only to check them.
func s3FioJob(size string, seed int) []string {
	return []string{"--name=s3t", "--rw=randwrite", "--bs=4k", "--size=" + size, "--io_size=" + size,
		"--ioengine=libaio", "--iodepth=16", "--direct=1", "--verify=crc32c", "--verify_fatal=1",
		"--verify_state_save=0", fmt.Sprintf("--randseed=%d", seed), "--minimal"}
}

// s3FioReadVerify reads the first size bytes that s3FioJob wrote,
// randomly at queue depth 16, checking each block's crc32c record as it
// comes (fio verifies what a read job reads); --readonly: the export is.
func s3FioReadVerify(size string) []string {
	return []string{"--name=s3t-read", "--rw=randread", "--bs=4k", "--size=" + size, "--ioengine=libaio", "--iodepth=16",
		"--direct=1", "--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0", "--readonly", "--minimal"}
}

// s3Export exports an s3:// object of the server (extra flags first).
func s3Export(t *testing.T, s *harness.S3Server, key, mnt string, args ...string) *harness.Daemon {
	t.Helper()
	return harness.StartExport(t, s.URL(key), mnt, append([]string{"--s3-endpoint", s.Endpoint}, args...)...)
}

// TestS3RawAndQcow2ObjectsThroughTheExport: a raw object and a qcow2
// object (the same disk converted by qemu-img) in versitygw, exported
// read-only over FUSE: fio's crc32c records written into the local disk
// verify through both exports, and qemu-img compare finds each export
// identical to the local copy.
func TestS3RawAndQcow2ObjectsThroughTheExport(t *testing.T) {
	s := harness.StartS3Server(t)
	dir := t.TempDir()
	raw := harness.SparseImage(t, dir, "disk.img", 32<<20)
	job := s3FioJob("16M", 2701)
	harness.Run(t, "fio", append(job, "--filename="+raw)...)
	qc := filepath.Join(dir, "disk.qcow2")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, qc)
	s.Put("disks/disk.img", raw)
	s.Put("disks/disk.qcow2", qc)
	for _, c := range []struct{ key, format string }{{"disks/disk.img", "raw"}, {"disks/disk.qcow2", "qcow2"}} {
		t.Run(c.format, func(t *testing.T) {
			t.Parallel() // two exports of two objects: nothing shared but the server
			mnt := filepath.Join(t.TempDir(), "mnt")
			d := s3Export(t, s, c.key, mnt)
			if !strings.Contains(d.Log(), "s3://images/"+c.key) {
				t.Errorf("the log does not name the object:\n%s", d.Log())
			}
			harness.Run(t, "fio", append(s3FioReadVerify("16M"), "--filename="+mnt)...)
			harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", raw, mnt)
			d.StopClean()
			harness.MustNotShowS3Secret(t, "the export's log", d.Log())
		})
	}
}

// TestS3BackingFileUnderLocalOverlay: a local qcow2 overlay whose backing
// file is s3://…, exported writable: fio writes and verifies through it,
// what it did not write reads as the object, and QEMU then finds the
// overlay clean (its backing file left unopened: qemu-img has no s3).
func TestS3BackingFileUnderLocalOverlay(t *testing.T) {
	s := harness.StartS3Server(t)
	dir := t.TempDir()
	base := harness.RandomImage(t, dir, 32<<20, 2702)
	s.Put("base.img", base)
	ov := filepath.Join(dir, "ov.qcow2")
	harness.Run(t, "qemu-img", "create", "-f", "qcow2", "-u", "-b", s.URL("base.img"), "-F", "raw", ov, "32M")
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, ov, mnt, "-w", "--s3-endpoint", s.Endpoint)
	job := s3FioJob("8M", 2703)
	harness.Run(t, "fio", append(job, "--filename="+mnt)...)
	got := harness.ReadAll(t, mnt)
	harness.MustEqualBytes(t, "the backing file's bytes past the writes", got[8<<20:], harness.ReadAll(t, base)[8<<20:])
	d.StopClean()
	harness.MustNotShowS3Secret(t, "the export's log", d.Log())
	spec, _ := json.Marshal(map[string]any{"driver": "qcow2", "backing": nil,
		"file": map[string]any{"driver": "file", "filename": ov}})
	out := harness.Run(t, "qemu-img", "check", "--output=json", "json:"+string(spec))
	var res struct {
		Corruptions, Leaks int
		CheckErrors        int `json:"check-errors"`
	}
	if err := json.Unmarshal([]byte(out), &res); err != nil || res.Corruptions+res.Leaks+res.CheckErrors != 0 {
		t.Fatalf("qemu-img check of the overlay: %v\n%s", err, out)
	}
	// The written clusters are the overlay's own: verified again with
	// the export gone and started anew.
	d = harness.StartExport(t, ov, mnt, "--s3-endpoint", s.Endpoint)
	harness.Run(t, "fio", append(s3FioReadVerify("8M"), "--filename="+mnt)...)
	d.StopClean()
}

// TestS3OpenFailuresAreOneLine: wrong credentials, a missing bucket, a
// missing key each end the export at open with exit 1 and one line that
// says which, with the secret nowhere.
func TestS3OpenFailuresAreOneLine(t *testing.T) {
	s := harness.StartS3Server(t)
	dir := t.TempDir()
	s.Put("disk.img", harness.RandomImage(t, dir, 1<<20, 2704))
	mnt := filepath.Join(dir, "mnt")
	for _, c := range []struct {
		name, spec, secret, want string
	}{
		{"wrong secret", s.URL("disk.img"), "not-the-secret", "SignatureDoesNotMatch"},
		{"missing bucket", "s3://nobucket/disk.img", harness.S3Secret, "s3://nobucket/disk.img: no such bucket"},
		{"missing key", s.URL("nothere.img"), harness.S3Secret, "s3://images/nothere.img: no such object"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv("AWS_SECRET_ACCESS_KEY", c.secret)
			start := time.Now()
			code, out := harness.TryExport(t, mnt, "--s3-endpoint", s.Endpoint, c.spec)
			lines := strings.Split(strings.TrimSpace(out), "\n")
			if code != 1 || len(lines) != 1 || !strings.Contains(out, c.want) {
				t.Fatalf("exit %d, want 1 and one line with %q:\n%s", code, c.want, out)
			}
			if time.Since(start) > 5*time.Second {
				t.Errorf("the refusal took %v: a permanent error was retried", time.Since(start))
			}
			harness.MustNotShowS3Secret(t, "the error", out)
			if strings.Contains(out, "not-the-secret") {
				t.Fatalf("the error shows the secret given:\n%s", out)
			}
		})
	}
}

// TestS3ObjectOverwrittenWhileExportedIsEIO: once the object is replaced
// (same size, new bytes), a read of what was not yet fetched is EIO and the
// log says why in a line; no byte of the new version is served.
func TestS3ObjectOverwrittenWhileExportedIsEIO(t *testing.T) {
	s := harness.StartS3Server(t)
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, 64<<20, 2705)
	s.Put("disk.img", img)
	mnt := filepath.Join(dir, "mnt")
	d := s3Export(t, s, "disk.img", mnt, "--reconnect-timeout", "5s")
	f, err := os.Open(mnt)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	p := make([]byte, 4096)
	if _, err := f.ReadAt(p, 0); err != nil {
		t.Fatal(err)
	}
	harness.MustEqualBytes(t, "first block", p, harness.ReadAll(t, img)[:4096])
	other := harness.RandomImage(t, filepath.Join(dir), 64<<20, 2706)
	s.Put("disk.img", other)
	_, err = f.ReadAt(p, 48<<20)
	if harness.ErrnoOf(err) != syscall.EIO {
		t.Fatalf("read after the overwrite: %v, want EIO", err)
	}
	if string(p) == string(harness.ReadAll(t, other)[48<<20:48<<20+4096]) {
		t.Fatal("the new version's bytes were served")
	}
	log := d.Log()
	if !strings.Contains(log, "changed") || !strings.Contains(log, "s3://images/disk.img") {
		t.Fatalf("no log line names the changed object:\n%s", log)
	}
}

// TestS3ServerKilledMidRead: the server is killed while the export
// serves; a read waits, and once the server is back (within
// --reconnect-timeout) it returns the right bytes. Killed for good, a read
// is EIO after the timeout, not a hang. The reads are dd processes, so
// that the test holds no descriptor of the export while the server is
// restarted (see below).
func TestS3ServerKilledMidRead(t *testing.T) {
	s := harness.StartS3Server(t)
	dir := t.TempDir()
	img := harness.RandomImage(t, dir, 64<<20, 2707)
	want := harness.ReadAll(t, img)
	s.Put("disk.img", img)
	mnt := filepath.Join(dir, "mnt")
	d := s3Export(t, s, "disk.img", mnt, "--reconnect-timeout", "8s")
	// Read once, and closed before the outage: a process that starts
	// while this one holds the export open closes its inherited copy at
	// exec, and that FLUSH would queue behind the pending read.
	p := make([]byte, 64<<10)
	if f, err := os.Open(mnt); err != nil {
		t.Fatal(err)
	} else if _, err := f.ReadAt(p, 0); err != nil {
		f.Close()
		t.Fatal(err)
	} else {
		f.Close()
	}
	type result struct {
		err  error
		out  string
		took time.Duration
	}
	// dd reads 64 KiB at off into out, in a process of its own.
	dd := func(off int64, out string) chan result {
		done := make(chan result, 1)
		cmd := exec.Command("dd", "if="+mnt, "of="+out, "bs=64k", "count=1", fmt.Sprintf("skip=%d", off/(64<<10)), "iflag=direct", "status=none")
		var buf strings.Builder
		cmd.Stdout, cmd.Stderr = &buf, &buf
		start := time.Now()
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill() })
		go func() {
			err := cmd.Wait()
			done <- result{err, buf.String(), time.Since(start)}
		}()
		return done
	}

	s.Kill()
	out := filepath.Join(dir, "across")
	done := dd(20<<20, out)
	time.Sleep(2 * time.Second)
	select {
	case r := <-done:
		t.Fatalf("a read with the server down returned at once: %v %s", r.err, r.out)
	default:
	}
	s.Start()
	select {
	case r := <-done:
		if r.err != nil {
			t.Fatalf("read across the restart: %v %s\n%s", r.err, r.out, d.Log())
		}
		harness.MustEqualBytes(t, "read across the restart", harness.ReadAll(t, out), want[20<<20:20<<20+len(p)])
	case <-time.After(20 * time.Second):
		t.Fatal("the read did not finish once the server was back")
	}

	s.Kill()
	select {
	case r := <-dd(40<<20, filepath.Join(dir, "gone")):
		if r.err == nil || !strings.Contains(r.out, "Input/output error") {
			t.Fatalf("read with the server gone: %v %s, want EIO", r.err, r.out)
		}
		if r.took < 6*time.Second || r.took > 20*time.Second {
			t.Fatalf("EIO after %v, want about the 8s reconnect timeout", r.took)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a read with the server gone hung past the reconnect timeout")
	}
	d.StopClean()
}
