package aio

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestCmdRing drives a command ring as the FUSE queues do: a read of an
// eventfd completes when another thread writes it, the SQ refuses an SQE
// past its size until Enter submits, and a URING_CMD on a file that takes
// none completes with the kernel's refusal (the 128-byte SQE reached it).
func TestCmdRing(t *testing.T) {
	r, err := NewCmdRing(4)
	if err != nil {
		t.Skipf("no io_uring here: %v", err)
	}
	defer r.Close()
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(efd)
	var buf [8]byte
	if !r.Read(efd, buf[:], 7) {
		t.Fatal("an empty SQ refused an SQE")
	}
	if err := r.Enter(false); err != nil {
		t.Fatal(err)
	}
	if r.Pending() {
		t.Fatal("a completion before the eventfd was written")
	}
	go unix.Write(efd, []byte{1, 0, 0, 0, 0, 0, 0, 0})
	if err := r.Enter(true); err != nil {
		t.Fatal(err)
	}
	var got []completion
	if n := r.Completions(func(ud uint64, res int32) { got = append(got, completion{ud, res}) }); n != 1 || got[0].userData != 7 || got[0].res != 8 || buf[0] != 1 {
		t.Fatalf("completions %+v, buffer %v; want one for tag 7 of 8 bytes", got, buf)
	}

	f, err := os.Create(filepath.Join(t.TempDir(), "plain"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var cmd [CmdLen]byte
	queued := 0
	for r.URingCmd(int(f.Fd()), 1, 0, 0, &cmd, uint64(100+queued)) {
		queued++
	}
	if queued != 4 {
		t.Fatalf("a 4-entry SQ took %d SQEs", queued)
	}
	if err := r.Enter(true); err != nil {
		t.Fatal(err)
	}
	got = got[:0]
	for len(got) < queued {
		r.Completions(func(ud uint64, res int32) { got = append(got, completion{ud, res}) })
		if len(got) < queued {
			if err := r.Enter(true); err != nil {
				t.Fatal(err)
			}
		}
	}
	for i, c := range got {
		if c.userData != uint64(100+i) || c.res >= 0 {
			t.Fatalf("URING_CMD on a plain file: completion %+v; want tag %d and an error", c, 100+i)
		}
	}
}

type completion struct {
	userData uint64
	res      int32
}
