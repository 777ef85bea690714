package qcow2

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"testing"
	"time"
)

// amendTestImage runs the commands that make an image (qemu-img,
// qemu-io) and returns the image's path.
func amendTestImage(t *testing.T, dir string, cmds ...[]string) string {
	t.Helper()
	for _, args := range cmds {
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out)
		}
	}
	return filepath.Join(dir, "img.qcow2")
}

// zeroClustersOverBacking is an image whose zero clusters need every
// case of the expansion: zero clusters over a backing file's data (fresh
// clusters), zeroed clusters that keep their host cluster, both shared
// with a snapshot, and a compressed cluster.
func zeroClustersOverBacking(t *testing.T, dir string) string {
	base, img := filepath.Join(dir, "base.qcow2"), filepath.Join(dir, "img.qcow2")
	return amendTestImage(t, dir,
		[]string{"qemu-img", "create", "-q", "-f", "qcow2", base, "8M"},
		[]string{"qemu-io", "-f", "qcow2", "-c", "write -P 0x11 0 4M", base},
		[]string{"qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", img},
		[]string{"qemu-io", "-f", "qcow2", "-c", "write -P 0x22 64k 256k", "-c", "write -z 512k 192k",
			"-c", "write -c -P 0x33 1M 64k", img},
		[]string{"qemu-img", "snapshot", "-c", "s1", img},
		[]string{"qemu-io", "-f", "qcow2", "-c", "write -z 64k 64k", "-c", "write -z 2M 128k", img},
	)
}

// amendInfo is what qemu-img info says of the amended fields.
func amendInfo(t *testing.T, img string) (compat string, refcountBits int) {
	t.Helper()
	out, err := exec.Command("qemu-img", "info", "-U", "--output=json", img).Output()
	if err != nil {
		t.Fatalf("qemu-img info %s: %v", img, err)
	}
	var info struct {
		FormatSpecific struct {
			Data struct {
				Compat       string `json:"compat"`
				RefcountBits int    `json:"refcount-bits"`
			} `json:"data"`
		} `json:"format-specific"`
	}
	if err := json.Unmarshal(out, &info); err != nil {
		t.Fatal(err)
	}
	return info.FormatSpecific.Data.Compat, info.FormatSpecific.Data.RefcountBits
}

// qemuCheckStatus is qemu-img check's exit status.
func qemuCheckStatus(t *testing.T, img string) (int, string) {
	t.Helper()
	out, err := exec.Command("qemu-img", "check", img).CombinedOutput()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0, string(out)
	case errors.As(err, &ee):
		return ee.ExitCode(), string(out)
	}
	t.Fatalf("qemu-img check: %v", err)
	return 0, ""
}

func amendWith(t *testing.T, img string, o AmendOptions, killAfter int) (int, error) {
	t.Helper()
	f, err := openTestFile(img, testOpts{Backend: "threads", Writable: true})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	k := &killedFile{File: f, n: killAfter}
	if _, err := PrepareAmend(context.Background(), k); err != nil {
		return k.writes, err
	}
	err = Amend(context.Background(), k, o, func(context.Context, int64) error { return errors.New("no resize here") })
	return k.writes, err
}

