package remote

// Readahead: reads followed as streams, and the neighbourhood fetch.

const (
	// Readahead starts at initWindow once a reader is seen reading on from
	// where it stopped, doubles with each read that continues the stream,
	// and stops at maxWindow (or a quarter of the cache, if smaller).
	initWindow = 256 << 10
	maxWindow  = 32 << 20
	// nstreams sequential readers are followed at once (a guest reading
	// two files, the kernel's readahead beside a reader's own requests).
	nstreams = 8
	// neighbourhood: a read near earlier ones (within a stream's slack)
	// that starts no readahead also fetches the missing blocks around it
	// up to the edges of its aligned neighbourhood (widen): a directory's
	// other small files, an inode table's next entries. Random reads are
	// not widened (docs/design.md, Remote objects: readahead and the
	// neighbourhood fetch).
	neighbourhood = 128 << 10
)

type stream struct {
	next, ahead, window int64
	used                uint64
	seen                int // reads that went on from next
}

// follow records a read of [off, end) against the sequential streams and
// returns the runs of blocks to read ahead (entries made, loading), and
// whether the read went on from no stream (random, or a stream's first).
func (f *File) follow(off, end int64) (ahead [][2]int64, random bool) {
	f.tick++
	var s *stream
	// Concurrent requests of one stream arrive out of order: a reader
	// with 16 requests in flight is still one stream.
	slack := max(4*f.bs, 16*(end-off))
	for i := range f.streams {
		c := &f.streams[i]
		if c.used != 0 && off >= c.next-slack && off <= c.next+slack {
			s = c
			break
		}
	}
	if s == nil {
		// A new stream (or a random read): no readahead until it goes on.
		s = &f.streams[0]
		for i := range f.streams {
			if f.streams[i].used < s.used {
				s = &f.streams[i]
			}
		}
		*s = stream{next: end, ahead: end, used: f.tick}
		return nil, true
	}
	s.used = f.tick
	if end <= s.next {
		return nil, false // a request of the stream that arrived late, or a reread
	}
	s.next = end
	if s.seen++; s.seen < 2 {
		// Twice on before readahead: two random reads that happen to
		// fall within the slack of each other are not a stream.
		return nil, false
	}
	if s.ahead-s.next > s.window/2 {
		// Enough is on its way: the next batch goes out once the reader
		// has eaten into half of it, so each batch is a large request
		// rather than one small one per read.
		return nil, false
	}
	s.window = min(max(2*s.window, initWindow), f.window)
	target := min(s.next+s.window, f.obj.Size)
	from := max(s.ahead, s.next)
	if target <= from {
		return nil, false
	}
	s.ahead = target
	var runs [][2]int64
	for i := from / f.bs; i <= (target-1)/f.bs; i++ {
		b := f.blocks[i]
		// Not started (hi 0): the reader's own, which start makes whole.
		if b != nil && (b.hi == 0 || f.covers(b, i*f.bs, f.size(i))) {
			continue
		}
		if !f.room() {
			// The cache is all loading: readahead waits for room rather
			// than growing memory past the cache size.
			s.ahead = i * f.bs
			break
		}
		if b != nil {
			f.evict(b) // partial: the stream will want all of it
		}
		f.insert(i)
		runs = addRun(runs, i)
	}
	return runs, false
}

// widen extends run r of missing blocks (a reader's own, entries made)
// over the missing blocks next to it, up to the edges of its aligned
// neighbourhood, making their entries while the cache has room for them:
// they come in the reader's one GET. Called with mu held.
func (f *File) widen(r [2]int64) [2]int64 {
	group, per := max(neighbourhood/f.bs, 1), maxGet/f.bs
	lo := r[0] / group * group
	hi := min((r[1]+group-1)/group*group, (f.obj.Size+f.bs-1)/f.bs)
	// How far the missing blocks reach is found before room() evicts
	// anything here: an eviction would make a neighbour held when
	// widening began look missing, and fetch it again.
	down, up := r[0], r[1]
	for down > lo && f.blocks[down-1] == nil {
		down--
	}
	for up < hi && f.blocks[up] == nil {
		up++
	}
	// One GET (see start): a run of maxGet or more stays as it is.
	up = min(up, r[0]+per)
	down = max(down, up-per)
	for r[0] > down && f.room() {
		r[0]--
		f.insert(r[0])
	}
	for r[1] < up && f.room() {
		f.insert(r[1])
		r[1]++
	}
	return r
}

// addRun adds block i to runs, [first, end) pairs in order: to the last
// run when i continues it, else as a run of its own.
func addRun(runs [][2]int64, i int64) [][2]int64 {
	if k := len(runs) - 1; k >= 0 && runs[k][1] == i {
		runs[k][1]++
		return runs
	}
	return append(runs, [2]int64{i, i + 1})
}
