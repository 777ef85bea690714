package convert

import (
	"os"

	"golang.org/x/sys/unix"
)

// writeBehind starts the kernel's write-back of a target file's dirty
// pages while the conversion goes on (sync_file_range WRITE, which waits
// for nothing), rather than leaving all of them to a sync at the end or
// to the kernel's thresholds (10% of memory, more than most images): the
// device then writes while the source is still read and compressed. It
// makes nothing durable that -t unsafe would not, and bounds the dirty
// pages a conversion leaves behind.
type writeBehind struct {
	f    *os.File
	kick chan struct{}
	done chan struct{}
	last int64 // progress at the last kick; guarded by the engine's one-at-a-time Progress calls
}

// writeBehindStep is how much progress starts another write-back.
const writeBehindStep = 64 << 20

// startWriteBehind returns nil when skip (an O_DIRECT target, or one on
// an NBD server) or when path cannot be opened: write-back is then the
// kernel's alone.
func startWriteBehind(path string, skip bool) *writeBehind {
	if skip {
		return nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	wb := &writeBehind{f: f, kick: make(chan struct{}, 1), done: make(chan struct{})}
	go func() {
		defer close(wb.done)
		for range wb.kick {
			// Errors are the later flush's to report; EINVAL (a file
			// system without it) only ends the write-behind.
			if err := unix.SyncFileRange(int(wb.f.Fd()), 0, 0, unix.SYNC_FILE_RANGE_WRITE); err != nil {
				for range wb.kick {
				}
				return
			}
		}
	}()
	return wb
}

// note is told the progress; every writeBehindStep it asks for a
// write-back, unless one is still running.
func (wb *writeBehind) note(done int64) {
	if done-wb.last < writeBehindStep {
		return
	}
	wb.last = done
	select {
	case wb.kick <- struct{}{}:
	default:
	}
}

func (wb *writeBehind) stop() {
	close(wb.kick)
	<-wb.done
	wb.f.Close()
}
