package fuse

// Dispatch: one table (ops) says how each opcode is answered; dispatch
// applies it, and --stats counts around it (serveRequest).

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/blockexport/blockexport/coroutines"
)

// op is what the server does with one opcode.
type op struct {
	// inline answers the request in the loop, without waiting, if it
	// can, and says whether it did (or no reply is needed).
	inline func(s *server, q *queue, req []byte) bool
	// wait answers a request that may wait for I/O; ctx ends on an
	// INTERRUPT for it. Nil: inline always answers.
	wait func(s *server, ctx context.Context, to replyTo, req []byte)
	// mayBlockLoop: the loop may run wait itself when it is alone
	// (runHere). Only writes: others (fsync above all) may take long.
	mayBlockLoop bool
}

// ops is the opcode table; opcodes not in it are answered ENOSYS. READ
// is not in it: dispatch hands it to read (read_linux.go).
var ops = [...]op{
	opLookup:      {inline: (*server).lookup},
	opForget:      {inline: noReply},
	opBatchForget: {inline: noReply},
	opInterrupt:   {inline: (*server).interrupt},
	opInit:        {inline: replyConst(-int32(unix.EPROTO))}, // only once, in handshake
	opDestroy:     {inline: replyConst(0)},
	opRelease:     {inline: replyConst(0)},
	opGetattr:     {inline: (*server).getattr},
	opOpen:        {inline: (*server).open},
	opStatfs:      {inline: (*server).statfs},
	opWrite:       {inline: (*server).tryWrite, wait: (*server).write, mayBlockLoop: true},
	opSetattr:     {wait: (*server).setattr},
	opFsync:       {wait: (*server).flush},
	opFlush:       {wait: (*server).flush},
	opFallocate:   {wait: (*server).fallocate},
	opLseek:       {wait: (*server).lseek},
	opSyncfs:      {wait: (*server).flush},

	// Only with --file-name is the root a directory (dir_linux.go). It
	// holds the one file: nothing is made or removed there.
	opOpendir:    {inline: (*server).opendir},
	opReaddir:    {inline: (*server).readdir},
	opReleasedir: {inline: replyConst(0)},
	opFsyncdir:   {inline: replyConst(0)},
	opSymlink:    {inline: replyConst(-int32(unix.EPERM))},
	opMknod:      {inline: replyConst(-int32(unix.EPERM))},
	opMkdir:      {inline: replyConst(-int32(unix.EPERM))},
	opUnlink:     {inline: replyConst(-int32(unix.EPERM))},
	opRmdir:      {inline: replyConst(-int32(unix.EPERM))},
	opRename:     {inline: replyConst(-int32(unix.EPERM))},
	opRename2:    {inline: replyConst(-int32(unix.EPERM))},
	opLink:       {inline: replyConst(-int32(unix.EPERM))},
	opCreate:     {inline: replyConst(-int32(unix.EPERM))},
	opTmpfile:    {inline: replyConst(-int32(unix.EPERM))},
}

// serveRequest answers one request read into q's buffer, counted for
// --stats here or by the goroutine that finishes it.
func (s *server) serveRequest(q *queue, req []byte) {
	if s.stats == nil {
		s.dispatch(q, req, time.Time{})
		return
	}
	began := time.Now()
	k, n := statKindOf(req)
	if s.dispatch(q, req, began) {
		s.stats.record(k, n, time.Since(began))
	}
}

// dispatch answers req through the table: inline if the op can, else in
// the loop when it is alone, else in a goroutine. It reports whether the
// request finished here.
func (s *server) dispatch(q *queue, req []byte, began time.Time) bool {
	h := (*fuse.InHeader)(unsafe.Pointer(&req[0]))
	if h.Opcode == opRead {
		return s.read(q, req, began)
	}
	var o *op
	if int(h.Opcode) < len(ops) {
		o = &ops[h.Opcode]
	}
	if o == nil || (o.inline == nil && o.wait == nil) {
		s.replyErr(q.to, h.Unique, unix.ENOSYS)
		return true
	}
	if o.inline != nil && o.inline(s, q, req) {
		return true
	}
	if o.mayBlockLoop && !s.handOffOnly(req) &&
		s.runHere(q, h.Unique, func(ctx context.Context, to replyTo) { o.wait(s, ctx, to, req) }) {
		return true
	}
	s.handOff(q, req, o.wait, began)
	return false
}

