package remote

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"
)

// Close while a reader that cannot give up makes its own GET, which
// hangs: Close cancels that GET (it runs with the file's context, not
// the reader's), waits for it and returns, and the reader gets an error
// rather than hanging until its peer answers.
func TestRvwCloseEndsAnInlineGet(t *testing.T) {
	m := &memBackend{data: rhData(1 << 20), delay: time.Minute}
	f, err := Open(context.Background(), m, Options{ReconnectTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	// Closed on an early failure too, so that the reader's minute-long
	// GET ends with the test (a second Close returns at once).
	t.Cleanup(func() { f.Close() })
	read := make(chan error, 1)
	go func() {
		_, err := f.ReadAt(context.Background(), make([]byte, 4096), 0)
		read <- err
	}()
	for deadline := time.Now().Add(2 * time.Second); m.gets.Load() == 0; {
		if time.Now().After(deadline) {
			t.Fatal("the GET never started")
		}
		time.Sleep(time.Millisecond)
	}
	closed := make(chan error, 1)
	go func() { closed <- f.Close() }()
	select {
	case <-closed:
	case <-time.After(3 * time.Second):
		t.Fatal("Close hangs behind a reader's own GET")
	}
	select {
	case err := <-read:
		if err == nil {
			t.Fatal("the reader whose GET Close cancelled got no error")
		}
	case <-time.After(3 * time.Second):
		t.Fatal("the reader hangs after Close")
	}
}

// A reader's own GET that fails gives its connection back: with one
// connection, a failed inline GET (a permanent error) and then reads of
// both kinds all finish, the later ones with the right bytes.
func TestRvwFailedInlineGetGivesItsConnectionBack(t *testing.T) {
	m := &memBackend{data: rhData(2 << 20)}
	m.fail = func(n int64, _ context.Context) error {
		if n == 1 {
			return errors.New("403 Forbidden")
		}
		return nil
	}
	f := openMem(t, m, Options{Connections: 1, ReconnectTimeout: 2 * time.Second})
	p := make([]byte, 4096)
	if _, err := f.ReadAt(context.Background(), p, 0); err == nil {
		t.Fatal("the failed GET's read got no error")
	}
	done := make(chan error, 1)
	go func() {
		for i, off := range []int64{256 << 10, 0, 1 << 20} {
			ctx := context.Background()
			var cancel context.CancelFunc = func() {}
			if i == 1 {
				ctx, cancel = context.WithCancel(ctx)
			}
			q := make([]byte, 4096)
			_, err := f.ReadAt(ctx, q, off)
			cancel()
			if err == nil && !bytes.Equal(q, m.data[off:off+4096]) {
				err = errBadReply
			}
			if err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("reads after a failed inline GET wait for a connection it kept")
	}
}

// A reader that cannot give up, reading more than one GET's worth with
// one connection: it makes the first GET itself with the only connection
// while the next waits for it as a reader's own fetch (before
// readahead); the read finishes with the right bytes, and a reader that
// may give up, sharing a block whose GET the first makes, cancels
// without waiting for it.
func TestRvwInlineReadOfSeveralGetsOnOneConnection(t *testing.T) {
	m := &memBackend{data: rhData(8 << 20)}
	f := openMem(t, m, Options{Connections: 1, ReconnectTimeout: 5 * time.Second})
	p := make([]byte, 2*maxGet+maxGet/2)
	done := make(chan error, 1)
	go func() {
		_, err := f.ReadAt(context.Background(), p, 4096)
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a read of several GETs on one connection hangs")
	}
	if !bytes.Equal(p, m.data[4096:4096+len(p)]) {
		t.Fatal("wrong bytes")
	}

	m.delay = 2 * time.Second // and 1 s to give up: see TestReaderCancelDoesNotWait
	off := int64(6 << 20)
	inl := make(chan error, 1)
	q := make([]byte, 4096)
	go func() {
		_, err := f.ReadAt(context.Background(), q, off)
		inl <- err
	}()
	time.Sleep(20 * time.Millisecond) // its GET is in flight
	ctx, cancel := context.WithCancel(context.Background())
	other := make(chan error, 1)
	go func() {
		_, err := f.ReadAt(ctx, make([]byte, 4096), off)
		other <- err
	}()
	time.Sleep(10 * time.Millisecond)
	cancel()
	select {
	case err := <-other:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("the reader that gave up: %v, want context.Canceled", err)
		}
	case <-time.After(time.Second):
		t.Fatal("a reader that gave up waited for another reader's own GET")
	}
	if err := <-inl; err != nil || !bytes.Equal(q, m.data[off:off+4096]) {
		t.Fatalf("the reader that made the GET: %v", err)
	}
}
