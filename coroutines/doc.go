// Package coroutines coordinates requests that run as goroutines: the Go
// form of QEMU's coroutines. Each request runs in its own goroutine from
// decode to reply and parks while its I/O is in flight; this package holds
// what those goroutines share:
//
//   - [InFlight]: Begin/End around every request, Drain to wait for all of
//     them (resize, flush-all, shutdown) while holding new ones back.
//   - [RangeLock]: overlapping byte ranges serialize, disjoint ones never do.
//   - [BufPool]: aligned buffers reused across requests, so the hot path does
//     not allocate.
package coroutines
