package fuse

// The READ path, in one place (see the package doc, One READ).

import (
	"context"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/blockexport/blockexport/coroutines"
)

// read answers a READ here or hands it off; it reports whether the
// request finished here (dispatch).
func (s *server) read(q *queue, req []byte, began time.Time) bool {
	e, in := s.expOf(req), decode[fuse.ReadIn](req)
	r, ok := e.planRead(in, true)
	if !ok {
		// Working it out may wait: all of it in a goroutine.
		s.handOffRead(q, e, in, readOp{}, false, coroutines.Fresh, began)
		return false
	}
	path := coroutines.Fresh
	if s.hand.Reads.ShouldTry() {
		hit := s.readInline(q, e, in.Unique, r)
		s.hand.Reads.Note(hit)
		if hit {
			return true
		}
		path = coroutines.AfterMiss
	}
	if s.runHere(q, in.Unique, func(ctx context.Context, to replyTo) { s.finishRead(ctx, to, e, in.Unique, r) }) {
		return true
	}
	s.handOffRead(q, e, in, r, true, path, began)
	return false
}

// readInline answers r without waiting if the image can: from its pages
// where it lends them, else read into the loop's out buffer.
func (s *server) readInline(q *queue, e *Export, unique uint64, r readOp) bool {
	v, ok := e.lendPages(r, q.lent[:0])
	q.lent = v[:0]
	if ok {
		s.replyData(q.to, unique, fuse.OK, v...)
		e.endRead()
		return true
	}
	n, ok := e.tryRead(r, q.out)
	if ok {
		s.replyData(q.to, unique, fuse.OK, q.out[:n])
		e.endRead()
	}
	return ok
}

// finishRead reads r where it may wait and replies: from the image's
// cache where it lends it, or from a pooled buffer.
func (s *server) finishRead(ctx context.Context, to replyTo, e *Export, unique uint64, r readOp) {
	defer e.endRead()
	if bufs, release, st, ok := e.lendCache(ctx, r); ok {
		s.replyData(to, unique, st, bufs...)
		if release != nil {
			release()
		}
		return
	}
	pool := s.pool(int(r.size()))
	ob, bp := pool.Buffer(int(r.size()))
	defer pool.Release(bp)
	n, st := e.read(ctx, r, ob)
	s.replyData(to, unique, st, ob[:n])
}

// handOffRead finishes a READ in a goroutine, with a copy of the
// request's fields and its plan if it was made (planned), nothing of the
// loop's buffer.
func (s *server) handOffRead(q *queue, e *Export, req *fuse.ReadIn, r readOp, planned bool, path coroutines.Path, began time.Time) {
	ctx := s.pending.add(req.Unique, s.hand.Context(path), nil, replyTo{})
	to, in := q.to, *req
	s.hand.Start()
	go func() {
		defer s.hand.Done()
		defer s.pending.finish(in.Unique, ctx)
		if !planned {
			r, _ = e.planRead(&in, false)
		}
		s.finishRead(ctx, to, e, in.Unique, r)
		if s.stats != nil {
			s.stats.record(kindRead, int(in.Size), time.Since(began))
		}
	}()
	s.hand.Yield()
}