// TestAmendCutAtEveryWriteLeavesAConsistentImage cuts a refcount width
// change and a downgrade after each of their writes, as a process killed
// there leaves the file: qemu-img check finds no corruption (a width
// change leaks nothing either; a downgrade may leak the fresh clusters it
// had not linked yet), the image has the old settings or the new ones,
// and the guest reads the same data.
func TestAmendCutAtEveryWriteLeavesAConsistentImage(t *testing.T) {
	cases := []struct {
		name           string
		make           func(t *testing.T, dir string) string
		o              AmendOptions
		compat         []string
		bits           []int
		leaksAllowed   bool
		wantFullWrites int // at least this many writes uncut
	}{
		{"refcount_bits=8", func(t *testing.T, dir string) string { img, _ := baseImageWithSnapshot(t, dir); return img },
			AmendOptions{RefcountBits: 8}, []string{"1.1"}, []int{16, 8}, false, 3},
		{"refcount_bits=64", zeroClustersOverBacking, AmendOptions{RefcountBits: 64}, []string{"1.1"}, []int{16, 64}, false, 3},
		{"compat=0.10", zeroClustersOverBacking, AmendOptions{Version: 2}, []string{"1.1", "0.10"}, []int{16}, true, 5},
		{"compat=0.10,refcount_bits=16 from 8", func(t *testing.T, dir string) string {
			img := zeroClustersOverBacking(t, dir)
			if _, err := amendWith(t, img, AmendOptions{RefcountBits: 8}, 1<<30); err != nil {
				t.Fatal(err)
			}
			return img
		}, AmendOptions{Version: 2, RefcountBits: 16}, []string{"1.1", "0.10"}, []int{8, 16}, true, 6},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			img := tc.make(t, dir)
			pristine, err := os.ReadFile(img)
			if err != nil {
				t.Fatal(err)
			}
			want := qemuRawBytes(t, img)
			full, err := amendWith(t, img, tc.o, 1<<30)
			if err != nil {
				t.Fatalf("uncut amend: %v", err)
			}
			if full < tc.wantFullWrites {
				t.Fatalf("the uncut amend wrote %d times, want at least %d", full, tc.wantFullWrites)
			}
			if status, out := qemuCheckStatus(t, img); status != 0 {
				t.Fatalf("after the uncut amend: qemu-img check exit %d\n%s", status, out)
			}
			compat, bits := amendInfo(t, img)
			if compat != tc.compat[len(tc.compat)-1] || bits != tc.bits[len(tc.bits)-1] {
				t.Fatalf("after the uncut amend: compat %s, refcount bits %d", compat, bits)
			}
			if !bytes.Equal(qemuRawBytes(t, img), want) {
				t.Fatal("the uncut amend changed the guest data")
			}
			for n := range full {
				if err := os.WriteFile(img, pristine, 0o644); err != nil {
					t.Fatal(err)
				}
				if _, err := amendWith(t, img, tc.o, n); !errors.Is(err, errKilled) {
					t.Fatalf("cut after %d writes: %v, want the cut", n, err)
				}
				status, out := qemuCheckStatus(t, img)
				if status != 0 && !(status == 3 && tc.leaksAllowed) {
					t.Fatalf("cut after %d writes: qemu-img check exit %d\n%s", n, status, out)
				}
				compat, bits := amendInfo(t, img)
				if !slices.Contains(tc.compat, compat) || !slices.Contains(tc.bits, bits) {
					t.Fatalf("cut after %d writes: compat %s, refcount bits %d", n, compat, bits)
				}
				if !bytes.Equal(qemuRawBytes(t, img), want) {
					t.Fatalf("cut after %d writes: the guest data changed", n)
				}
			}
		})
	}
}

