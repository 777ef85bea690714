package qcow2

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/blockexport/blockexport/aio"
)

// A repair killed at any write leaves an image whose guest data is intact
// and that a second repair makes clean: the rebuild writes its refcount
// structures in fresh clusters and switches the header to them last.

// errKilled is the write that did not happen because the process died.
var errKilled = errors.New("killed")

// killedFile lets the first n writes through and drops the rest, as a
// process killed after its n-th write would leave the file.
type killedFile struct {
	aio.File
	n, writes int
}

func (k *killedFile) WriteAt(ctx context.Context, p []byte, off int64) (int, error) {
	if k.writes >= k.n {
		return 0, errKilled
	}
	k.writes++
	return k.File.WriteAt(ctx, p, off)
}

func chkQemuRaw(t *testing.T, img string) []byte {
	t.Helper()
	raw := img + ".raw"
	if out, err := exec.Command("qemu-img", "convert", "-f", "qcow2", "-O", "raw", img, raw).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img convert %s: %v\n%s", img, err, out)
	}
	defer os.Remove(raw)
	b, err := os.ReadFile(raw)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// chkBrokenImage makes an image with data and a snapshot whose first
// refcount table entry names a data cluster: the case where a repair that
// trusts the table writes refcounts over guest data.
func chkBrokenImage(t *testing.T, dir string) string {
	t.Helper()
	img := filepath.Join(dir, "broken.qcow2")
	for _, args := range [][]string{
		{"qemu-img", "create", "-q", "-f", "qcow2", img, "8M"},
		{"qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 0 256k", "-c", "write -P 0x33 1M 64k", img},
		{"qemu-img", "snapshot", "-c", "s1", img},
		{"qemu-io", "-f", "qcow2", "-c", "write -P 0x77 64k 64k", img},
	} {
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out)
		}
	}
	b, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	be := binary.BigEndian
	rt := be.Uint64(b[48:])
	l2 := be.Uint64(b[be.Uint64(b[40:]):]) & l1OffsetMask
	data := be.Uint64(b[l2:]) & l2OffsetMask
	be.PutUint64(b[rt:], data)
	if err := os.WriteFile(img, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return img
}

func checkWith(t *testing.T, img string, repair, killAfter int) (int, error) {
	t.Helper()
	f, err := openTestFile(img, testOpts{Backend: "threads", Writable: repair != RepairNone})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	k := &killedFile{File: f, n: killAfter}
	_, err = Check(context.Background(), k, repair)
	return k.writes, err
}

func TestCheckRebuildSurvivesAKillAtEveryWrite(t *testing.T) {
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Skip("no qemu-img")
	}
	dir := t.TempDir()
	broken := chkBrokenImage(t, dir)
	orig := chkQemuRaw(t, broken)
	brokenBytes, err := os.ReadFile(broken)
	if err != nil {
		t.Fatal(err)
	}

	// -r leaks refuses, writing nothing.
	if n, err := checkWith(t, broken, RepairLeaks, 1<<30); !errors.Is(err, ErrNeedRebuild) || n != 0 {
		t.Fatalf("-r leaks: %d writes, %v; want none and ErrNeedRebuild", n, err)
	}
	full := filepath.Join(dir, "full.qcow2")
	if err := os.WriteFile(full, brokenBytes, 0o644); err != nil {
		t.Fatal(err)
	}
	total, err := checkWith(t, full, RepairAll, 1<<30)
	if err != nil || total < 3 {
		t.Fatalf("-r all: %d writes, %v", total, err)
	}
	for n := 0; n < total; n++ {
		t.Run(fmt.Sprintf("killed after %d of %d writes", n, total), func(t *testing.T) {
			img := filepath.Join(t.TempDir(), "k.qcow2")
			if err := os.WriteFile(img, brokenBytes, 0o644); err != nil {
				t.Fatal(err)
			}
			if _, err := checkWith(t, img, RepairAll, n); !errors.Is(err, errKilled) {
				t.Fatalf("the kill was not reached: %v", err)
			}
			if got := chkQemuRaw(t, img); !bytes.Equal(got, orig) {
				t.Fatal("the guest data changed")
			}
			// A second repair, uninterrupted, makes the image clean.
			if _, err := checkWith(t, img, RepairAll, 1<<30); err != nil {
				t.Fatalf("the second repair: %v", err)
			}
			if out, err := exec.Command("qemu-img", "check", "-f", "qcow2", img).CombinedOutput(); err != nil {
				t.Fatalf("qemu-img check after the second repair: %v\n%s", err, out)
			}
			if got := chkQemuRaw(t, img); !bytes.Equal(got, orig) {
				t.Fatal("the guest data changed after the second repair")
			}
		})
	}
}

// FuzzCheck runs check and both repairs over mutated images: whatever the
// metadata says (offsets at bit 63, tables past the end, counts at their
// limits), no panic and no hang.
func FuzzCheck(f *testing.F) {
	seeds, _ := filepath.Glob("testdata/seeds/*.qcow2")
	for _, s := range seeds {
		b, err := os.ReadFile(s)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, b []byte) {
		done := make(chan struct{})
		defer close(done)
		go func() {
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				buf := make([]byte, 1<<20)
				n := runtime.Stack(buf, true)
				panic(fmt.Sprintf("check hangs for 10s:\n%s", buf[:n]))
			}
		}()
		for _, repair := range []int{RepairNone, RepairLeaks, RepairAll} {
			p := filepath.Join(dir, "fuzz.qcow2")
			if err := os.WriteFile(p, b, 0o644); err != nil {
				t.Fatal(err)
			}
			checkWith(t, p, repair, 1<<30)
		}
	})
}