// runHere runs a request that may block the loop where it need not be
// handed off: in the loop when nothing else is in flight or queued, or,
// for an image that may stall, on a plain loop's goroutine with a stand-in
// ready (runStalling). false: nothing ran.
func (s *server) runHere(q *queue, unique uint64, run func(ctx context.Context, to replyTo)) bool {
	switch {
	case !s.stalls && s.hand.Lone(q.queued):
		run(s.hand.Context(coroutines.Lone), q.to)
	case s.stalls && !q.helper && s.comp == nil && s.hand.Lone(q.queued):
		s.runStalling(q, unique, run)
	default:
		return false
	}
	return true
}

// standInAfter is how long a lone request of an image that may stall
// runs on its loop's goroutine before a stand-in takes the queue over.
const standInAfter = time.Millisecond

// runStalling runs a lone request of an image that may stall on the loop's
// own goroutine; if it has not finished within standInAfter, a stand-in
// loop takes the queue over and this loop ends once the request has
// (docs/design.md, The stand-in loop for lone requests). Its I/O cannot be
// cancelled (no Done), so an INTERRUPT the stand-in reads for it, once the
// grace period has passed, answers it EINTR on its behalf and its own
// reply is dropped (replyTo.once). It counts as a handed-off request.
func (s *server) runStalling(q *queue, unique uint64, run func(ctx context.Context, to replyTo)) {
	r := s.pending.add(unique, s.hand.Context(coroutines.Lone), s, q.to)
	to := q.to
	to.once = &r.once // r is the request's until finish, after its reply
	s.hand.Start()
	var state atomic.Int32 // 0: running, 1: done in time, 2: stand-in started
	t := time.AfterFunc(standInAfter, func() {
		if state.CompareAndSwap(0, 2) {
			s.standIn(q)
		}
	})
	run(s.hand.Context(coroutines.Lone), to)
	s.pending.finish(unique, r)
	s.hand.Done()
	if state.CompareAndSwap(0, 1) {
		t.Stop()
		q.awaitNext = true
		return
	}
	q.over = true
}

// standIn starts a loop that takes queue q over from a loop busy with a
// request: with a request buffer of its own (the request lives in q's),
// q's inline-read buffer (only a loop serving uses it) and q's end.
func (s *server) standIn(q *queue) {
	s.loops.Add(1)
	go s.run(&queue{fd: q.fd, to: replyTo{fd: q.fd}, bp: s.bufs.Get(), out: q.out, outHold: q.outHold, end: q.end})
}

// handOff finishes req in a goroutine with a buffer of its own (see
// queue): a pooled copy below bulkWrite, the loop's own buffer from there.
func (s *server) handOff(q *queue, req []byte, wait func(*server, context.Context, replyTo, []byte), began time.Time) {
	unique := (*fuse.InHeader)(unsafe.Pointer(&req[0])).Unique
	ctx := s.pending.add(unique, s.hand.Context(coroutines.Fresh), nil, replyTo{})
	to := q.to
	if len(req) >= bulkWrite {
		bp := q.bp
		q.bp = s.bufs.Get()
		s.hand.Start()
		go func() {
			defer s.bufs.Put(bp)
			s.finish(ctx, unique, to, req, wait, began)
		}()
		return
	}
	pool := s.pool(reqPad + len(req))
	b, bp := pool.Buffer(reqPad + len(req))
	b = b[reqPad:]
	copy(b, req)
	s.hand.Start()
	go func() {
		defer pool.Release(bp)
		s.finish(ctx, unique, to, b, wait, began)
	}()
	s.hand.Yield()
}

// finish runs a handed-off request and gives its context back.
func (s *server) finish(ctx *reqCtx, unique uint64, to replyTo, req []byte, wait func(*server, context.Context, replyTo, []byte), began time.Time) {
	defer s.hand.Done()
	defer s.pending.finish(unique, ctx)
	wait(s, ctx, to, req) // req is this goroutine's until it returns
	if s.stats != nil {
		k, n := statKindOf(req)
		s.stats.record(k, n, time.Since(began))
	}
}

