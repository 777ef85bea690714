package remote

import (
	"encoding/json"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/blockexport/blockexport/tests/internal/harness"
)

// TestS3InfoMapAndCreate: info and map of a qcow2 object read its
// metadata over S3 and say what qemu-img says of the local copy (the
// same bytes: the same mapping, offsets included); create -b s3://…
// writes an overlay whose backing string is the URL, exported then.
func TestS3InfoMapAndCreate(t *testing.T) {
	s := harness.StartS3Server(t)
	dir := t.TempDir()
	raw := harness.RandomImage(t, dir, 8<<20, 2708)
	harness.Run(t, "qemu-io", "-f", "raw", "-c", "write -z 1M 2M", raw)
	qc := filepath.Join(dir, "disk.qcow2")
	harness.Run(t, "qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, qc)
	s.Put("disk.qcow2", qc)
	url := s.URL("disk.qcow2")

	code, out := harness.RunBlockexport(t, "info", "--output=json", "--s3-endpoint", s.Endpoint, url)
	if code != 0 {
		t.Fatalf("info: exit %d\n%s", code, out)
	}
	var got, want map[string]any
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("info: %v\n%s", err, out)
	}
	if err := json.Unmarshal([]byte(harness.Run(t, "qemu-img", "info", "--output=json", qc)), &want); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"format", "virtual-size", "cluster-size", "format-specific", "dirty-flag"} {
		if !reflect.DeepEqual(got[k], want[k]) {
			t.Errorf("info %s: %v, qemu-img says %v", k, got[k], want[k])
		}
	}
	if got["filename"] != url {
		t.Errorf("info filename %v, want %s", got["filename"], url)
	}
	harness.MustNotShowS3Secret(t, "info", out)

	code, out = harness.RunBlockexport(t, "map", "--output=json", "--s3-endpoint", s.Endpoint, url)
	if code != 0 {
		t.Fatalf("map: exit %d\n%s", code, out)
	}
	var gotMap, wantMap []map[string]any
	if err := json.Unmarshal([]byte(out), &gotMap); err != nil {
		t.Fatalf("map: %v\n%s", err, out)
	}
	if err := json.Unmarshal([]byte(harness.Run(t, "qemu-img", "map", "--output=json", qc)), &wantMap); err != nil {
		t.Fatal(err)
	}
	for _, m := range append(gotMap, wantMap...) {
		delete(m, "filename")
	}
	if !reflect.DeepEqual(gotMap, wantMap) {
		t.Errorf("map:\n%v\nqemu-img:\n%v", gotMap, wantMap)
	}

	ov := filepath.Join(dir, "ov.qcow2")
	code, out = harness.RunBlockexport(t, "create", "-f", "qcow2", "-b", url, "-F", "qcow2", "--s3-endpoint", s.Endpoint, ov)
	if code != 0 {
		t.Fatalf("create -b: exit %d\n%s", code, out)
	}
	var ovInfo map[string]any
	if err := json.Unmarshal([]byte(harness.Run(t, "qemu-img", "info", "--output=json", "-U", "--force-share", ov)), &ovInfo); err != nil {
		t.Fatal(err)
	}
	if ovInfo["backing-filename"] != url || ovInfo["virtual-size"] != want["virtual-size"] {
		t.Fatalf("the overlay: backing %v size %v", ovInfo["backing-filename"], ovInfo["virtual-size"])
	}
	mnt := filepath.Join(dir, "mnt")
	d := harness.StartExport(t, ov, mnt, "--s3-endpoint", s.Endpoint)
	harness.Run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", raw, mnt)
	d.StopClean()
}
