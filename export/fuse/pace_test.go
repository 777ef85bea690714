package fuse

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/aio"
	"github.com/blockexport/blockexport/coroutines"
	"github.com/blockexport/blockexport/formats/drivers/null"
)

// A queue found empty at paceEmptyToSpin samples in a row (one every
// paceSampleEvery requests) starts the spins; the queue is asked only
// at the samples.
func TestDepthGuessSpinsAfterEmptySamples(t *testing.T) {
	var g depthGuess
	asked := 0
	empty := func() bool { asked++; return false }
	for i := 1; i < paceSampleEvery*paceEmptyToSpin; i++ {
		if g.next(empty) {
			t.Fatalf("spin after request %d, before %d empty samples", i, paceEmptyToSpin)
		}
	}
	if g.next(empty) {
		t.Fatal("the sample that starts the spins spun itself")
	}
	if asked != paceEmptyToSpin {
		t.Fatalf("queue asked %d times in %d requests, want %d", asked, paceSampleEvery*paceEmptyToSpin, paceEmptyToSpin)
	}
	if !g.next(empty) || !g.next(empty) {
		t.Fatal("no spin after the empty samples")
	}
	if asked != paceEmptyToSpin {
		t.Fatal("a spinning queue was sampled")
	}
}

// A queue that has a request waiting at a sample (a reader deeper than
// one) never spins, and one such sample starts the count again.
func TestDepthGuessNotForADeeperReader(t *testing.T) {
	var g depthGuess
	busy := func() bool { return true }
	for i := 0; i < 100*paceSampleEvery; i++ {
		if g.next(busy) {
			t.Fatalf("spin at request %d with requests always queued", i)
		}
	}
	samples := 0
	sometimes := func() bool { samples++; return samples%paceEmptyToSpin == 0 }
	for i := 0; i < 100*paceSampleEvery; i++ {
		if g.next(sometimes) {
			t.Fatalf("spin at request %d: every %dth sample found a request", i, paceEmptyToSpin)
		}
	}
}

func spinning(t *testing.T) depthGuess {
	t.Helper()
	var g depthGuess
	for i := 0; i < paceSampleEvery*paceEmptyToSpin; i++ {
		g.next(func() bool { return false })
	}
	if !g.spinning {
		t.Fatal("not spinning after the empty samples")
	}
	return g
}

// Spins stop after paceBusyToStop in a row found a request already
// there, or paceIdleToStop in a row found none; a spin that caught a
// request between them starts both counts again.
func TestDepthGuessStops(t *testing.T) {
	g := spinning(t)
	for i := 0; i < 1000; i++ {
		g.spun(0)
		g.spun(3) // alternating: never two at once in a row
	}
	if !g.spinning {
		t.Fatal("stopped though spins kept catching requests")
	}
	for i := 0; i < paceBusyToStop; i++ {
		g.spun(0)
	}
	if g.spinning {
		t.Fatalf("still spinning after %d spins found a request at once", paceBusyToStop)
	}

	g = spinning(t)
	for i := 0; i < 100; i++ {
		for j := 0; j < paceIdleToStop-1; j++ {
			g.spun(-1)
		}
		g.spun(1)
	}
	if !g.spinning {
		t.Fatal("stopped though a spin in every few caught a request")
	}
	for i := 0; i < paceIdleToStop; i++ {
		g.spun(-1)
	}
	if g.spinning {
		t.Fatalf("still spinning after %d spins found nothing", paceIdleToStop)
	}
	// Stopped, it samples afresh: no spin before paceEmptyToSpin samples.
	for i := 1; i < paceSampleEvery*paceEmptyToSpin; i++ {
		if g.next(func() bool { return false }) {
			t.Fatalf("spin %d requests after stopping", i)
		}
	}
}

