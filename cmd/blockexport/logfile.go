package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"log/syslog"
	"os"
	"strings"
	"sync"
)

// serveLogger makes the serving commands' logger. Without --log-file it
// writes to stderr; but a --daemonize child lets go of stderr once it is
// up (it becomes /dev/null), and every later line, corruption reports
// included, would be lost. So: --log-file PATH appends there (created
// 0600 if missing), and a daemon without it also logs to syslog (journald
// reads it) where /dev/log exists, and says at start, on the caller's
// terminal, when its log will go nowhere.
func serveLogger(level, logFile string, daemonized bool) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(strings.ToUpper(level))); err != nil {
		return nil, usagef("unknown --log-level %q (want debug, info, warn or error)", level)
	}
	if logFile != "" {
		f, err := os.OpenFile(logFile, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
		if err != nil {
			return nil, fmt.Errorf("--log-file: %w", err)
		}
		// Kept open for the life of the process: the logger writes to
		// it until the last line.
		return slog.New(slog.NewTextHandler(f, &slog.HandlerOptions{Level: l})), nil
	}
	stderr := slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: l})
	if !daemonized {
		return slog.New(stderr), nil
	}
	w, err := syslog.Dial("", "", syslog.LOG_DAEMON|syslog.LOG_INFO, "blockexport")
	if err != nil {
		logger := slog.New(stderr)
		logger.Warn("no --log-file and no syslog (/dev/log): once the daemon is up, its log goes nowhere", "err", err)
		return logger, nil
	}
	// Until it is up, stderr is the caller's terminal: lines go there
	// too, where the user starting it reads them.
	return slog.New(teeHandler{stderr, newSyslogHandler(w, l)}), nil
}

// syslogHandler sends each record to syslog as one message, at the
// syslog priority of its level, formatted as the text handler does (less
// the time, which syslog adds).
type syslogHandler struct {
	text slog.Handler
	w    *syslog.Writer
	// out is what text writes into, shared (with its lock) by the
	// handlers WithAttrs and WithGroup derive.
	out *lockedBuffer
}

type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func newSyslogHandler(w *syslog.Writer, level slog.Leveler) *syslogHandler {
	out := &lockedBuffer{}
	text := slog.NewTextHandler(&out.buf, &slog.HandlerOptions{Level: level, ReplaceAttr: dropTime})
	return &syslogHandler{text: text, w: w, out: out}
}

func (h *syslogHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return h.text.Enabled(ctx, l)
}

func (h *syslogHandler) Handle(ctx context.Context, r slog.Record) error {
	h.out.mu.Lock()
	defer h.out.mu.Unlock()
	h.out.buf.Reset()
	if err := h.text.Handle(ctx, r); err != nil {
		return err
	}
	msg := strings.TrimSuffix(h.out.buf.String(), "\n")
	switch {
	case r.Level >= slog.LevelError:
		return h.w.Err(msg)
	case r.Level >= slog.LevelWarn:
		return h.w.Warning(msg)
	case r.Level >= slog.LevelInfo:
		return h.w.Info(msg)
	default:
		return h.w.Debug(msg)
	}
}

func (h *syslogHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &syslogHandler{text: h.text.WithAttrs(as), w: h.w, out: h.out}
}

func (h *syslogHandler) WithGroup(name string) slog.Handler {
	return &syslogHandler{text: h.text.WithGroup(name), w: h.w, out: h.out}
}

// teeHandler sends each record to every handler that takes its level.
type teeHandler []slog.Handler

func (t teeHandler) Enabled(ctx context.Context, l slog.Level) bool {
	for _, h := range t {
		if h.Enabled(ctx, l) {
			return true
		}
	}
	return false
}

func (t teeHandler) Handle(ctx context.Context, r slog.Record) error {
	var errs []error
	for _, h := range t {
		if h.Enabled(ctx, r.Level) {
			errs = append(errs, h.Handle(ctx, r.Clone()))
		}
	}
	return errors.Join(errs...)
}

func (t teeHandler) WithAttrs(as []slog.Attr) slog.Handler {
	u := make(teeHandler, len(t))
	for i, h := range t {
		u[i] = h.WithAttrs(as)
	}
	return u
}

func (t teeHandler) WithGroup(name string) slog.Handler {
	u := make(teeHandler, len(t))
	for i, h := range t {
		u[i] = h.WithGroup(name)
	}
	return u
}