// TestAmendWritesQemusHeader upgrades a version 2 image and downgrades
// a version 3 one as qemu-img amend does on copies: the header clusters
// come out the same, byte for byte (nothing else moves in these).
func TestAmendWritesQemusHeader(t *testing.T) {
	for _, tc := range []struct {
		create, compat string
		o              AmendOptions
	}{
		{"compat=0.10", "compat=1.1", AmendOptions{Version: 3}},
		{"compat=1.1,lazy_refcounts=on", "compat=0.10", AmendOptions{Version: 2}},
	} {
		t.Run(tc.compat, func(t *testing.T) {
			dir := t.TempDir()
			base := filepath.Join(dir, "base.qcow2")
			img := amendTestImage(t, dir,
				[]string{"qemu-img", "create", "-q", "-f", "qcow2", base, "8M"},
				[]string{"qemu-img", "create", "-q", "-f", "qcow2", "-o", tc.create, "-b", base, "-F", "qcow2", filepath.Join(dir, "img.qcow2")},
				[]string{"qemu-io", "-f", "qcow2", "-c", "write -P 1 0 128k", filepath.Join(dir, "img.qcow2")},
			)
			theirs := filepath.Join(dir, "theirs.qcow2")
			b, err := os.ReadFile(img)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(theirs, b, 0o644); err != nil {
				t.Fatal(err)
			}
			if out, err := exec.Command("qemu-img", "amend", "-o", tc.compat, theirs).CombinedOutput(); err != nil {
				t.Fatalf("qemu-img amend: %v\n%s", err, out)
			}
			if _, err := amendWith(t, img, tc.o, 1<<30); err != nil {
				t.Fatal(err)
			}
			ours, err := os.ReadFile(img)
			if err != nil {
				t.Fatal(err)
			}
			want, err := os.ReadFile(theirs)
			if err != nil {
				t.Fatal(err)
			}
			for i := range 65536 {
				if ours[i] != want[i] {
					t.Fatalf("header cluster differs from qemu-img's first at byte %d: %#x, want %#x", i, ours[i], want[i])
				}
			}
		})
	}
}

// TestAmendOptionsAreRefusedInQemuImgsWords checks the option parser's
// refusals, which need no image.
func TestAmendOptionsAreRefusedInQemuImgsWords(t *testing.T) {
	for _, tc := range []struct {
		keys map[string]string
		want string
	}{
		{map[string]string{"cluster_size": "4096"}, "Invalid parameter 'cluster_size'\nThis option is only supported for image creation"},
		{map[string]string{"foo": "1"}, "Invalid parameter 'foo'"},
		{map[string]string{"refcount_bits": "3"}, "Refcount width must be a power of two and may not exceed 64 bits"},
		{map[string]string{"refcount_bits": "128"}, "Refcount width must be a power of two and may not exceed 64 bits"},
		{map[string]string{"refcount_bits": "x"}, "Parameter 'refcount_bits' expects a number"},
		{map[string]string{"compat": "0.9"}, "Unknown compatibility level 0.9"},
		{map[string]string{"lazy_refcounts": "maybe"}, "Parameter 'lazy_refcounts' expects 'on' or 'off'"},
		{map[string]string{"data_file": "x"}, "data-file can only be set for images that use an external data file"},
	} {
		_, err := ParseAmendOptions(tc.keys)
		if err == nil || err.Error() != tc.want {
			t.Errorf("%v: %v, want %q", tc.keys, err, tc.want)
		}
	}
	o, err := ParseAmendOptions(map[string]string{"compat": "v2", "refcount_bits": "0x40", "lazy_refcounts": "off"})
	if err != nil || o.Version != 2 || o.RefcountBits != 64 || o.LazyRefcounts == nil || *o.LazyRefcounts {
		t.Fatalf("%+v, %v", o, err)
	}
}

// FuzzAmend runs each amend step over mutated images: whatever the
// metadata says, no panic and no hang; a refusal is fine.
func FuzzAmend(f *testing.F) {
	seeds, _ := filepath.Glob("testdata/seeds/*.qcow2")
	for _, s := range seeds {
		b, err := os.ReadFile(s)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	dir := f.TempDir()
	steps := []AmendOptions{{RefcountBits: 8}, {RefcountBits: 64}, {Version: 2}, {Version: 3}, {LazyRefcounts: new(false)}}
	f.Fuzz(func(t *testing.T, b []byte) {
		done := make(chan struct{})
		defer close(done)
		go func() {
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				buf := make([]byte, 1<<20)
				n := runtime.Stack(buf, true)
				panic(fmt.Sprintf("amend hangs for 10s:\n%s", buf[:n]))
			}
		}()
		for _, o := range steps {
			p := filepath.Join(dir, "fuzz.qcow2")
			if err := os.WriteFile(p, b, 0o644); err != nil {
				t.Fatal(err)
			}
			amendWith(t, p, o, 1<<30)
		}
	})
}