// pool is the buffer pool for n bytes: the small one where it will do.
func (s *server) pool(n int) bufferPool {
	if n <= s.small.Size() {
		return s.small
	}
	return s.bufs
}

// pending maps the unique of each request running in a goroutine to its
// context, so that an INTERRUPT can cancel its I/O (requests the loop
// answers itself finish before it reads the next). An INTERRUPT cancels
// only a request still running a grace period later: the kernel sends one
// for any signal (Go's SIGURG too), and few programs expect EINTR from a
// regular file (docs/design.md, The request path). Contexts are pooled.
type pending struct {
	mu    sync.Mutex
	m     map[uint64]*reqCtx
	grace time.Duration
	pool  sync.Pool
}

// reqCtx is a handed-off request's context: its path's (never
// cancelled), with a done channel an INTERRUPT may close.
type reqCtx struct {
	context.Context
	done   chan struct{}
	closed atomic.Bool // done is closed: the request was cancelled
	timer  *time.Timer // the cancel an INTERRUPT scheduled, if any
	// stalled, if set, is the server of a request whose I/O cannot be
	// cancelled (runStalling): a cancel answers it EINTR now, to eintr,
	// and once is taken by whichever reply comes first (replyTo.once).
	stalled *server
	eintr   replyTo
	once    atomic.Bool
}

func (r *reqCtx) Done() <-chan struct{} { return r.done }

func (r *reqCtx) Err() error {
	if r.closed.Load() {
		return context.Canceled
	}
	return r.Context.Err()
}

// interruptGrace is how long an interrupted request may still run.
const interruptGrace = 2 * time.Second

// add makes the context of request unique; finish gives it back. For a
// request whose I/O a cancel cannot end (s not nil), the cancel answers
// it EINTR to eintr instead (under p.mu).
func (p *pending) add(unique uint64, parent context.Context, s *server, eintr replyTo) *reqCtx {
	r, _ := p.pool.Get().(*reqCtx)
	if r == nil || r.closed.Load() {
		r = &reqCtx{done: make(chan struct{})}
	}
	r.Context, r.timer, r.stalled, r.eintr = parent, nil, s, eintr
	r.once.Store(false)
	p.mu.Lock()
	p.m[unique] = r
	p.mu.Unlock()
	return r
}

func (p *pending) finish(unique uint64, r *reqCtx) {
	p.mu.Lock()
	delete(p.m, unique)
	if r.timer != nil {
		r.timer.Stop()
	}
	p.mu.Unlock()
	r.Context, r.stalled, r.eintr = nil, nil, replyTo{}
	p.pool.Put(r)
}

// interrupt cancels request unique if it still runs a grace period from
// now; false: no such request runs.
func (p *pending) interrupt(unique uint64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	r, ok := p.m[unique]
	if !ok {
		return false
	}
	if r.timer == nil {
		r.timer = time.AfterFunc(p.grace, func() { p.cancel(unique, r) })
	}
	return true
}

// cancel closes r's done channel if r still runs request unique.
func (p *pending) cancel(unique uint64, r *reqCtx) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.m[unique] == r && !r.closed.Load() {
		r.closed.Store(true)
		close(r.done)
		if r.stalled != nil && r.once.CompareAndSwap(false, true) {
			r.stalled.replyErr(r.eintr, unique, unix.EINTR)
		}
	}
}

func noReply(*server, *queue, []byte) bool { return true }

// replyConst answers with a fixed status (0 or -errno) and no payload.
func replyConst(status int32) func(*server, *queue, []byte) bool {
	return func(s *server, q *queue, req []byte) bool {
		s.reply(q.to, (*fuse.InHeader)(unsafe.Pointer(&req[0])).Unique, status)
		return true
	}
}

// interrupt cancels the request an INTERRUPT names, if it still runs (see
// pending). The INTERRUPT gets no reply.
func (s *server) interrupt(_ *queue, req []byte) bool {
	s.pending.interrupt(decode[fuse.InterruptIn](req).Unique)
	return true
}

