package fuse

import "runtime"

// kernelCalls runs the calls into the kernel that may wait for our own
// work to finish (FUSE_NOTIFY_INVAL_INODE, which waits for a page whose
// READ we are answering or for the write-back of a dirty page; the flush's
// fsync; the truncate that hands a size back) on an OS thread of its own
// that never submits io_uring I/O.
//
// io_uring completes a request through task work queued on the thread
// that submitted it, which runs only when that thread leaves the kernel.
// Go runs goroutines on whatever thread is free: a notify sent from a
// thread that had submitted the host read of a READ in flight slept in
// the kernel (folio_lock, uninterruptible) waiting for that READ's pages,
// and the READ's completion waited for the same thread to leave the
// kernel: both hung for good (TestKcDirectWritesRacingCachedReads, with
// --cache none: O_DIRECT writes racing buffered reads of the same
// blocks). A thread locked to one goroutine from before serving began
// never has io_uring work of its own.
//
// Notifies never wait for one another, so one thread serves them all in
// turn; the rare calls that may wait for the inode lock an O_DIRECT
// writer holds until its reply (which may wait for a notify) get a second
// thread.
type kernelCalls struct {
	notify, other chan func()
	stop          chan struct{}
}

// startKernelCalls starts the threads; stop ends them.
func startKernelCalls() *kernelCalls {
	k := &kernelCalls{notify: make(chan func()), other: make(chan func()), stop: make(chan struct{})}
	for _, ch := range []chan func(){k.notify, k.other} {
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
// returns once it has; false: the threads have stopped (the export is
// gone) and f did not run. Without threads (k nil) f runs on the calling
// thread.
func (k *kernelCalls) onNotify(f func()) bool {
	if k == nil {
		f()
		return true
	}
	return k.run(k.notify, f)
}

func (k *kernelCalls) onOther(f func()) bool {
	if k == nil {
		f()
		return true
	}
	return k.run(k.other, f)
}

func (k *kernelCalls) run(ch chan func(), f func()) bool {
	done := make(chan struct{})
	select {
	case ch <- func() { f(); close(done) }:
	case <-k.stop:
		return false
	}
	<-done
	return true
}

func (k *kernelCalls) close() { close(k.stop) }
