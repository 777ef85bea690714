package remote

// Fetching: range GETs of missing blocks, each holding a connection slot.

import (
	"context"
	"errors"
	"sync"
	"time"
)

// maxGet bounds one range GET: a longer run of missing blocks is split, so
// that a large read keeps several connections busy and the bounce buffers
// (one per connection) stay small.
const maxGet = 1 << 20

// start fetches runs of loading blocks in GETs of up to maxGet, with mu
// held and the file open. own: a reader waits on them (readahead queues
// behind them for connections). inline: the first GET comes back
// unstarted, holding a connection, if one is free and no reader queues:
// the reader makes it itself.
func (f *File) start(runs [][2]int64, own, inline bool) (mine *fetch) {
	per := maxGet / f.bs
	asked := time.Now()
	for _, r := range runs {
		for i := r[0]; i < r[1]; i += per {
			j := min(i+per, r[1])
			bl := make([]*block, 0, j-i)
			done := make(chan struct{})
			for k := i; k < j; k++ {
				b := f.blocks[k]
				b.done = done
				if b.hi == 0 {
					b.lo, b.hi = 0, f.size(k) // all of it, unless partial
				}
				bl = append(bl, b)
			}
			f.wg.Add(1)
			x := fetch{bl: bl, i: i, j: j, asked: asked, own: own}
			if inline && mine == nil && f.conns.tryGet() {
				mine = &x
				continue
			}
			if own {
				// A reader's fetch takes its place in the queue now, in
				// the reader's order, not when its goroutine first runs:
				// on a loaded machine readahead queued meanwhile went
				// first (a random read waited behind four readahead GETs).
				x.ch = f.conns.get(true)
			}
			f.spawn(x)
		}
	}
	return mine
}

// fetch is one GET for load: blocks bl, [i, j).
type fetch struct {
	bl    []*block
	i, j  int64
	asked time.Time
	own   bool
	// ch is where a reader's own fetch (own) gets its connection: start
	// asked for it already (nil: it was free). Readahead asks in slot.
	ch chan struct{}
}

// workerIdle is how long a fetching goroutine waits for the next fetch
// before it exits.
const workerIdle = time.Second

// spawn runs x on a goroutine of its own: an idle one that fetched
// before, or a new one. Reused goroutines keep the stacks they grew: a
// new goroutine per GET grew its stack on every request (docs/design.md,
// Remote objects: fetching goroutines).
func (f *File) spawn(x fetch) {
	select {
	case f.jobs <- x:
	default:
		go f.worker(x)
	}
}

func (f *File) worker(x fetch) {
	t := time.NewTimer(workerIdle)
	defer t.Stop()
	for {
		f.load(x, false)
		t.Reset(workerIdle)
		select {
		case x = <-f.jobs:
		case <-t.C:
			return
		case <-f.ctx.Done():
			return
		}
	}
}

// slots is a semaphore of connections whose waiters are served in
// two queues, readers' own fetches before readahead.
type slots struct {
	mu     sync.Mutex
	free   int
	own, a []chan struct{}
}

// get takes a connection (nil) or queues for one: the channel is closed
// when it is handed over.
func (s *slots) get(own bool) chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.free > 0 && len(s.own) == 0 && (own || len(s.a) == 0) {
		s.free--
		return nil
	}
	ch := make(chan struct{})
	if own {
		s.own = append(s.own, ch)
	} else {
		s.a = append(s.a, ch)
	}
	return ch
}

// drop leaves the queue; false: the connection was handed over already
// (the caller holds it).
func (s *slots) drop(ch chan struct{}, own bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	q := &s.a
	if own {
		q = &s.own
	}
	for i, c := range *q {
		if c == ch {
			*q = append((*q)[:i], (*q)[i+1:]...)
			return true
		}
	}
	return false
}

// tryGet takes a connection if one is free and no reader's fetch
// queues for one (readahead waiting does not count: readers go first).
func (s *slots) tryGet() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.free > 0 && len(s.own) == 0 {
		s.free--
		return true
	}
	return false
}

// put gives a connection back, to the first waiter if any.
func (s *slots) put() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, q := range []*[]chan struct{}{&s.own, &s.a} {
		if len(*q) > 0 {
			close((*q)[0])
			*q = (*q)[1:]
			return
		}
	}
	s.free++
}