func (s *server) getattr(q *queue, req []byte) bool {
	var o fuse.AttrOut
	st := fuse.OK
	if s.isRootDir(req) {
		s.dirAttr(&o.Attr)
		o.SetTimeout(attrTimeout)
	} else {
		st = s.expOf(req).GetAttr(context.Background(), decode[fuse.GetAttrIn](req), &o)
	}
	replyOut(s, q.to, header(req).Unique, st, &o)
	return true
}

func (s *server) open(q *queue, req []byte) bool {
	var o fuse.OpenOut
	st := s.expOf(req).Open(decode[fuse.OpenIn](req), &o)
	replyOut(s, q.to, header(req).Unique, st, &o)
	return true
}

func (s *server) statfs(q *queue, req []byte) bool {
	var o fuse.StatfsOut
	st := s.exp.StatFs(context.Background(), header(req), &o)
	replyOut(s, q.to, header(req).Unique, st, &o)
	return true
}

// tryWrite answers a write the image does without waiting.
func (s *server) tryWrite(q *queue, req []byte) bool {
	in, data, ok := writePayload(req)
	if !ok {
		return false // write answers EINVAL
	}
	exp := s.expOf(req)
	n, st, ok, d := exp.TryWrite(in, data)
	if !ok {
		return false
	}
	o := fuse.WriteOut{Size: n}
	if d.needed() {
		// The kernel's pages of the range go before the reply, from
		// outside the loop (the notify may wait for a write-back).
		unique, to := in.Unique, q.to
		s.hand.Start()
		go func() {
			defer s.hand.Done()
			exp.finishBypass(d)
			replyOut(s, to, unique, st, &o)
		}()
		return true
	}
	replyOut(s, q.to, in.Unique, st, &o)
	return true
}

func (s *server) write(ctx context.Context, to replyTo, req []byte) {
	in, data, ok := writePayload(req)
	if !ok {
		s.replyErr(to, in.Unique, unix.EINVAL)
		return
	}
	n, st := s.expOf(req).Write(ctx, in, data)
	o := fuse.WriteOut{Size: n}
	replyOut(s, to, in.Unique, st, &o)
}

func (s *server) setattr(ctx context.Context, to replyTo, req []byte) {
	if s.isRootDir(req) {
		s.replyErr(to, header(req).Unique, unix.EPERM) // the directory is not ours to change
		return
	}
	var o fuse.AttrOut
	st := s.expOf(req).SetAttr(ctx, decode[fuse.SetAttrIn](req), &o)
	replyOut(s, to, header(req).Unique, st, &o)
}

// flush makes the image durable for FLUSH, FSYNC and SYNCFS alike (the
// kernel sends SYNCFS after writing its dirty pages back; a qcow2 image
// has metadata of its own to write).
func (s *server) flush(ctx context.Context, to replyTo, req []byte) {
	s.replyData(to, header(req).Unique, s.expOf(req).Flush(ctx))
}

func (s *server) fallocate(ctx context.Context, to replyTo, req []byte) {
	s.replyData(to, header(req).Unique, s.expOf(req).Fallocate(ctx, decode[fuse.FallocateIn](req)))
}

func (s *server) lseek(ctx context.Context, to replyTo, req []byte) {
	var o fuse.LseekOut
	st := s.expOf(req).Lseek(ctx, decode[fuse.LseekIn](req), &o)
	replyOut(s, to, header(req).Unique, st, &o)
}

// writePayload splits a WRITE request into its op struct and payload; ok
// false means the payload is not all there.
func writePayload(req []byte) (in *fuse.WriteIn, data []byte, ok bool) {
	in = decode[fuse.WriteIn](req)
	hdr := int(unsafe.Sizeof(fuse.WriteIn{}))
	if len(req) < hdr || int(in.Size) > len(req)-hdr {
		return in, nil, false
	}
	return in, req[hdr : hdr+int(in.Size)], true
}

// statKindOf is how --stats counts a request: its kind and bytes.
func statKindOf(req []byte) (statKind, int) {
	switch header(req).Opcode {
	case opRead:
		return kindRead, int(decode[fuse.ReadIn](req).Size)
	case opWrite:
		return kindWrite, int(decode[fuse.WriteIn](req).Size)
	}
	return kindOther, 0
}
