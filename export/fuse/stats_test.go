package fuse

import (
	"strings"
	"testing"
	"time"
)

func TestLatencyBucketsBoundTheirSamples(t *testing.T) {
	for _, d := range []time.Duration{0, 500 * time.Nanosecond, time.Microsecond, 3 * time.Microsecond,
		7 * time.Microsecond, 100 * time.Microsecond, 1234 * time.Microsecond, time.Second, time.Hour} {
		b := latBucket(d)
		if b < latBuckets-1 && d >= bucketUpper(b) {
			t.Errorf("%v in bucket %d whose upper bound is %v", d, b, bucketUpper(b))
		}
		if b > 0 && d < bucketUpper(b-1) {
			t.Errorf("%v in bucket %d, but bucket %d already holds it (< %v)", d, b, b-1, bucketUpper(b-1))
		}
	}
}

func TestReportPercentiles(t *testing.T) {
	s := NewStats()
	before := s.snapshot()
	for i := 0; i < 99; i++ {
		s.record(kindRead, 4096, 10*time.Microsecond)
	}
	s.record(kindRead, 4096, 5*time.Millisecond)
	line := report(before, s.snapshot())
	if !strings.HasPrefix(line, "read 100 ops") || !strings.Contains(line, "p50 12µs") || !strings.Contains(line, "p99.9 5.") {
		t.Fatalf("report: %s", line)
	}
	if strings.Contains(line, "write") {
		t.Fatalf("a kind with no requests is reported: %s", line)
	}
}
