// Package coroutines schedules requests: the Go form of QEMU's coroutines.
// Each request that must wait runs in its own goroutine from hand-off to
// reply and parks while its I/O is in flight; this package holds what those
// goroutines and the serve loops that start them share: the loop's one
// decision per request ([Handoff], [MissTracker], [Yielder]), how a request
// came, carried on its context down to the I/O layers ([Path]), requests
// counted and drained ([InFlight]), a bound on what they hold at once
// ([Budget]), and byte-range locks ([RangeLock]). Buffer pools live in
// package aio, beside the aligned I/O they serve.
package coroutines