// Only a /dev/fuse loop that sleeps in read(2) paces itself: not with
// --poll-us (its read polls), not the bulk-write helper, not with
// pacing off, and not while a request is in flight in a goroutine.
func TestPacedOnlyWhereTheLoopSleeps(t *testing.T) {
	started := func(s *server, q *queue) bool {
		for i := 0; i < 2*paceSampleEvery*paceEmptyToSpin; i++ {
			if s.paced(q) {
				return true
			}
		}
		return false
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	hand := coroutines.NewHandoff(context.Background())
	if !started(&server{pace: true, hand: hand}, &queue{fd: fds[0]}) {
		t.Fatal("an empty queue's loop never paced itself")
	}
	busy := coroutines.NewHandoff(context.Background())
	busy.Start()
	defer busy.Done()
	for name, c := range map[string]struct {
		s *server
		q *queue
	}{
		"pace off":            {&server{hand: hand}, &queue{fd: fds[0]}},
		"poll-us":             {&server{pace: true, hand: hand, pollFor: time.Millisecond}, &queue{fd: fds[0]}},
		"helper":              {&server{pace: true, hand: hand}, &queue{fd: fds[0], helper: true}},
		"a request in flight": {&server{pace: true, hand: busy}, &queue{fd: fds[0]}},
	} {
		if started(c.s, c.q) {
			t.Errorf("%s: the loop paced itself", name)
		}
	}
}

// spinForRequest counts the looks before a request: 0 for one already
// there, -1 after awaitNextSpin with none.
func TestSpinForRequestLooks(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	s, q := &server{pace: true}, &queue{fd: fds[0]}
	start := time.Now()
	if n := s.spinForRequest(q); n != -1 {
		t.Fatalf("nothing sent, yet found after %d looks", n)
	}
	if d := time.Since(start); d < awaitNextSpin {
		t.Fatalf("gave up after %v, before the %v spin", d, awaitNextSpin)
	}
	unix.Write(fds[1], []byte("request"))
	if n := s.spinForRequest(q); n != 0 {
		t.Fatalf("a request already there found after %d looks, want 0", n)
	}
}

// pacedFake is a server of a null image with pacing on, on a fake
// /dev/fuse (kernelSide); loops start on it with loop. Closing the
// kernel's side ends them; the test's cleanup does so too (on a failure
// as well) and waits for every loop before closing the server's end.
type pacedFake struct {
	s     *server
	k     kernelSide
	fd    int // the server's end
	close func()
}

func newPacedFake(t *testing.T) *pacedFake {
	img, _ := null.New("null", 1<<20, true)
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	s := newServer(New(img, Options{}), fds[0])
	s.pace = true
	var once sync.Once
	f := &pacedFake{s: s, k: kernelSide{t, fds[1]}, fd: fds[0], close: func() { once.Do(func() { unix.Close(fds[1]) }) }}
	t.Cleanup(func() {
		f.close()
		s.loops.Wait()
		s.hand.Wait()
		unix.Close(fds[0])
	})
	return f
}

// loop starts a loop of the fake's server, its guess already spinning
// when spin is set; ended is closed when the loop has returned.
func (f *pacedFake) loop(spin bool) (q *queue, ended chan struct{}) {
	q = &queue{fd: f.fd, to: replyTo{fd: f.fd}, bp: f.s.bufs.Get(), out: aio.AlignedBuf(maxWrite, 4096)}
	if spin {
		q.pace = depthGuess{spinning: true}
	}
	ended = make(chan struct{})
	f.s.loops.Add(1)
	go func() { f.s.run(q); close(ended) }()
	return q, ended
}

// end closes the kernel's side and fails unless each loop of ended
// returns within 5 s.
func (f *pacedFake) end(t *testing.T, ended ...chan struct{}) {
	t.Helper()
	f.close()
	for i, e := range ended {
		select {
		case <-e:
		case <-time.After(5 * time.Second):
			t.Fatalf("loop %d did not end after the kernel's side closed", i+1)
		}
	}
}

// The loop with pacing on, end to end on a fake /dev/fuse: a reader at
// depth 1 (its next request right after each reply) and a deep one (its
// requests written ahead of the replies, as many as the socket holds) get
// every reply right, and the loop ends when the kernel's side goes away,
// even mid-spin. The reader at depth 1 makes the loop spin; the deep one
// rarely does: its samples find requests queued, and spinning starts only
// after paceEmptyToSpin empty samples in a row (when this test's writer
// was descheduled long enough for the loop to drain the socket). With the
// sample's answer inverted, the deep reader made it start 30 times in
// 2000 requests and the reader at depth 1 none. (CI caught an
// earlier version of this test that wanted no spinning at the end: the
// loop drains the tail with no asks behind it, a race either way.)
func TestPacedLoopAnswersEveryDepth(t *testing.T) {
	const requests = 2000
	for _, deep := range []bool{false, true} {
		f := newPacedFake(t)
		q, ended := f.loop(false)
		k := f.k
		ask := func(u uint64) error {
			return write(k.fd, &fuse.ReadIn{InHeader: fuse.InHeader{Opcode: opRead, Unique: u, NodeId: 1}, Offset: (u % 256) * 4096, Size: 4096})
		}
		written := make(chan error, 1)
		if deep {
			go func() {
				for u := uint64(1); u <= requests; u++ {
					if err := ask(u); err != nil {
						written <- fmt.Errorf("writing request %d: %w", u, err)
						return
					}
				}
				written <- nil
			}()
		} else if err := ask(1); err != nil {
			t.Fatal(err)
		}
		for got := 1; got <= requests; got++ {
			h, body, ok := k.replyBody(5000)
			if !ok {
				t.Fatalf("deep %v: no reply %d within 5 s", deep, got)
			}
			if h.Status != 0 || len(body) != 4096 {
				t.Fatalf("deep %v: reply %d: error %d, %d bytes", deep, h.Unique, h.Status, len(body))
			}
			if !deep && got < requests {
				if err := ask(uint64(got + 1)); err != nil {
					t.Fatal(err)
				}
			}
		}
		if deep {
			if err := <-written; err != nil {
				t.Fatal(err)
			}
		}
		f.end(t, ended) // mid-spin or asleep, the loop reads the end
		switch {
		case deep && q.pace.began > 10: // 0 in 20 runs here; 30 with the sample inverted
			t.Errorf("deep reader: spinning started %d times, its requests queued ahead", q.pace.began)
		case !deep && q.pace.began == 0:
			t.Error("reader at depth 1: the loop never spun, though each request comes after its reply")
		}
		t.Logf("deep %v: spinning started %d times", deep, q.pace.began)
	}
}
