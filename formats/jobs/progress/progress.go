// Package progress shows how far a long job (convert, stream) has come,
// the same way for every job: qemu-img's percentage lines, a bar on a
// terminal, or JSON lines for programs.
package progress

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"
)

// Mode is how progress is shown.
type Mode string

const (
	// None shows nothing.
	None Mode = "none"
	// Percent is qemu-img's -p: "    (12.34/100%)\r" on stdout, each time
	// the job has come more than 1% further, then a newline, on a
	// terminal or not.
	Percent Mode = "percent"
	// Bar draws a bar with the rate and an ETA on stderr.
	Bar Mode = "bar"
	// JSON prints one JSON object a line on stdout (see Line).
	JSON Mode = "json"
	// Auto is Bar where stderr is a terminal, else None.
	Auto Mode = "auto"
)

// Modes are the values --progress takes.
var Modes = []string{string(Auto), string(Bar), string(JSON), string(Percent), string(None)}

// ParseMode reads a --progress value; Auto is resolved against stderr.
func ParseMode(s string, stderr io.Writer) (Mode, error) {
	switch m := Mode(s); m {
	case None, Percent, Bar, JSON:
		return m, nil
	case Auto:
		if IsTerminal(stderr) {
			return Bar, nil
		}
		return None, nil
	}
	return None, fmt.Errorf("unknown --progress %q (want auto, bar, json, percent or none)", s)
}

// IsTerminal says whether w is a terminal.
func IsTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// Line is one JSON progress line. Event is "planned" (Total is known),
// "step" or "completed".
type Line struct {
	Event   string  `json:"event"`
	Offset  int64   `json:"offset,omitempty"`
	Length  int64   `json:"length,omitempty"`
	Done    int64   `json:"done"`
	Durable *int64  `json:"durable,omitempty"` // of Done, what a flush made durable (jobs that flush as they go)
	Total   int64   `json:"total"`
	Percent int     `json:"percent"`
	Rate    float64 `json:"bytes-per-second"`
	ETA     float64 `json:"eta-seconds"`
}

// Reporter shows one job's progress. Its methods may be called from any
// goroutine, one at a time or not.
type Reporter struct {
	mode   Mode
	what   string
	stdout io.Writer
	stderr io.Writer
	// EveryStep: a JSON line for every step (a job whose steps say what
	// they copied), rather than one a percent.
	EveryStep bool

	mu          sync.Mutex
	start       time.Time
	bar         *progressbar.ProgressBar
	enc         *json.Encoder
	done, total int64
	lastPct     int
	shown       float32 // Percent: the value printed last
}

// New returns a Reporter for the job named what ("convert", "stream").
func New(mode Mode, what string, stdout, stderr io.Writer) *Reporter {
	r := &Reporter{mode: mode, what: what, stdout: stdout, stderr: stderr, start: time.Now(), lastPct: -1,
		enc: json.NewEncoder(stdout)}
	if mode == Percent {
		r.printPercent(0) // qemu-img prints 0.00 before it starts
	}
	return r
}

// Mode is how r shows progress.
func (r *Reporter) Mode() Mode { return r.mode }

// Planned says how much the job will do.
func (r *Reporter) Planned(total int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.total = total
	switch r.mode {
	case Bar:
		r.bar = progressbar.NewOptions64(total, progressbar.OptionSetWriter(r.stderr), progressbar.OptionShowBytes(true),
			progressbar.OptionSetPredictTime(true), progressbar.OptionShowCount(), progressbar.OptionSetDescription(r.what),
			progressbar.OptionThrottle(100*time.Millisecond), progressbar.OptionFullWidth(),
			progressbar.OptionOnCompletion(func() { fmt.Fprintln(r.stderr) }))
	case JSON:
		r.enc.Encode(Line{Event: "planned", Total: total})
	}
}

// Update says done of total are done.
func (r *Reporter) Update(done, total int64) { r.Step(Line{Done: done, Total: total}) }

// Step says how far the job has come (Done of Total; a job that flushes
// says what is Durable; Offset and Length say what the step did).
func (r *Reporter) Step(s Line) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.done, r.total = s.Done, s.Total
	switch r.mode {
	case Bar:
		if r.bar != nil {
			r.bar.Set64(s.Done)
		}
	case Percent:
		if s.Total > 0 {
			r.printPercent(float32(100 * float64(s.Done) / float64(s.Total)))
		}
	case JSON:
		s.Event, s.Percent = "step", percentOf(s.Done, s.Total)
		if s.Percent == r.lastPct && !r.EveryStep {
			return
		}
		r.lastPct = s.Percent
		if el := time.Since(r.start).Seconds(); el > 0 && s.Done > 0 {
			s.Rate = float64(s.Done) / el
			s.ETA = float64(s.Total-s.Done) / s.Rate
		}
		r.enc.Encode(s)
	}
}

// Finish ends the display: ok says the job completed (durable: what it
// made durable, -1 for a job that does not say).
func (r *Reporter) Finish(ok bool, durable int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch r.mode {
	case Bar:
		switch {
		case r.bar != nil && ok:
			r.bar.Finish()
		case r.bar != nil:
			fmt.Fprintln(r.stderr)
		}
	case Percent:
		if ok {
			r.printPercent(100)
		}
		fmt.Fprint(r.stdout, "\n")
	case JSON:
		if ok {
			l := Line{Event: "completed", Done: r.done, Total: r.total, Percent: 100}
			if durable >= 0 {
				l.Durable = &durable
			}
			r.enc.Encode(l)
		}
	}
}

// printPercent is qemu_progress_print(cur, 0) of QEMU's
// util/qemu-progress.c, in its float arithmetic: printed when more than
// 1% past the last print, or at 0 or 100.
func (r *Reporter) printPercent(cur float32) {
	cur = min(cur, 100)
	if cur > r.shown+1 || cur == 100 || cur == 0 {
		r.shown = cur
		fmt.Fprintf(r.stdout, "    (%3.2f/100%%)\r", cur)
	}
}

func percentOf(done, total int64) int {
	if total <= 0 {
		return 100
	}
	return int(done * 100 / total)
}
