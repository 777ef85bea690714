package fuse

import (
	"fmt"
	"log/slog"
	"math/bits"
	"strings"
	"sync/atomic"
	"time"
)

// Stats counts requests per kind, with a latency histogram, for --stats.
// Recording is a few atomic adds; nothing is recorded when stats are off
// (the server's *Stats is nil).
type Stats struct {
	kinds [numKinds]kindStats
	start time.Time
}

type statKind int

const (
	kindRead statKind = iota
	kindWrite
	kindOther
	numKinds
)

var kindNames = [numKinds]string{"read", "write", "other"}

// Latency buckets: 4 per power of two from 1 µs (bucket 0 holds less).
const latBuckets = 4 * 32

type kindStats struct {
	bytes atomic.Uint64
	lat   [latBuckets]atomic.Uint64 // sums to the count of requests
}

// NewStats starts counting now.
func NewStats() *Stats { return &Stats{start: time.Now()} }

func (s *Stats) record(k statKind, n int, d time.Duration) {
	ks := &s.kinds[k]
	ks.bytes.Add(uint64(n))
	ks.lat[latBucket(d)].Add(1)
}

func latBucket(d time.Duration) int {
	us := uint64(d / time.Microsecond)
	if us < 1 {
		return 0
	}
	p := bits.Len64(us) - 1 // 2^p <= us < 2^(p+1)
	sub := 0
	if p >= 2 {
		sub = int((us >> (p - 2)) & 3)
	}
	return min(1+4*p+sub, latBuckets-1)
}

// bucketUpper is the latency a bucket's samples stay under.
func bucketUpper(b int) time.Duration {
	if b == 0 {
		return time.Microsecond
	}
	p, sub := (b-1)/4, (b-1)%4
	base := uint64(1) << p
	step := base / 4
	if step == 0 {
		return time.Duration(2*base) * time.Microsecond
	}
	return time.Duration(base+uint64(sub+1)*step) * time.Microsecond
}

// snapshot is a copy of the counters at one moment.
type snapshot struct {
	at    time.Time
	bytes [numKinds]uint64
	lat   [numKinds][latBuckets]uint64
}

func (s *Stats) snapshot() snapshot {
	sn := snapshot{at: time.Now()}
	for k := range s.kinds {
		sn.bytes[k] = s.kinds[k].bytes.Load()
		for b := range s.kinds[k].lat {
			sn.lat[k][b] = s.kinds[k].lat[b].Load()
		}
	}
	return sn
}

// report describes what happened between two snapshots, one clause per
// kind of request that happened.
func report(from, to snapshot) string {
	secs := max(to.at.Sub(from.at).Seconds(), 1e-9) // a Duration's seconds: 0, or at least 1e-9
	var parts []string
	for k := statKind(0); k < numKinds; k++ {
		var hist [latBuckets]uint64
		ops := uint64(0)
		for b := range hist {
			hist[b] = to.lat[k][b] - from.lat[k][b]
			ops += hist[b]
		}
		if ops == 0 {
			continue
		}
		parts = append(parts, fmt.Sprintf("%s %d ops %.0f IOPS %.1f MiB/s p50 %v p99 %v p99.9 %v",
			kindNames[k], ops, float64(ops)/secs, float64(to.bytes[k]-from.bytes[k])/secs/(1<<20),
			percentile(hist, ops, 0.50), percentile(hist, ops, 0.99), percentile(hist, ops, 0.999)))
	}
	if len(parts) == 0 {
		return "idle"
	}
	return strings.Join(parts, "; ")
}

func percentile(hist [latBuckets]uint64, total uint64, q float64) time.Duration {
	want := uint64(float64(total)*q + 0.5)
	seen := uint64(0)
	for b, n := range hist {
		seen += n
		if seen >= max(want, 1) {
			return bucketUpper(b)
		}
	}
	return bucketUpper(latBuckets - 1)
}

// Run logs a line every interval until stop is closed, then a summary of
// the whole run.
func (s *Stats) Run(log *slog.Logger, interval time.Duration, stop <-chan struct{}) {
	first := snapshot{at: s.start}
	prev := s.snapshot()
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			now := s.snapshot()
			log.Info("stats", "interval", interval.String(), "requests", report(prev, now))
			prev = now
		case <-stop:
			log.Info("stats summary", "elapsed", time.Since(s.start).Round(time.Millisecond).String(), "requests", report(first, s.snapshot()))
			return
		}
	}
}
