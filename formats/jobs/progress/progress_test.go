package progress

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

// Percent prints as QEMU's qemu_progress_print: 0 first, then each value
// more than 1% past the last one printed, 100 at the end, and a newline.
func TestPercentPrintsAsQemu(t *testing.T) {
	var out bytes.Buffer
	r := New(Percent, "convert", &out, nil)
	for _, d := range []int64{1, 5, 15, 20, 21, 40, 100} {
		r.Update(d, 100)
	}
	r.Finish(true, -1)
	want := "    (0.00/100%)\r    (5.00/100%)\r    (15.00/100%)\r    (20.00/100%)\r    (40.00/100%)\r    (100.00/100%)\r    (100.00/100%)\r\n"
	if out.String() != want {
		t.Fatalf("got %q\nwant %q", out.String(), want)
	}
}

// A failed job ends its percentages with a newline, without 100.
func TestPercentAfterAFailure(t *testing.T) {
	var out bytes.Buffer
	r := New(Percent, "convert", &out, nil)
	r.Update(50, 100)
	r.Finish(false, -1)
	if want := "    (0.00/100%)\r    (50.00/100%)\r\n"; out.String() != want {
		t.Fatalf("got %q, want %q", out.String(), want)
	}
}

// JSON lines carry the same keys for every job: one a percent, or one a
// step with EveryStep, and a completed line.
func TestJSONLines(t *testing.T) {
	var out bytes.Buffer
	r := New(JSON, "stream", &out, nil)
	r.Planned(100)
	r.Update(10, 100)
	r.Update(10, 100) // the same percent: no line
	r.EveryStep = true
	r.Update(10, 100)
	r.Finish(true, 100)
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	var events []string
	for _, l := range lines {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("%q: %v", l, err)
		}
		for _, k := range []string{"event", "done", "total", "percent", "bytes-per-second", "eta-seconds"} {
			if _, ok := m[k]; !ok {
				t.Errorf("%q has no %q", l, k)
			}
		}
		events = append(events, m["event"].(string))
	}
	if got := strings.Join(events, " "); got != "planned step step completed" {
		t.Fatalf("events %q", got)
	}
}

// auto is the bar on a terminal only: a buffer is none.
func TestAutoIsNoneWithoutATerminal(t *testing.T) {
	if m, err := ParseMode("auto", &bytes.Buffer{}); err != nil || m != None {
		t.Fatalf("auto without a terminal: %v, %v", m, err)
	}
	if _, err := ParseMode("fancy", nil); err == nil {
		t.Fatal("an unknown mode was taken")
	}
}