// slot takes a connection, or fails at the fetch's deadline or Close.
func (f *File) slot(x fetch) error {
	asked, ch := x.asked, x.ch
	if !x.own {
		ch = f.conns.get(false)
	}
	if ch == nil {
		return nil
	}
	for {
		var err error
		d := time.Until(f.deadline(asked))
		if d <= 0 {
			err = &timeoutError{after: f.timeout(), last: errors.New("waited for a connection while none succeeded")}
		} else {
			t := time.NewTimer(d)
			select {
			case <-ch:
				t.Stop()
				return nil
			case <-f.ctx.Done():
				t.Stop()
				err = f.closedError()
			case <-t.C:
				continue // fails unless a request succeeded meanwhile (deadline moved)
			}
		}
		if !f.conns.drop(ch, x.own) {
			f.conns.put() // handed over as it gave up
		}
		return err
	}
}

// load makes fetch x: one range GET (retried) of blocks x.bl ([x.i, x.j))
// straight into their buffers (taken first: blocks count against the cache
// from their insertion), and their entries completed whatever happens.
// held: the caller took the connection already (start).
func (f *File) load(x fetch, held bool) {
	defer f.wg.Done()
	bl, i, j, asked := x.bl, x.i, x.j, x.asked
	off := i * f.bs
	end := min(j*f.bs, f.obj.Size)
	// A partial block (one, alone in its GET) asks for its pages only.
	roff, rend := off, end
	if len(bl) == 1 {
		roff, rend = off+bl[0].lo, off+bl[0].hi
	}
	var bufs [][]byte
	var err error
	if !held {
		err = f.slot(x)
	}
	if err == nil {
		bufs = make([][]byte, len(bl))
		f.mu.Lock()
		for n := range bufs {
			lo := off + int64(n)*f.bs
			bufs[n] = f.newBuf()[:min(f.bs, end-lo)]
		}
		f.mu.Unlock()
		vec := bufs
		if roff > off || rend < end {
			vec = [][]byte{bufs[0][roff-off : rend-off]}
		}
		// held: the reader's own GET, made on its goroutine because nothing
		// else is in flight (loaded); the backend may spin on its reply.
		base := f.ctx
		if held {
			base = f.loneCtx
		}
		err = f.retry(base, f.deadline(asked), func(ctx context.Context) error {
			return f.readv(ctx, vec, roff)
		})
		if err == nil {
			f.lastOK.Store(time.Now().UnixNano())
		}
		f.conns.put()
	}
	if err != nil {
		err = f.ioError(err, roff, rend-roff)
	}
	f.mu.Lock()
	for n, b := range bl {
		k := i + int64(n)
		if b.loaded || b.err != nil {
			continue // cannot be: loading entries are completed here only
		}
		if err != nil || f.blocks == nil {
			if err == nil {
				err = f.closedError()
			}
			if f.blocks[k] == b {
				delete(f.blocks, k)
			}
			b.evicted = true
			b.err = err
			continue
		}
		b.data, b.loaded = bufs[n], true
		bufs[n] = nil
		if b.evicted {
			// Evicted while loading: its readers get it, then it goes.
			if b.refs == 0 {
				f.recycle(b)
			}
			continue
		}
		f.touch(b)
	}
	if len(bl) > 0 {
		close(bl[0].done)
	}
	if f.blocks != nil {
		// A reader that found the cache all loading overshot it (insert);
		// now that blocks are loaded, the cache goes back to its size
		// rather than keeping the overshoot until the next insert.
		f.shrink(f.capacity)
		for _, d := range bufs {
			if d != nil && len(f.free) < f.capacity {
				f.free = append(f.free, d[:cap(d)])
			}
		}
	}
	f.mu.Unlock()
}

// readv fills bufs, in order, from the object at off: straight into them
// when the backend reads vectors, else through a bounce buffer.
func (f *File) readv(ctx context.Context, bufs [][]byte, off int64) error {
	if vb, ok := f.b.(VectorBackend); ok {
		return vb.ReadRangev(ctx, f.obj, bufs, off)
	}
	if len(bufs) == 1 {
		return f.b.ReadRange(ctx, f.obj, bufs[0], off)
	}
	n := 0
	for _, d := range bufs {
		n += len(d)
	}
	bp := f.bounce.Get().(*[]byte)
	defer f.bounce.Put(bp)
	buf := (*bp)[:n]
	if err := f.b.ReadRange(ctx, f.obj, buf, off); err != nil {
		return err
	}
	for _, d := range bufs {
		buf = buf[copy(d, buf):]
	}
	return nil
}
