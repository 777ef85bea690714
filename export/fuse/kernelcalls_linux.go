package fuse

import "runtime"

// kernelCalls runs the calls into the kernel that may wait for our own work
// (FUSE_NOTIFY_INVAL_INODE, which waits for a page whose READ we answer or
// for a dirty page's write-back; the flush's fsync; the truncate that hands
// a size back) on OS threads of their own that never submit io_uring I/O:
// io_uring completes a request through task work on the submitting thread,
// run only when that thread leaves the kernel, so a notify from a thread
// that submitted a READ's host read would wait (folio_lock) for its own
// completion. Notifies never wait for one another, so one thread serves
// them all; the calls that may wait for the inode lock of an O_DIRECT
// writer (whose reply may wait for a notify) get a second thread.
type kernelCalls struct {
	ch   [2]chan func() // the notify thread's, the other's
	stop chan struct{}
}

// startKernelCalls starts the threads; stop ends them.
func startKernelCalls() *kernelCalls {
	k := &kernelCalls{ch: [2]chan func(){make(chan func()), make(chan func())}, stop: make(chan struct{})}
	for _, ch := range k.ch {
		go func() {
			// Never unlocked: the thread ends with the goroutine.
			runtime.LockOSThread()
			for {
				select {
				case f := <-ch:
					f()
				case <-k.stop:
					return
				}
			}
		}()
	}
	return k
}

// onNotify runs f on the notify thread, onOther on the other one, and
// returns its error once it has, or nil at once without running it when
// the threads have stopped (the export is gone, and its cache with it).
// Without threads (k nil) f runs on the calling thread.
func (k *kernelCalls) onNotify(f func() error) error { return k.run(0, f) }
func (k *kernelCalls) onOther(f func() error) error  { return k.run(1, f) }

func (k *kernelCalls) run(thread int, f func() error) (err error) {
	if k == nil {
		return f()
	}
	done := make(chan struct{})
	select {
	case k.ch[thread] <- func() { err = f(); close(done) }:
	case <-k.stop:
		return nil
	}
	<-done
	return err
}

func (k *kernelCalls) close() { close(k.stop) }
