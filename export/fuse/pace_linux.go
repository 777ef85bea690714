package fuse

// paced says whether the loop of q, having answered a request, asks
// /dev/fuse a while for the next one before it sleeps in read(2). Not
// while a request is in flight in a goroutine: that one needs the CPU
// (its peer's reply, its I/O's completion) more than the loop does.
func (s *server) paced(q *queue) bool {
	if !s.pace || s.pollFor > 0 || s.comp != nil || q.helper || s.hand.Busy() {
		return false
	}
	return q.pace.next(q.queued)
}

// depthGuess tells a reader at queue depth 1 (nothing queued right after a
// reply) from a deeper one by sampling the queue, so that the loop spins
// only while spins pay (docs/design.md, Pacing at queue depth 1).
type depthGuess struct {
	n        uint8 // requests since the last sample (not spinning)
	empty    uint8 // samples in a row that found nothing queued
	spinning bool
	busy     uint8 // spins in a row that found a request at once
	idle     uint8 // spins in a row that timed out
	began    int   // times spinning started, which a deeper reader keeps rare
}

const (
	paceSampleEvery = 16
	paceEmptyToSpin = 4
	paceBusyToStop  = 2
	paceIdleToStop  = 8
)

// next says whether to spin after this request; queued is asked only
// for a sample.
func (g *depthGuess) next(queued func() bool) bool {
	if g.spinning {
		return true
	}
	if g.n++; g.n < paceSampleEvery {
		return false
	}
	g.n = 0
	if queued() {
		g.empty = 0
		return false
	}
	if g.empty++; g.empty >= paceEmptyToSpin {
		*g = depthGuess{spinning: true, began: g.began + 1}
	}
	return false
}

// spun records how a spin ended (spinForRequest's count): a request
// there at the first look (0), one that came while spinning, or none
// (-1).
func (g *depthGuess) spun(looks int) {
	switch {
	case looks == 0:
		g.idle = 0
		if g.busy++; g.busy >= paceBusyToStop {
			*g = depthGuess{began: g.began}
		}
	case looks > 0:
		g.busy, g.idle = 0, 0
	default:
		g.busy = 0
		if g.idle++; g.idle >= paceIdleToStop {
			*g = depthGuess{began: g.began}
		}
	}
}
